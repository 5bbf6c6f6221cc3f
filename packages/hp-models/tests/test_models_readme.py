"""The README example runs as written: on every rank the loss equals the serial loss."""

from pathlib import Path

import pytest

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.timeout(300)
def test_readme_example_runs():
    out = run_markdown_example(README, timeout=280).splitlines()
    assert out == [f"{r} (2, 4, 48) (2, 16, 48) True" for r in range(4)]


def _block_index(marker: str) -> int:
    """The index of the README's python block containing ``marker`` (sections may move)."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return next(i for i, block in enumerate(blocks) if marker in block)


@pytest.mark.timeout(600)
def test_readme_packed_documents_example_runs():
    index = _block_index("OFFSETS = [0, 5, 6, 11, 16]")
    out = run_markdown_example(README, index, timeout=560)
    assert "each document alone:" in out


@pytest.mark.timeout(300)
def test_readme_from_pretrained_example_runs():
    index = _block_index("model = from_pretrained(folder, mesh, ep=4, **LOAD)")
    out = run_markdown_example(README, index, timeout=280).splitlines()
    assert out == [f"{r} True True True" for r in range(4)]


@pytest.mark.timeout(200)
def test_readme_plan_example_runs():
    index = _block_index("from hyper_parallel.models import plan_memory")
    out = run_markdown_example(README, index, timeout=180).splitlines()
    assert out[0].startswith("parameters ") and out[0].endswith(("fits 64 GB: True", "False"))
    assert out[1].startswith("largest collective: ")


@pytest.mark.timeout(300)
def test_readme_pipeline_example_runs():
    index = _block_index("pm = pipeline_model(tiny_model(")
    out = run_markdown_example(README, index, timeout=280).splitlines()
    assert out == [f"{r} {[r // 2]} [2, 2] True" for r in range(4)]


@pytest.mark.timeout(300)
def test_readme_forward_backward_overlap_example_runs():
    index = _block_index('overlap="forward_backward"\n    )')
    out = run_markdown_example(README, index, timeout=280).splitlines()
    assert out == ["0 True True", "1 True True"]
