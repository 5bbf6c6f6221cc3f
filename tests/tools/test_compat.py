"""The torch compatibility matrix's bookkeeping (tools/compat.py): the selection, the per-package
status from test outcomes, and a table that lists every version, run or not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import compat  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_selection_names_existing_test_files_of_every_package() -> None:
    nodes = compat.selection()
    assert nodes
    for node in nodes:
        assert (ROOT / node.split("::")[0]).is_file(), node
    assert {compat.package_of(n) for n in nodes} == set(compat.PACKAGES)


def test_ci_selection_is_the_selection_less_the_readme_examples_and_still_covers_every_package():
    full, ci = compat.selection(), compat.selection(ci=True)
    readme = [n for n in full if n.split("::")[0].endswith("_readme.py")]
    assert readme and all(n not in ci for n in readme)
    assert ci == [n for n in full if n not in readme]
    assert {compat.package_of(n) for n in ci} == set(compat.PACKAGES)
    assert compat.result_path("2.7.1", ci=True).parent == compat.RESULTS / "ci"
    assert compat.result_path("2.7.1").parent == compat.RESULTS  # a row of the table


def _case(pkg: str, outcome: str, message: str = "") -> dict:
    return {"nodeid": f"x::{outcome}", "package": pkg, "outcome": outcome, "message": message}


def test_status_is_failed_passed_not_applicable_or_not_run() -> None:
    cases = [
        _case("hp-dtensor", "passed"),
        _case("hp-dtensor", "failed", "boom"),
        _case("hp-mc2", "passed"),
        _case("hp-mc2", "skipped", "needs X"),
        _case("hp-models", "skipped", "cannot exist on torch 2.7"),
    ]
    got = compat.summarize(cases)
    assert got["hp-dtensor"]["status"] == "failed"
    assert got["hp-dtensor"]["failures"] == ["x::failed: boom"]
    assert got["hp-mc2"]["status"] == "passed"
    assert got["hp-mc2"]["skip_reasons"] == ["needs X"]
    assert got["hp-models"]["status"] == "not applicable"
    assert got["hp-kda-kernels"]["status"] == "not run"


def test_table_has_a_row_per_version_and_says_which_were_not_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(compat, "RESULTS", tmp_path)
    record = {
        "torch_requested": "2.7.1",
        "date": "2026-12-01 10:00 UTC",
        "versions": {"torch": "2.7.1", "triton": "3.3.1"},
        "install_s": 40.0,
        "tests_s": 300.0,
        "packages": compat.summarize([_case(p, "passed") for p in compat.PACKAGES]),
    }
    (tmp_path / "torch-2.7.1.json").write_text(json.dumps(record))
    table = compat.render()
    rows = [line for line in table.splitlines() if line.startswith("| 2.")]
    assert [r.split("|")[1].strip() for r in rows] == compat.VERSIONS
    assert "passed (1 passed)" in rows[0]
    assert all("not run" in r for r in rows[1:])


def test_a_run_tests_head_exported_not_the_working_tree(tmp_path: Path) -> None:
    import subprocess

    commit = compat._snapshot(tmp_path / "src")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert commit == head
    tracked = (tmp_path / "src" / "tools" / "compat.py").read_text()
    shown = subprocess.run(
        ["git", "show", "HEAD:tools/compat.py"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert tracked == shown  # HEAD's file, even while the working tree's differs
    assert (tmp_path / "src" / "tools" / "compat_selection.txt").is_file()
