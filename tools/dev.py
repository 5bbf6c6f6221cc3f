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
    "test": [],  # nox's default sessions: tests, integration, lint, pins
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
    proc = subprocess.Popen(
        [str(py), "-m", "nox", "-f", str(ROOT / "noxfile.py"), *nox_args], cwd=ROOT, env=env
    )
    return _wait(proc)


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
