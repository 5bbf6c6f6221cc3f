"""Repository invariants the linters do not know about (run by the lint session).

- PEP 420 namespace: no ``hyper_parallel/__init__.py`` anywhere.
- Each package has pyproject/README/CHANGELOG/py.typed/_version.py, its version in exactly
  one place, and a pytest timeout of its own (``[tool.pytest.ini_options] timeout``).
- Sibling pins: every ``hp-*`` requirement is a ``>=X.Y,<X.(Y+1)`` range (0.x) or
  ``>=X,<X+1`` that admits the sibling's current version.
- One-way dependencies: the import-linter layers contract in pyproject.toml (enforced by
  ``lint-imports``) names every package, at the level its ``hp-*`` requirements give it.
- The README's package table has a row per package; its test command is what ``.ci/run`` runs.
- One communication runtime: a layer (a package that requires only hp-dtensor) starts its
  collectives through ``hyper_parallel.dtensor.comm``, never by calling a ``torch.distributed``
  collective (or hp-dtensor's raw ``all_gather_single`` / ``reduce_scatter_single``) itself.
  So does hp-models (:data:`ON_COMM_TOO`) for its own collectives.
  The modules not yet moved onto it are listed in :data:`NOT_YET_ON_COMM` with what is left;
  an entry whose module no longer calls one is reported too, so the list only shrinks.
- No tracked file points outside the repository (the development checkout's shared folder, its
  design notes) or at a ``spec-<name>.md`` document the repository does not contain.

The package list comes from ``packages/*/pyproject.toml`` (tools/_packages.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _packages as pkgs

ROOT = pkgs.ROOT
# written so that this file does not match itself
OUTSIDE_REFS = re.compile(r"\.\./shared\b|\bshared[/]design\b")
SPEC_DOC = re.compile(r"\bspec-[A-Za-z0-9_.-]*[A-Za-z0-9_]\.md\b")
_COLLECTIVES = (
    "all_reduce|all_gather|all_gather_into_tensor|all_gather_object|reduce_scatter|"
    "reduce_scatter_tensor|all_to_all|all_to_all_single|broadcast|send|recv|isend|irecv|"
    "batch_isend_irecv|reduce|gather|scatter|barrier"
)
DIRECT_COLLECTIVE = re.compile(
    rf"\b(?:dist|torch\.distributed)\.(?:{_COLLECTIVES})\(|\b(?:all_gather_single|reduce_scatter_single)\("
)
# layer modules that still call collectives directly: path -> what is left to move onto comm
NOT_YET_ON_COMM: dict[str, str] = {}
# packages above the layers whose own collectives go through comm too (recorded and profiled
# like the layers'): hp-models' loss, gradient sums, clipping and checkpoint flags
ON_COMM_TOO = ("hp-models",)


def check_namespace() -> list[str]:
    return [
        f"namespace guard: {init.relative_to(ROOT)} must not exist"
        for init in ROOT.glob("**/hyper_parallel/__init__.py")
        if not {".nox", ".venv", ".nox-tools"} & set(init.parts)
    ]


def check_package(pkg: pkgs.Package, known: dict[str, pkgs.Package]) -> list[str]:
    problems: list[str] = []
    needed = [pkg.root / "README.md", pkg.root / "CHANGELOG.md", pkg.root / "tests"]
    needed += [pkg.code / name for name in ("py.typed", "_version.py", "__init__.py")]
    for path in needed:
        if not path.exists():
            problems.append(f"{pkg.dist}: missing {path.relative_to(ROOT)}")
    pyproject = (pkg.root / "pyproject.toml").read_text()
    pytest_opts = pkgs.read_toml(pkg.root / "pyproject.toml").get("tool", {}).get("pytest", {})
    if not pytest_opts.get("ini_options", {}).get("timeout"):
        problems.append(f"{pkg.dist}: pyproject.toml needs [tool.pytest.ini_options] timeout")
    if 'dynamic = ["version"]' not in pyproject or re.search(r"^version\s*=", pyproject, re.M):
        problems.append(f"{pkg.dist}: version must come only from _version.py (dynamic)")
    for sib, spec in pkg.pins:
        m = re.fullmatch(r">=\s*([0-9.]+)\s*,\s*<\s*([0-9.]+)", spec)
        if not m:
            problems.append(f"{pkg.dist}: sibling requirement {sib}{spec} must be a range")
        elif sib not in known:
            problems.append(f"{pkg.dist}: requirement on unknown sibling {sib}")
        elif (known[sib].code / "_version.py").exists():
            have = known[sib].version()
            low, high = (tuple(int(x) for x in v.split(".")) for v in m.groups())
            if not low <= have < high:
                problems.append(f"{pkg.dist}: pin {sib}{spec} excludes {sib} {have}")
    return problems


def contract_layers() -> list[list[tuple[str, bool]]]:
    """The import-linter layers contract, top layer first: [[(module, optional), ...], ...]."""
    config = pkgs.read_toml(ROOT / "pyproject.toml").get("tool", {}).get("importlinter", {})
    for contract in config.get("contracts", []):
        if contract.get("type") == "layers":
            return [
                [(m.strip().strip("()"), m.strip().startswith("(")) for m in layer.split("|")]
                for layer in contract["layers"]
            ]
    return []


def check_layering() -> list[str]:
    """The layers contract matches the packages' dependency levels (hp-dtensor at the bottom)."""
    layers = contract_layers()
    if not layers:
        return ["pyproject.toml: no [tool.importlinter] layers contract"]
    try:
        depth = pkgs.levels()
    except ValueError as exc:
        return [f"package dependencies: {exc}"]
    by_module = {p.module: p for p in pkgs.packages()}
    problems: list[str] = []
    placed: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for module, optional in layer:
            placed[module] = len(layers) - 1 - i
            if module not in by_module and not optional:
                problems.append(f"import-linter layers: {module} is not a package (optional?)")
    for module, pkg in by_module.items():
        if module not in placed:
            problems.append(
                f"import-linter layers (pyproject.toml): add {module} at level {depth[pkg.dist]} "
                "(counted from the bottom layer, 0)"
            )
        elif placed[module] != depth[pkg.dist]:
            problems.append(
                f"import-linter layers: {module} is at level {placed[module]}, but its hp-* "
                f"requirements {list(pkg.deps)} put it at level {depth[pkg.dist]}"
            )
    return problems


