"""The README examples run as written and show what they say."""

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


def test_readme_block_example_equals_the_stock_qwen3_next_block():
    lines = run_markdown_example(README, 1).splitlines()
    assert lines == [f"{rank} ((2, 5, 32), True, True, (10, 2), 40)" for rank in range(2)]


def test_readme_dispatcher_example_runs_a_users_dispatcher_by_name():
    lines = run_markdown_example(README, 2).splitlines()
    assert lines == [f"{rank} (True, 'counting', True, True)" for rank in range(2)]
