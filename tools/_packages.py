"""The one source for the list of packages: everything is read from ``packages/*/pyproject.toml``.

A package is a directory ``packages/<dist>/`` with a ``pyproject.toml`` whose hatch wheel target
ships one subpackage of the ``hyper_parallel`` namespace (``only-include =
["src/hyper_parallel/<layer>"]``, or else ``[tool.hatch.version] path``). Its layer
dependencies are the ``hp-*`` distributions in ``[project] dependencies``. Adding a package
is adding its directory: the noxfile, the repository and wheel checks, the integration wheel
test and the import-linter check all read this module.

Standard library only (the noxfile imports it from nox's own interpreter).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
NAMESPACE = "hyper_parallel"


@dataclass(frozen=True)
class Package:
    dist: str  # distribution name, e.g. "hp-mc2"
    layer: str  # subpackage of the namespace, e.g. "mc2"
    deps: tuple[str, ...]  # hp-* distributions it requires at run time
    pins: tuple[tuple[str, str], ...]  # (hp-* distribution, version specifier) as written

    @property
    def module(self) -> str:
        return f"{NAMESPACE}.{self.layer}"

    @property
    def root(self) -> Path:
        return PACKAGES_DIR / self.dist

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def code(self) -> Path:
        return self.src / NAMESPACE / self.layer

    @property
    def wheel_name(self) -> str:
        return self.dist.replace("-", "_")

    @property
    def version_file(self) -> Path:
        return self.code / "_version.py"

    def version_text(self) -> str:
        """The version as written in ``_version.py``: ``X.Y.Z`` (a release) or ``X.Y.Z.devN``."""
        return parse_version_file(self.version_file.read_text(), self.dist)

    def version(self) -> tuple[int, ...]:
        """The release part ``(X, Y, Z)`` of the version (``0.3.1.dev2`` -> ``(0, 3, 1)``)."""
        return release_tuple(self.version_text())


# the versions this repository writes: a release X.Y.Z, or X.Y.Z.devN between releases
VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?")


def parse_version_file(text: str, where: str = "_version.py") -> str:
    m = re.search(r'__version__\s*=\s*"([^"]*)"', text)
    if not m:
        raise ValueError(f'{where}: no __version__ = "..." in _version.py')
    if not VERSION.fullmatch(m.group(1)):
        raise ValueError(f"{where}: version {m.group(1)!r} is neither X.Y.Z nor X.Y.Z.devN")
    return m.group(1)


def release_tuple(version: str) -> tuple[int, ...]:
    m = VERSION.fullmatch(version)
    if not m:
        raise ValueError(f"version {version!r} is neither X.Y.Z nor X.Y.Z.devN")
    return tuple(int(x) for x in m.groups()[:3])


def is_dev(version: str) -> bool:
    return ".dev" in version


def _mini_toml(text: str) -> dict[str, Any]:
    """The TOML subset our pyproject files use (tables, arrays of tables, strings, numbers,
    booleans, lists of strings), for a Python 3.10 interpreter without tomllib."""
    data: dict[str, Any] = {}
    table = data
    lines = iter(text.splitlines())
    for line in lines:
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            *parents, last = [part.strip() for part in line.strip("[]").split(".")]
            table = data
            for part in parents:
                table = table.setdefault(part, {})
            if line.startswith("[["):  # array of tables
                table.setdefault(last, []).append({})
                table = table[last][-1]
            else:
                table = table.setdefault(last, {})
            continue
        key, _, value = (s.strip() for s in line.partition("="))
        while value.startswith("[") and value.count("[") > value.count("]"):
            value += next(lines).split(" #")[0].strip()
        if value in ("true", "false"):
            table[key] = value == "true"
            continue
        try:
            table[key] = ast.literal_eval(_inline_tables(value))
        except (ValueError, SyntaxError):
            table[key] = value
    return data


def _inline_tables(value: str) -> str:
    """``{ name = "x", n = 1 }`` -> ``{"name": "x", "n": 1}`` (keys outside strings only)."""
    out = []
    for part in re.split(r'("(?:[^"\\]|\\.)*")', value):
        if part.startswith('"') and part.endswith('"') and len(part) >= 2:
            out.append(part)
            continue
        out.append(re.sub(r"([{,]\s*)([A-Za-z0-9_-]+)\s*=", r'\1"\2":', part))
    return "".join(out)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return _mini_toml(path.read_text())
    return tomllib.loads(path.read_text())


def _layer_of(dist: str, meta: dict[str, Any]) -> str:
    hatch = meta.get("tool", {}).get("hatch", {})
    paths = list(hatch.get("build", {}).get("targets", {}).get("wheel", {}).get("only-include", []))
    paths.append(hatch.get("version", {}).get("path", ""))
    for path in paths:
        m = re.match(rf"src/{NAMESPACE}/([a-z0-9_]+)", path)
        if m:
            return m.group(1)
    raise ValueError(
        f"packages/{dist}/pyproject.toml: the hatch wheel target must ship src/{NAMESPACE}/<layer>"
    )


def _package(pyproject: Path) -> Package:
    meta = read_toml(pyproject)
    dist = meta["project"]["name"]
    if dist != pyproject.parent.name:
        raise ValueError(f"{pyproject}: project name {dist!r} differs from its directory name")
    pins = []
    for req in meta["project"].get("dependencies", []):
        m = re.match(r"\s*(hp-[a-z0-9-]+)\s*(.*)", req)
        if m and m.group(1) != dist:
            pins.append((m.group(1), m.group(2).strip()))
    deps = tuple(name for name, _ in pins)
    return Package(dist=dist, layer=_layer_of(dist, meta), deps=deps, pins=tuple(pins))


@lru_cache(maxsize=1)
def packages() -> tuple[Package, ...]:
    """Every package, sorted by distribution name."""
    found = [_package(p) for p in sorted(PACKAGES_DIR.glob("*/pyproject.toml"))]
    return tuple(sorted(found, key=lambda p: p.dist))


def by_dist() -> dict[str, Package]:
    return {p.dist: p for p in packages()}


def levels() -> dict[str, int]:
    """Dependency depth of each package: 0 for one with no hp-* dependency, else one more than
    its deepest dependency (hp-dtensor 0, the layers 1, hp-models 2). Raises on a cycle or on
    a dependency that is not a package here."""
    known = by_dist()
    depth: dict[str, int] = {}

    def visit(dist: str, path: tuple[str, ...]) -> int:
        if dist in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, dist))}")
        if dist not in known:
            raise ValueError(f"{path[-1]} requires {dist}, which is not in packages/")
        if dist not in depth:
            deps = known[dist].deps
            depth[dist] = 1 + max((visit(d, (*path, dist)) for d in deps), default=-1)
        return depth[dist]

    for dist in known:
        visit(dist, ())
    return depth


def in_dependency_order() -> list[Package]:
    """Packages with every package after the ones it depends on."""
    depth = levels()
    return sorted(packages(), key=lambda p: (depth[p.dist], p.dist))


if __name__ == "__main__":
    depth = levels()
    for p in in_dependency_order():
        print(f"{p.dist:<22} {p.module:<34} level {depth[p.dist]}  requires {list(p.deps)}")