def check_readme() -> list[str]:
    problems: list[str] = []
    readme = (ROOT / "README.md").read_text()
    for pkg in pkgs.packages():
        if not re.search(rf"^\|\s*\[?`{re.escape(pkg.dist)}`", readme, re.M):
            problems.append(f"README.md: the package table has no row for {pkg.dist}")
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:sh|bash)?\n(.+?)\n```", readme, re.S)
    if not m:
        problems.append("README.md: no test command block marked <!-- test-command -->")
    elif m.group(1).strip() not in ci:
        problems.append(f"README test command {m.group(1).strip()!r} is not what .ci/run runs")
    return problems


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # not a git checkout (e.g. an sdist)
        skip = {".git", ".nox", ".nox-tools", ".venv", "out", "bench-results"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]  # fmt: skip
    return [f for f in out.decode().split("\0") if f]


def check_references(files: list[str]) -> list[str]:
    """No tracked file refers to documents outside the repository."""
    names = {Path(f).name for f in files}
    problems: list[str] = []
    for rel in files:
        path = ROOT / rel
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary or vanished
        for no, line in enumerate(text.splitlines(), 1):
            hits = OUTSIDE_REFS.findall(line)
            hits += [s for s in SPEC_DOC.findall(line) if s not in names]
            if hits:
                problems.append(f"{rel}:{no}: refers to {hits[0]!r}, outside the repository "
                                "(describe it in the repository's own docs)")  # fmt: skip
    return problems


def check_communication(sources: dict[str, str]) -> list[str]:
    """``sources``: layer module path -> text. A direct collective call outside
    :data:`NOT_YET_ON_COMM`, or an entry there that calls none, is a problem."""
    problems: list[str] = []
    for rel, text in sorted(sources.items()):
        hits = [
            (no, line.strip())
            for no, line in enumerate(text.splitlines(), 1)
            if DIRECT_COLLECTIVE.search(line)
            and not line.lstrip().startswith(("#", "from ", "import "))
        ]
        if hits and rel not in NOT_YET_ON_COMM:
            no, line = hits[0]
            problems.append(
                f"{rel}:{no}: calls a collective directly ({line!r}); start it through "
                "hyper_parallel.dtensor.comm (start_* -> Work) so it is recorded, profiled and "
                "counted like every other layer's"
            )
        elif not hits and rel in NOT_YET_ON_COMM:
            problems.append(
                f"{rel}: no direct collective is left; remove it from NOT_YET_ON_COMM in "
                "tools/check_repo.py"
            )
    return problems


def layer_sources() -> dict[str, str]:
    """Every module of every layer (a package whose hp-* requirements are hp-dtensor only) and
    of the packages in :data:`ON_COMM_TOO`."""
    out: dict[str, str] = {}
    for pkg in pkgs.packages():
        if pkg.deps != ("hp-dtensor",) and pkg.dist not in ON_COMM_TOO:
            continue
        for path in sorted(pkg.code.rglob("*.py")):
            out[str(path.relative_to(ROOT))] = path.read_text()
    return out


def check() -> list[str]:
    known = pkgs.by_dist()
    problems = check_namespace()
    for pkg in known.values():
        problems += check_package(pkg, known)
    problems += check_layering()
    problems += check_readme()
    problems += check_references(tracked_files())
    problems += check_communication(layer_sources())
    return problems


if __name__ == "__main__":
    found = check()
    for p in found:
        print(p)
    print("repository checks:", "FAILED" if found else "ok")
    sys.exit(1 if found else 0)
