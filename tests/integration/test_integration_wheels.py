"""Every package built as a wheel and installed together into a fresh venv is consistent:
``pip check`` passes and every package imports from the installed wheels. The package list is
read from ``packages/*/pyproject.toml`` (tools/_packages.py).

The venv sees the running interpreter's torch (and its dependencies) through a ``.pth`` file
pointing at a filtered copy of torch's ``site-packages`` (symlinks to everything except the
``hp-*`` distributions installed there), so no second torch is installed. Wheels are built with
``pip wheel --no-deps`` (without build isolation when hatchling is importable here, so it works
offline; otherwise pip fetches hatchling, honouring ``PIP_FIND_LINKS`` / ``PIP_INDEX_URL``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import _packages as pkgs  # noqa: E402

DISTS = [p.dist for p in pkgs.packages()]
MODULES = [p.module for p in pkgs.packages()]


def _run(cmd: list[str], timeout: float = 240, **kwargs) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def _torch_site_without_hp(dest: Path) -> Path:
    """A directory of symlinks to torch's site-packages minus every hp-* / hyper_parallel entry."""
    site = Path(torch.__file__).resolve().parent.parent
    dest.mkdir()
    for entry in site.iterdir():
        low = entry.name.lower().replace("-", "_")
        if low.startswith(("hp_", "_hp_", "hyper_parallel", "__editable__", "_editable_impl_hp")):
            continue
        if entry.suffix == ".pth":
            continue  # no editable/path hooks of the outer environment
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.timeout(300)
def test_integration_wheels_install_together_and_pip_check_passes(tmp_path):
    wheelhouse = tmp_path / "wheels"
    isolation = [] if importlib.util.find_spec("hatchling") else None
    build_flags = ["--no-build-isolation"] if isolation is not None else []
    for dist in DISTS:
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *build_flags,
              "-w", str(wheelhouse), str(ROOT / "packages" / dist)])  # fmt: skip
    wheels = sorted(wheelhouse.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == sorted(d.replace("-", "_") for d in DISTS), (
        wheels
    )

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    )
    # the venv's bundled setuptools may be older than what torch requires: use the outer one
    _run([str(py), "-m", "pip", "uninstall", "-y", "-q", "setuptools"])
    torch_site = _torch_site_without_hp(tmp_path / "torch-site")
    (site / "outer_torch.pth").write_text(f"{torch_site}\n")

    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PIP_CONSTRAINT", "PYTHONPATH"))
    }
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse),
          *DISTS], env=env)  # fmt: skip
    _run([str(py), "-m", "pip", "check"], env=env)
    where = _run(
        [str(py), "-c", "import importlib, torch\n"
         f"for name in {MODULES!r}:\n"
         "    m = importlib.import_module(name)\n"
         "    print(m.__file__, m.__version__)\n"
         "print(torch.__version__)"],
        env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = where.splitlines()
    assert lines[-1] == torch.__version__
    for line in lines[:-1]:
        path = Path(line.split()[0]).resolve()
        assert str(path).startswith(str(site.resolve())), f"not imported from the wheel: {line}"


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
