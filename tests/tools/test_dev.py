"""``python3 tools/dev.py test`` (what CI runs): every default nox session runs in exactly one
lane, the lanes run at once, each line says its lane, and one failing lane fails the run."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
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
    """A lane names a session (all of its parametrisations) or one parametrisation of it; each
    package's ``tests`` session is in exactly one lane, and so is every other default session."""
    import _packages

    in_lanes = [s for sessions in dev.LANES.values() for s in sessions]
    assert len(in_lanes) == len(set(in_lanes))
    assert sorted({s.split("(")[0] for s in in_lanes}) == sorted(_default_sessions())
    tests = [s for s in in_lanes if s.split("(")[0] == "tests"]
    assert "tests" not in tests or len(tests) == 1, "all packages' tests and some again"
    if "tests" not in tests:
        assert sorted(tests) == sorted(f"tests(package='{p.dist}')" for p in _packages.packages())


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


# ---- a signal to the launcher itself ends everything below it ----------------------------
# The launcher runs from a temporary copy of the repository whose .nox-tools/bin/python (and,
# for the set-up phase, HP_DEV_PYTHON) is FAKE_TREE: a stand-in for nox that starts a tree like
# the main job's. Every process of the tree carries HP_DEV_TEST_MARK; none may outlive the
# launcher.

FAKE_TREE = """
import os, signal, subprocess, sys, time
from pathlib import Path

def ready(role):
    Path(os.environ["HP_DEV_TEST_READY"], f"{os.getpid()}.{role}").write_text(" ".join(sys.argv))

def start(role, env=None, session=False):
    return subprocess.Popen([sys.executable, __file__, "--role", role], env=env,
                            start_new_session=session)

def stubborn():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

role = sys.argv[2] if sys.argv[1:2] == ["--role"] else "nox"
if role == "nox":
    if os.environ.get("FAKE_GROUP_STUBBORN", "1") == "1":
        # in nox's process group, without the launcher's HP_DEV_RUN: only the group signal
        # reaches it, and it ignores every polite one
        start("group-stubborn", env={k: v for k, v in os.environ.items() if k != "HP_DEV_RUN"})
    start("torchrun", session=True)  # leaves the group, as torchrun does
elif role == "torchrun":
    start("worker", session=True)  # a worker in a session of its own, as torchrun starts them
if role in ("group-stubborn", "worker"):
    stubborn()
print("fake", role, "ready:", *sys.argv[1:], flush=True)
ready(role)
while True:
    time.sleep(60)
"""
TREE_SIZE = 4  # nox stand-in, group-stubborn, torchrun, worker


def _marked(mark: str) -> set[int]:
    """Live (not zombie) processes whose environment holds ``mark``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            if stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X"):
                continue
            if mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.fixture
def launcher_copy(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], str]]:
    """A copy of the repository's launcher with a fake .nox-tools; yields (root, env, mark) and
    SIGKILLs whatever of the tree a failing test left behind."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc")
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "dev.py", root / "tools" / "dev.py")
    (root / "noxfile.py").write_text("")
    tree = tmp_path / "fake_tree.py"
    tree.write_text(FAKE_TREE)
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tree}" "$@"\n')
    fake.chmod(0o755)
    tools = root / ".nox-tools"
    (tools / "bin").mkdir(parents=True)
    (tools / "bin" / "python").symlink_to(fake)
    (tools / ".ready").write_text("ok\n")
    (tmp_path / "ready").mkdir()
    mark = f"HP_DEV_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "HP_DEV_TEST_READY": str(tmp_path / "ready"), "HP_DEV_GRACE_S": "2"}
    env[mark.split("=")[0]] = mark.split("=")[1]
    env.pop("HP_DEV_RUN", None)
    yield root, env, mark
    for pid in _marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start(
    root: Path, env: dict[str, str], args: list[str], ignore: tuple[int, ...] = ()
) -> subprocess.Popen:
    def reset() -> None:  # a signal the test runner ignores must not stay ignored here
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)

    cmd = [sys.executable, str(root / "tools" / "dev.py"), *args]
    with open(root.parent / "launcher.log", "w") as log:
        return subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=reset
        )


def _wait_ready(root: Path, count: int, proc: subprocess.Popen) -> None:
    """Until ``count`` processes of the fake tree have set their signals up."""
    ready = root.parent / "ready"
    deadline = time.monotonic() + 40
    while len(list(ready.iterdir())) < count:
        assert proc.poll() is None, _log(root)
        assert time.monotonic() < deadline, _log(root)
        time.sleep(0.1)


