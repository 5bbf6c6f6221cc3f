"""The package list that every wheel check works from: read from ``packages/*/pyproject.toml``
(tools/_packages.py), one entry per package, consistent with the import-linter contract.

Every wheel built, installed together into a fresh venv, ``pip check`` and every package
imported from the installed wheels: the ``pins`` session (noxfile.py) checks that in the same CI
run, once (this file used to build and install every wheel a second time).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import _packages as pkgs  # noqa: E402

DISTS = [p.dist for p in pkgs.packages()]


def test_package_list_comes_from_every_pyproject_and_matches_the_layering_contract(monkeypatch):
    """tools/_packages.py: one entry per packages/*/pyproject.toml, each naming the subpackage
    its wheel ships; the TOML fallback (Python 3.10) reads them as tomllib does; the import-linter
    contract check in tools/check_repo.py passes, and fails for a contract missing a package."""
    import check_repo

    tomllib = pytest.importorskip("tomllib")
    dirs = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert DISTS == dirs
    for pkg in pkgs.packages():
        assert (pkg.code / "__init__.py").exists(), pkg
        assert set(pkg.deps) <= set(DISTS), pkg
        text = (pkg.root / "pyproject.toml").read_text()
        assert pkgs._mini_toml(text) == tomllib.loads(text), pkg.dist
    assert pkgs.levels()["hp-dtensor"] == 0
    assert check_repo.check_layering() == []
    layers = check_repo.contract_layers()
    without_kda = [[(m, o) for m, o in layer if m != "hyper_parallel.kda"] for layer in layers]
    monkeypatch.setattr(check_repo, "contract_layers", lambda: without_kda)
    assert check_repo.check_layering() == [
        "import-linter layers (pyproject.toml): add hyper_parallel.kda at level 1 (counted from "
        "the bottom layer, 0)"
    ]
