"""The README example runs as written and shows what it says."""

from pathlib import Path

from hyper_parallel.dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_matches_the_serial_module():
    lines = run_markdown_example(README, 0).splitlines()
    assert len(lines) == 2
    rows = []
    for rank, line in enumerate(lines):
        assert line.startswith(f"{rank} ((10, 32), True, True, 4, 40, ["), line
        rows.append(eval(line.split(", 40, ")[1].rstrip(")")))
    assert sum(map(sum, rows)) == 40  # every pair computed once, on its expert's rank