def _signal_and_check(
    root: Path, mark: str, proc: subprocess.Popen, signum: int, count: int
) -> float:
    """Signal the launcher; it must exit killed by that signal within seconds, and leave no
    process of its tree. Returns how long it took."""
    assert len(_marked(mark)) == count + 1  # the tree and the launcher: the check sees them
    t0 = time.monotonic()
    proc.send_signal(signum)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher still runs 20 s after the signal\n" + _log(root))
    took = time.monotonic() - t0
    assert proc.returncode == -signum, _log(root)
    deadline = time.monotonic() + 2
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(mark), "left behind:\n" + _log(root)
    assert took < 15, _log(root)
    return took


def _log(root: Path) -> str:
    return (root.parent / "launcher.log").read_text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_to_the_launcher_ends_the_job_and_everything_below_it(
    launcher_copy: tuple[Path, dict[str, str], str], signame: str
) -> None:

    root, env, mark = launcher_copy
    proc = _start(root, env, ["train", "--steps", "2000"])
    _wait_ready(root, TREE_SIZE, proc)
    _signal_and_check(root, mark, proc, getattr(signal, signame), TREE_SIZE)
    log = _log(root)
    assert "fake nox ready: -m nox" in log and "-s demo -- --steps 2000" in log
    assert f"[dev] {signame}: stopped" in log


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_the_launcher_ends_every_lane(
    launcher_copy: tuple[Path, dict[str, str], str], signame: str
) -> None:

    root, env, mark = launcher_copy
    proc = _start(root, env, ["test"])
    _wait_ready(root, TREE_SIZE * len(dev.LANES), proc)
    _signal_and_check(root, mark, proc, getattr(signal, signame), TREE_SIZE * len(dev.LANES))
    log = _log(root)
    for lane in dev.LANES:
        assert f"[dev] lane {lane}: interrupted" in log
        assert f"[{lane:<{max(map(len, dev.LANES))}}] fake nox ready" in log


@pytest.mark.timeout(90)
def test_sigterm_while_the_tools_venv_is_set_up_ends_the_setup(
    launcher_copy: tuple[Path, dict[str, str], str],
) -> None:

    root, env, mark = launcher_copy
    (root / ".nox-tools" / ".ready").unlink()
    env["HP_DEV_PYTHON"] = str(root.parent / "fake_python")  # creates .nox-tools: slowly
    proc = _start(root, env, ["train"])
    _wait_ready(root, TREE_SIZE, proc)
    _signal_and_check(root, mark, proc, signal.SIGTERM, TREE_SIZE)
    log = _log(root)
    assert "[dev] creating .nox-tools" in log and "ready: -m venv --clear" in log
    assert not (root / ".nox-tools" / ".ready").exists()


@pytest.mark.timeout(90)
def test_a_second_signal_skips_the_grace_period(
    launcher_copy: tuple[Path, dict[str, str], str],
) -> None:

    root, env, mark = launcher_copy
    env["HP_DEV_GRACE_S"] = "60"
    proc = _start(root, env, ["train"])
    _wait_ready(root, TREE_SIZE, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(1)
    assert proc.poll() is None  # the group-stubborn process holds it in its grace period
    # the nox stand-in ended on the first Ctrl-C: three processes of the tree are left
    took = _signal_and_check(root, mark, proc, signal.SIGINT, TREE_SIZE - 1)
    assert time.monotonic() - t0 < 1 + took + 1 and took < 10


@pytest.mark.timeout(90)
def test_what_left_the_group_is_ended_as_soon_as_nox_is_gone(
    launcher_copy: tuple[Path, dict[str, str], str],
) -> None:
    """nox's group empties at once; torchrun and the worker (in sessions of their own, no one
    left to end them) get SIGTERM and STRAY_GRACE_S, not the whole grace period."""
    root, env, mark = launcher_copy
    env.update(HP_DEV_GRACE_S="60", FAKE_GROUP_STUBBORN="0")
    proc = _start(root, env, ["train"])
    _wait_ready(root, TREE_SIZE - 1, proc)
    took = _signal_and_check(root, mark, proc, signal.SIGTERM, TREE_SIZE - 1)
    assert took < dev.STRAY_GRACE_S + 5
    assert "[dev] SIGTERM: stopped (1 killed with SIGKILL)" in _log(root)  # the worker


@pytest.mark.timeout(90)
def test_sighup_stays_ignored_under_nohup(
    launcher_copy: tuple[Path, dict[str, str], str],
) -> None:

    root, env, mark = launcher_copy
    proc = _start(root, env, ["train"], ignore=(signal.SIGHUP,))
    _wait_ready(root, TREE_SIZE, proc)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert proc.poll() is None and len(_marked(mark)) == TREE_SIZE + 1
    _signal_and_check(root, mark, proc, signal.SIGTERM, TREE_SIZE)
