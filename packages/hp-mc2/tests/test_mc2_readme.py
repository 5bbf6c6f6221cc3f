"""The README examples run as written."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_gated_mlp_example_runs():
    out = run_markdown_example(README, 0).splitlines()
    assert len(out) == 2
    placements = "['(Shard(dim=0),)', '(Shard(dim=0),)', '(Shard(dim=1),)']"
    for line in out:
        assert f"((2, 8, 64), True, True, {placements})" in line, line


def test_readme_column_row_example_runs():
    out = run_markdown_example(README, 1).splitlines()
    assert len(out) == 2
    for line in out:
        assert (
            "((2, 8, 64), torch.Size([128, 64]), ('torch', 'tensors are on cpu, not npu'))" in line
        )
