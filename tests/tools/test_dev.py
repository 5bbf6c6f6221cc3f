"""``python3 tools/dev.py test`` (what CI runs): every default nox session runs in exactly one
lane, the lanes run at once, each line says its lane, and one failing lane fails the run."""

from __future__ import annotations

import ast
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import dev  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _default_sessions() -> list[str]:
    """``nox.options.sessions`` as noxfile.py sets it (read, not imported: no nox needed)."""
    for node in ast.walk(ast.parse((ROOT / "noxfile.py").read_text())):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py sets no nox.options.sessions")


def test_every_default_session_runs_in_exactly_one_lane() -> None:
    in_lanes = [s for sessions in dev.LANES.values() for s in sessions]
    assert sorted(in_lanes) == sorted(_default_sessions())
    assert len(in_lanes) == len(set(in_lanes))


def _fake_nox(tmp_path: Path) -> list[str]:
    """A stand-in for ``python -m nox -f noxfile.py``: prints its sessions, fails on 'pins'."""
    script = tmp_path / "fake_nox.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            sessions = sys.argv[sys.argv.index("-s") + 1:]
            for s in sessions:
                print("ran", s, flush=True)
                time.sleep(0.2)
            sys.exit(3 if "pins" in sessions else 0)
            """
        )
    )
    return [sys.executable, str(script)]


def test_lanes_run_together_prefix_their_lines_and_a_failing_lane_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev, "LANES", {"a": ["tests", "integration"], "b": ["lint", "pins"]})
    assert dev._run_lanes(_fake_nox(tmp_path), env=dict(os.environ)) == 1
    out = capsys.readouterr().out.splitlines()
    for lane, session in [("a", "tests"), ("a", "integration"), ("b", "lint"), ("b", "pins")]:
        assert f"[{lane}] ran {session}" in out
    assert "[dev] lane a: passed" in "\n".join(out)
    assert "[dev] lane b: FAILED (exit 3)" in "\n".join(out)


def test_lanes_pass_when_every_lane_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dev, "LANES", {"a": ["tests"], "b": ["lint"]})
    assert dev._run_lanes(_fake_nox(tmp_path), env=dict(os.environ)) == 0
    assert "[dev] all lanes:" in capsys.readouterr().out
