"""The README example runs as written."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    out = run_markdown_example(README).splitlines()
    assert len(out) == 2
    for line in out:
        assert (
            "((2, 8, 64), torch.Size([128, 64]), ('torch', 'tensors are on cpu, not npu'))" in line
        )
