#!/usr/bin/env python3
"""One entry point that sets itself up: ``python3 tools/dev.py test`` (the test suite, as CI
runs it) and ``python3 tools/dev.py train`` (the main job). Anything else is passed to nox.

Needs only Python >= 3.10 with pip/venv: the first run creates ``.nox-tools/`` with nox and
uv, later runs reuse it (with ``HP_WHEELHOUSE=DIR``, from that folder, with no index).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".nox-tools"
REQUIREMENTS = ["nox>=2024.4.15", "uv>=0.4"]
COMMANDS = {
    "test": [],  # nox's default sessions (noxfile.py's nox.options.sessions), in LANES
    "train": ["-s", "demo", "--"],
    "bench": ["-s", "bench", "--"],
}


def _tools_python() -> Path:
    py = TOOLS / "bin" / "python"
    stamp = TOOLS / ".ready"
    if not stamp.exists():
        print(f"[dev] creating {TOOLS.relative_to(ROOT)} with {' '.join(REQUIREMENTS)}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(TOOLS)
        # an offline CI (tests/integration/README.md): nox and uv come from the wheelhouse
        house = os.environ.get("HP_WHEELHOUSE")
        offline = ["--no-index", "--find-links", house] if house else []
        subprocess.run([str(py), "-m", "pip", "install", "-q", *offline, *REQUIREMENTS], check=True)
        stamp.write_text("ok\n")
    return py


# ``test`` runs nox's default sessions in three lanes at once: each keeps the machine's cores
# busy only part of the time (rank start-up, imports and gloo waits leave about half of two
# cores idle in the package tests; the checks are mostly builds, downloads and single-process
# work), and three lanes end sooner than one. Measured on a fresh clone (2 cores): tests
# 24 min, integration 11, checks 29; all 29.6 min. (Moving lowest and wheelhouse to the
# integration lane measured worse: compat_ci then ran beside the heavier integration tests.)
# Every default session is in exactly one lane (tests/tools/test_dev.py). HP_TEST_LANES=1 runs
# them one after another, as plain nox does.
LANES = {
    "tests": ["tests"],
    "integration": ["integration"],
    "checks": ["lint", "pins", "lowest", "wheelhouse", "compat_ci"],
}


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - this file may run on an old python3
        print("hyper-parallel layers needs Python >= 3.10", file=sys.stderr)
        return 2
    if not argv:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    nox_args = COMMANDS[command] + rest if command in COMMANDS else argv
    py = _tools_python()
    env = {**os.environ, "PATH": f"{TOOLS / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    nox = [str(py), "-m", "nox", "-f", str(ROOT / "noxfile.py")]
    if command == "test" and not rest and os.environ.get("HP_TEST_LANES", "2") != "1":
        return _run_lanes(nox, env)
    proc = subprocess.Popen([*nox, *nox_args], cwd=ROOT, env=env)
    return _wait(proc)


def _run_lanes(nox: list[str], env: dict[str, str]) -> int:
    """Run each lane of :data:`LANES` as its own nox process, at the same time; every line they
    print is prefixed with its lane. The exit status is 0 only if every lane passed; a summary
    of each lane (its time and status) comes last."""
    import threading
    import time

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

    pumps = []
    for name, sessions in LANES.items():
        print(f"[dev] lane {name}: nox -s {' '.join(sessions)}", flush=True)
        proc = subprocess.Popen(
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
    codes: dict[str, int] = {}
    ended: dict[str, float] = {}
    try:
        while len(codes) < len(procs):
            for name, proc in procs.items():
                if name not in codes and proc.poll() is not None:
                    codes[name] = proc.returncode
                    ended[name] = time.monotonic() - start
            time.sleep(0.5)
    except KeyboardInterrupt:
        for name, proc in procs.items():  # Ctrl-C reached every nox: let each shut down
            if name not in codes:
                codes[name] = _wait(proc)
    for thread in pumps:
        thread.join(timeout=5)
    for name in LANES:
        status = "passed" if codes.get(name) == 0 else f"FAILED (exit {codes.get(name)})"
        took = f"{ended[name]:.0f} s" if name in ended else "interrupted"
        print(f"[dev] lane {name}: {status} in {took}", flush=True)
    print(f"[dev] all lanes: {time.monotonic() - start:.0f} s", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


def _wait(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """Wait for nox. Ctrl-C reaches nox (and what it runs) directly from the terminal: give it
    ``grace_s`` to shut its session down (the main job ends torchrun and every rank) instead
    of killing it at once; a second Ctrl-C kills it."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        pass
    try:
        return proc.wait(timeout=grace_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        proc.kill()
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
