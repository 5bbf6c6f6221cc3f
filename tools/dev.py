#!/usr/bin/env python3
"""One entry point that sets itself up: ``python3 tools/dev.py test`` (the test suite, as CI
runs it) and ``python3 tools/dev.py train`` (the main job). Anything else is passed to nox.

Needs only Python >= 3.10 with pip/venv: the first run creates ``.nox-tools/`` with nox and
uv, later runs reuse it (with ``HP_WHEELHOUSE=DIR``, from that folder, with no index;
``HP_DEV_PYTHON`` names another interpreter to create it with).

Ctrl-C, SIGTERM or SIGHUP to this launcher ends everything it started, in any command and at
any phase (setting up ``.nox-tools``, nox building its venvs, the job or the tests running):
every child (pip, each nox, each lane) runs in a session of its own and carries ``HP_DEV_RUN``
in its environment. On the signal the launcher passes SIGTERM (SIGINT for Ctrl-C) to each
child's process group and waits up to ``HP_DEV_GRACE_S`` seconds (default 10: the main job
ends torchrun and every rank itself; once the groups are gone, what is left outside them gets
SIGTERM and 2 s), then SIGKILLs the groups and every process that still carries its
``HP_DEV_RUN`` (torchrun and its workers leave nox's group), and exits killed by the same
signal (status 128 + its number). A second signal skips the wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".nox-tools"
REQUIREMENTS = ["nox>=2024.4.15", "uv>=0.4"]
COMMANDS = {
    "test": [],  # nox's default sessions (noxfile.py's nox.options.sessions), in LANES
    "train": ["-s", "demo", "--"],
    "bench": ["-s", "bench", "--"],
}
RUN_ENV = "HP_DEV_RUN"  # ':'-joined ids of the launchers a process descends from
STRAY_GRACE_S = 2.0  # SIGTERM to SIGKILL for what outlives nox and the job's own shutdown


class Supervisor:
    """The launcher's children, and how a signal to the launcher ends them all.

    Each child starts in a session of its own (a terminal's Ctrl-C or hangup reaches only the
    launcher, which passes it on) and with this launcher's id appended to ``HP_DEV_RUN``, so
    that processes that leave the child's process group (torchrun and its workers do) are found
    in /proc too. :meth:`install` makes SIGINT, SIGTERM and SIGHUP call :meth:`stop` (a signal
    the launcher was started with ignored, as under ``nohup``, stays ignored; SIGTERM is always
    handled)."""

    def __init__(self) -> None:
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.children: list[subprocess.Popen] = []
        try:
            self.grace = float(os.environ.get("HP_DEV_GRACE_S", "10"))
        except ValueError:
            self.grace = 10.0
        self.on_stop: Callable[[], str] | None = None  # a last word (the lanes' summary)
        self.stopping = False
        self.hurry = False

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if env is None else env)
        env[RUN_ENV] = ":".join(filter(None, [env.get(RUN_ENV, ""), self.id]))
        return env

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=self.env(env), start_new_session=True, **kw)
        self.children.append(proc)
        return proc

    def install(self) -> None:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            if sig != signal.SIGTERM and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.stopping:  # a second signal: no more waiting
            self.hurry = True
            return
        self.stopping = True
        try:
            self.stop(signum)
        finally:
            _exit_by(signum)

    # -- finding what is left ----------------------------------------------------------------
    def _left(self) -> tuple[dict[int, set[int]], set[int]]:
        """What is still alive: {child's process group: its live processes} for the groups
        that have one, and the live processes outside them that carry this launcher's id.
        Zombies do not count. Without /proc: a group counts while ``killpg(group, 0)`` finds
        it (as one process), and no ids are seen."""
        for child in self.children:
            child.poll()  # reap the ones that ended (not the one main() waits on: a zombie)
        ours = {c.pid for c in self.children}
        groups: dict[int, set[int]] = {}
        proc = Path("/proc")
        if not proc.is_dir():
            for pgid in ours:
                try:
                    os.killpg(pgid, 0)
                    groups[pgid] = {pgid}
                except OSError:
                    pass
            return groups, set()
        me, prefix = self.id.encode(), RUN_ENV.encode() + b"="
        marked: set[int] = set()
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                stat = (entry / "stat").read_bytes()
                fields = stat[stat.rindex(b")") + 2 :].split()  # state ppid pgrp ...
                if fields[0] in (b"Z", b"X"):
                    continue
                if int(fields[2]) in ours:
                    groups.setdefault(int(fields[2]), set()).add(pid)
                    continue
                environ = (entry / "environ").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            for var in environ.split(b"\0"):
                if var.startswith(prefix) and me in var[len(prefix) :].split(b":"):
                    marked.add(pid)
                    break
        return groups, marked

    # -- ending them -------------------------------------------------------------------------
    def stop(self, signum: int) -> int:
        """End every child and everything below it; returns how many processes were left to
        SIGKILL. SIGINT is passed on as SIGINT (nox shuts its session down as on Ctrl-C),
        SIGTERM and SIGHUP as SIGTERM (what examples/train_hybrid.py handles). Processes that
        left the groups (torchrun and its workers) are the job's to end while it runs; once
        every group is gone, those left get SIGTERM and ``STRAY_GRACE_S``."""
        name = signal.Signals(signum).name
        forward = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        groups, strays = self._left()
        count = sum(map(len, groups.values())) + len(strays)
        _say(f"[dev] {name}: stopping nox and everything it started ({count} process(es); "
             f"grace {self.grace:g} s)\n")  # fmt: skip
        _signal(list(groups), [], forward)
        deadline = time.monotonic() + self.grace
        strays_told = False
        while not self.hurry and time.monotonic() < deadline:
            groups, strays = self._left()
            if not groups and not strays:
                break
            if not groups and not strays_told:
                _signal([], sorted(strays), signal.SIGTERM)
                strays_told = True
                deadline = time.monotonic() + STRAY_GRACE_S
            time.sleep(0.1)
        killed: set[int] = set()
        for _ in range(200):  # SIGKILL until nothing is left (at most ~10 s)
            groups, strays = self._left()
            if not groups and not strays:
                break
            killed |= strays.union(*groups.values())
            _signal(list(groups), sorted(strays), signal.SIGKILL)
            time.sleep(0.05)
        last = self.on_stop() if self.on_stop is not None else ""
        late = f" ({len(killed)} killed with SIGKILL)" if killed else ""
        _say(f"{last}[dev] {name}: stopped{late}\n")
        return len(killed)


def _signal(groups: list[int], pids: list[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _say(text: str) -> None:
    """Write from a signal handler: straight to fd 2, not through sys.stderr's buffer (the
    handler may have interrupted a write to it)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def _exit_by(signum: int) -> None:
    """Exit killed by ``signum``, as the shell expects (status 128 + signum). Nothing is
    flushed: every line was written with ``flush``, and a flush here could block on a lane's
    output thread."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(1)
    os._exit(128 + signum)


SUPERVISOR = Supervisor()


def _run(cmd: list[str], what: str) -> None:
    rc = SUPERVISOR.popen(cmd).wait()
    if rc != 0:
        raise SystemExit(f"[dev] {what} failed (exit {rc}): {' '.join(cmd)}")


def _tools_python() -> Path:
    py = TOOLS / "bin" / "python"
    stamp = TOOLS / ".ready"
    if not stamp.exists():
        print(f"[dev] creating {TOOLS.relative_to(ROOT)} with {' '.join(REQUIREMENTS)}", flush=True)
        base = os.environ.get("HP_DEV_PYTHON") or sys.executable
        _run([base, "-m", "venv", "--clear", str(TOOLS)], f"creating {TOOLS.name}")
        # an offline CI (tests/integration/README.md): nox and uv come from the wheelhouse
        house = os.environ.get("HP_WHEELHOUSE")
        offline = ["--no-index", "--find-links", house] if house else []
        _run([str(py), "-m", "pip", "install", "-q", *offline, *REQUIREMENTS], "pip install")
        stamp.write_text("ok\n")
    return py


# ``test`` runs nox's default sessions in three lanes at once: each keeps the machine's cores
# busy only part of the time (rank start-up, imports and gloo waits leave part of two cores
# idle in the package tests; the checks are mostly builds, downloads and single-process work),
# and three lanes end sooner than one. The lanes are balanced by the time each session took on
# a fresh clone (2 cores, the three lanes at once; README, "Run the tests": 18.6 min, lanes
# 13.8 / 17.7 / 18.6; moving hp-dtensor's tests to the first lane and hp-context-parallel's to
# the last measured 19.1): hp-models' tests are the longest session, so the package tests are
# split over the lanes (2026-12-06, fresh clone: 22.5 min, lanes 18.6 / 21.5 / 22.3, with the
# tools' own tests still inside ``lint``; as the ``tools`` session in the first lane: 21.6 min,
# lanes 20.7 / 21.5 / 21.0). Every default
# session (each package's ``tests``) is in exactly one lane (tests/tools/test_dev.py).
# HP_TEST_LANES=1 runs them one after another, as plain nox does.
def _tests(dist: str) -> str:
    return f"tests(package='{dist}')"


LANES = {
    "tests": [_tests("hp-models"), _tests("hp-moe"), _tests("hp-mc2"), "tools"],
    "integration": ["integration", _tests("hp-kda-kernels"), _tests("hp-context-parallel")],
    "checks": [_tests("hp-dtensor"), "lint", "pins", "lowest", "wheelhouse", "compat_ci"],
}


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - this file may run on an old python3
        print("hyper-parallel layers needs Python >= 3.10", file=sys.stderr)
        return 2
    if not argv:
        print(__doc__)
        return 2
    SUPERVISOR.install()
    command, rest = argv[0], argv[1:]
    nox_args = COMMANDS[command] + rest if command in COMMANDS else argv
    py = _tools_python()
    env = {**os.environ, "PATH": f"{TOOLS / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    nox = [str(py), "-m", "nox", "-f", str(ROOT / "noxfile.py")]
    if command == "test" and not rest and os.environ.get("HP_TEST_LANES", "2") != "1":
        return _run_lanes(nox, env)
    return SUPERVISOR.popen([*nox, *nox_args], cwd=ROOT, env=env).wait()


def _run_lanes(nox: list[str], env: dict[str, str]) -> int:
    """Run each lane of :data:`LANES` as its own nox process, at the same time; every line they
    print is prefixed with its lane. The exit status is 0 only if every lane passed; a summary
    of each lane (its time and status) comes last (also when a signal stops the run)."""
    import threading

    start = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()
    width = max(map(len, LANES))

    def pump(name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                sys.stdout.write(f"[{name:<{width}}] {line}")
                sys.stdout.flush()

    codes: dict[str, int] = {}
    ended: dict[str, float] = {}

    def summary() -> str:
        lines = []
        for name in LANES:
            if name not in codes:
                lines.append(f"[dev] lane {name}: interrupted\n")
                continue
            status = "passed" if codes[name] == 0 else f"FAILED (exit {codes[name]})"
            lines.append(f"[dev] lane {name}: {status} in {ended[name]:.0f} s\n")
        lines.append(f"[dev] all lanes: {time.monotonic() - start:.0f} s\n")
        return "".join(lines)

    SUPERVISOR.on_stop = summary
    pumps = []
    for name, sessions in LANES.items():
        print(f"[dev] lane {name}: nox -s {' '.join(sessions)}", flush=True)
        proc = SUPERVISOR.popen(
            [*nox, "-s", *sessions],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        procs[name] = proc
        thread = threading.Thread(target=pump, args=(name, proc), daemon=True)
        thread.start()
        pumps.append(thread)
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                ended[name] = time.monotonic() - start
        time.sleep(0.5)
    SUPERVISOR.on_stop = None
    for thread in pumps:
        thread.join(timeout=5)
    print(summary(), end="", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
