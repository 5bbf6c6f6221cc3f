"""Repository invariants the linters do not know about.

- PEP 420 namespace: no ``hyper_parallel/__init__.py`` anywhere.
- Each package has pyproject/README/CHANGELOG/py.typed/_version.py and its version in
  exactly one place.
- Sibling pins: every ``hp-*`` requirement is a ``>=X.Y,<X.(Y+1)`` range (0.x) or
  ``>=X,<X+1`` that admits the sibling's current version.
- One-way dependencies: a layer imports only ``hyper_parallel.dtensor``, never a sibling layer.
- The README's test command is what ``.ci/run`` runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKGS = ROOT / "packages"
LAYERS = {"hp-dtensor": "dtensor", "hp-mc2": "mc2", "hp-context-parallel": "context_parallel",
          "hp-kda-kernels": "kda"}  # fmt: skip


def version_of(dist: str) -> tuple[int, ...]:
    text = (PKGS / dist / "src" / "hyper_parallel" / LAYERS[dist] / "_version.py").read_text()
    m = re.search(r'__version__\s*=\s*"([0-9.]+)"', text)
    assert m, dist
    return tuple(int(x) for x in m.group(1).split("."))


def check() -> list[str]:
    problems: list[str] = []
    for init in ROOT.glob("**/hyper_parallel/__init__.py"):
        if ".nox" not in init.parts and ".venv" not in init.parts:
            problems.append(f"namespace guard: {init.relative_to(ROOT)} must not exist")
    dists = sorted(p.name for p in PKGS.iterdir() if (p / "pyproject.toml").exists())
    for dist in dists:
        layer = LAYERS.get(dist)
        if layer is None:
            problems.append(f"{dist}: unknown package (add it to tools/check_repo.py)")
            continue
        base = PKGS / dist
        src = base / "src" / "hyper_parallel" / layer
        for needed in [base / "README.md", base / "CHANGELOG.md", src / "py.typed",
                       src / "_version.py", src / "__init__.py", base / "tests"]:  # fmt: skip
            if not needed.exists():
                problems.append(f"{dist}: missing {needed.relative_to(ROOT)}")
        pyproject = (base / "pyproject.toml").read_text()
        if 'dynamic = ["version"]' not in pyproject or re.search(r"^version\s*=", pyproject, re.M):
            problems.append(f"{dist}: version must come only from _version.py (dynamic)")
        for sib, lo, hi in re.findall(r'"(hp-[a-z0-9-]+)\s*>=\s*([0-9.]+)\s*,\s*<\s*([0-9.]+)"',
                                      pyproject):  # fmt: skip
            if sib not in LAYERS:
                problems.append(f"{dist}: requirement on unknown sibling {sib}")
                continue
            have = version_of(sib)
            low = tuple(int(x) for x in lo.split("."))
            high = tuple(int(x) for x in hi.split("."))
            if not (low <= have < high):
                problems.append(f"{dist}: pin {sib}>={lo},<{hi} excludes {sib} {have}")
        for req in re.findall(r'"(hp-[a-z0-9-]+)([^"]*)"', pyproject):
            if req[0] != dist and not re.fullmatch(r"\s*>=\s*[0-9.]+\s*,\s*<\s*[0-9.]+", req[1]):
                problems.append(f"{dist}: sibling requirement {req[0]}{req[1]} must be a range")
        for py in src.rglob("*.py"):
            for other, other_layer in LAYERS.items():
                if other in (dist, "hp-dtensor"):
                    continue
                if re.search(rf"\bhyper_parallel\.{other_layer}\b", py.read_text()):
                    problems.append(f"{py.relative_to(ROOT)}: imports sibling layer {other_layer}")
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:sh|bash)?\n(.+?)\n```", readme, re.S)
    if not m:
        problems.append("README.md: no test command block marked <!-- test-command -->")
    elif m.group(1).strip() not in ci:
        problems.append(f"README test command {m.group(1).strip()!r} is not what .ci/run runs")
    return problems


if __name__ == "__main__":
    found = check()
    for p in found:
        print(p)
    print("repository checks:", "FAILED" if found else "ok")
    sys.exit(1 if found else 0)
