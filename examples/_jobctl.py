"""Process control for the main job: start torchrun, wait with a deadline, and on Ctrl-C,
SIGTERM, ``--job-timeout`` or a failed rank make sure torchrun and every worker are gone.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group
does not reach them, and SIGKILL to torchrun alone leaves them running. Three things together
leave nothing behind:

- every process of the job carries ``HP_JOB_ID=<id>`` in its environment, and each worker
  writes ``<out>/.rank<r>.pid``; :func:`job_pids` finds the job's processes by either;
- :func:`stop_job`: SIGTERM torchrun's group and every worker, wait ``grace`` seconds, then
  SIGKILL whatever is left, and wait until nothing of the job is alive;
- on Linux, torchrun is SIGKILLed when the launcher dies and a worker when torchrun dies
  (``PR_SET_PDEATHSIG``), which covers a launcher that is itself SIGKILLed mid-way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

JOB_ENV = "HP_JOB_ID"


class Interrupted(Exception):
    """The launcher received SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_signals() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread (cleanup runs)."""

    def handler(signum: int, _frame: object) -> None:
        ignore_signals()  # a second Ctrl-C must not cut the cleanup short
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pid_file(out: Path, rank: int) -> Path:
    return out / f".rank{rank}.pid"


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, a zombie, or not ours
        return False


def job_pids(job_id: str, out: Path) -> set[int]:
    """Live processes of the job: found by ``HP_JOB_ID`` in /proc (Linux) and by pid files
    (a pid from a file counts only while it still carries the marker, where /proc exists)."""
    marker = f"{JOB_ENV}={job_id}".encode()
    found: set[int] = set()
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if entry.name.isdigit() and _has_marker(int(entry.name), marker):
                found.add(int(entry.name))
    for f in out.glob(".rank*.pid"):
        try:
            pid = int(f.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if proc.is_dir() and not _has_marker(pid, marker):
            continue
        if _alive(pid):
            found.add(pid)
    found.discard(os.getpid())
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_all(proc: subprocess.Popen, pids: set[int], sig: int) -> None:
    targets = [("group", proc.pid)] if proc.poll() is None else []
    targets += [("pid", p) for p in pids]
    for kind, pid in targets:
        try:
            os.killpg(pid, sig) if kind == "group" else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_job(proc: subprocess.Popen, job_id: str, out: Path, grace: float = 2.0) -> int:
    """End torchrun and every worker: SIGTERM, ``grace`` s, SIGKILL; wait until none is left.
    Returns how many processes had to be signalled."""
    pids = job_pids(job_id, out)
    count = len(pids | ({proc.pid} if proc.poll() is None else set()))
    _signal_all(proc, pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or job_pids(job_id, out)):
        time.sleep(0.05)
    for _ in range(100):  # SIGKILL until the job is gone (at most ~5 s)
        left = job_pids(job_id, out)
        if not left and proc.poll() is not None:
            break
        _signal_all(proc, left, signal.SIGKILL)
        time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    return count


class Job:
    """torchrun in a session of its own, stderr echoed and its tail kept for the reason line."""

    def __init__(self, cmd: list[str], env: dict[str, str], out: Path) -> None:
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.out = out
        self.tail: list[str] = []
        self.proc = subprocess.Popen(cmd, env={**env, JOB_ENV: self.id}, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True,
                                     preexec_fn=die_with_parent)  # fmt: skip
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(line)
            self.tail.append(line)
            del self.tail[:-200]

    def wait(self, timeout: float) -> int:
        """torchrun's exit code; raises subprocess.TimeoutExpired after ``timeout`` s."""
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc

    def stop(self, grace: float = 2.0) -> int:
        return stop_job(self.proc, self.id, self.out, grace)

    def leftovers(self) -> set[int]:
        return job_pids(self.id, self.out)


def run_job(cmd: list[str], env: dict[str, str], out: Path, timeout: float,
            on_start: Callable[[Job], None] | None = None) -> tuple[int | None, Job]:  # fmt: skip
    """Run torchrun to the end (exit code) or to ``timeout`` (None); on any exit, including
    :class:`Interrupted`, no process of the job is left behind."""
    job = Job(cmd, env, out)
    if on_start is not None:
        on_start(job)
    try:
        rc: int | None = job.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        ignore_signals()
        try:
            if job.proc.poll() is None or job.leftovers():
                job.stop()
        finally:
            raise_on_signals()
    return rc, job
