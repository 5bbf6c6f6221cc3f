"""Sessions for the hyper-parallel layers monorepo.

    nox                         the default set CI runs: tests (each package alone), integration,
                                lint, pins
    nox -s tests                every package's tests, each in its own venv with only that package
                                and the siblings it declares
    nox -s "tests(package='hp-mc2')"   one package
    nox -s integration          all four packages together (tests/integration)
    nox -s lint                 ruff, mypy, sibling pins, namespace guard
    nox -s pins                 build every wheel with hatch, install offline from that
                                wheelhouse, pip check
    nox -s bench [-- hp-mc2 ... --quick]  benchmarks (all packages, or the ones named);
                                writes bench-results/ and docs/benchmarks.{md,png}
    nox -s demo [-- args]       the main job (examples/train_hybrid.py)

torch: CI pins it through ``constraints.txt`` (torch==2.13.0, the CPU wheel). On NPU or CUDA
images that come with their own torch (and torch_npu), set ``HP_USE_SYSTEM_TORCH=1``: the
venvs then see the interpreter's site-packages and no second torch is installed.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tools"))
import _packages as pkgs  # noqa: E402  (the package list, from packages/*/pyproject.toml)

PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints.txt"
SYSTEM_TORCH = os.environ.get("HP_USE_SYSTEM_TORCH", "") not in ("", "0")

MODELS = "hp-models"  # the package on top: installing it installs every layer

nox.options.sessions = ["tests", "integration", "lint", "pins"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False
# uv is much faster than pip; it is told about pip's local wheel settings below. With the
# system torch, pip + --system-site-packages is the dependable combination.
nox.options.default_venv_backend = "venv" if SYSTEM_TORCH else "uv|venv"


def _packages() -> list[str]:
    return [p.dist for p in pkgs.packages()]


def _siblings(dist: str) -> list[str]:
    """hp-* distributions that ``dist`` declares as runtime requirements."""
    return list(pkgs.by_dist()[dist].deps)


def _env() -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # Triton kernels run in the interpreter on CPU; set TRITON_INTERPRET=0 to compile them on
    # a GPU. It must be set before anything imports triton (fla-core does), so it is set here.
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    links = os.environ.get("PIP_FIND_LINKS")
    if links:
        env["UV_FIND_LINKS"] = links
    if not SYSTEM_TORCH:
        env["PIP_CONSTRAINT"] = str(CONSTRAINTS)
        env["UV_CONSTRAINT"] = str(CONSTRAINTS)
    return env


def _venv_params() -> list[str]:
    return ["--system-site-packages"] if SYSTEM_TORCH else []


def _install(session: nox.Session, *args: str) -> None:
    session.install(*args, env=_env())


def _install_packages(session: nox.Session, dists: list[str], extra: str = "test") -> None:
    targets: list[str] = []
    for dist in dists:
        for dep in [*_siblings(dist), dist]:
            path = str(PACKAGES_DIR / dep)
            if path not in targets and not any(t.startswith(path + "[") for t in targets):
                targets.append(path)
    targets = [f"{t}[{extra}]" if Path(t).name in dists else t for t in targets]
    _install(session, *targets)


@nox.session(venv_params=_venv_params())
@nox.parametrize("package", _packages())
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, installed alone (plus the siblings it declares)."""
    _install_packages(session, [package])
    session.run(
        "python",
        "-m",
        "pytest",
        str(PACKAGES_DIR / package / "tests"),
        *session.posargs,
        env=_env(),
    )


@nox.session(venv_params=_venv_params())
def integration(session: nox.Session) -> None:
    """All packages together (tests/integration, tests/integration/test_main_job.py: the main
    job's failure paths); HCCL/NCCL where the hardware is."""
    # hp-models pulls in every layer (without their test extras): flash-linear-attention, which
    # hp-kda-kernels' own tests use, must not be importable here, or transformers would route
    # the stock Kimi-Linear reference to fla's GPU kernels (see packages/hp-models/README.md)
    _install_packages(session, [MODELS])
    _install(session, "-r", str(ROOT / "tests" / "integration" / "requirements.txt"))
    _install(session, "-r", str(ROOT / "examples" / "requirements.txt"))  # test_main_job.py
    # every layer's rank-consistency checks on (hyper_parallel.dtensor.check_consistent): ranks
    # that disagree on a shape or a chosen option fail with a clear error instead of hanging
    env = {**_env(), "HP_CHECK_CONSISTENCY": "1"}
    session.run(
        "python", "-m", "pytest", str(ROOT / "tests" / "integration"), *session.posargs, env=env
    )


@nox.session(venv_params=_venv_params())
def lint(session: nox.Session) -> None:
    """ruff, mypy on every package's sources, import-linter layering contracts (pyproject.toml),
    sibling-pin consistency, namespace guard, no references outside the repository."""
    _install(session, "ruff>=0.6", "mypy>=1.10", "import-linter>=2.1")
    _install_packages(session, _packages(), extra="test")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    for pkg in pkgs.packages():
        session.run("mypy", "-p", pkg.module, env={"MYPYPATH": str(pkg.src)})
    session.run("lint-imports", "--no-cache")
    session.run("python", str(ROOT / "tools" / "check_repo.py"))


@nox.session(venv_params=_venv_params())
def pins(session: nox.Session) -> None:
    """Build every wheel with hatch, install them offline from that wheelhouse, pip check."""
    wheelhouse = ROOT / ".nox" / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    wheelhouse.mkdir(parents=True)
    _install(session, "hatch", "pip")
    # hatch keeps its build environments in a data dir of its own: a private one per run
    # means a stale or half-made environment from elsewhere can never be picked up
    hatch_data = ROOT / ".nox" / "hatch-data"
    shutil.rmtree(hatch_data, ignore_errors=True)
    for dist in _packages():
        with session.chdir(PACKAGES_DIR / dist):
            session.run("hatch", "build", "-t", "wheel", str(wheelhouse), silent=True,
                        env={**_env(), "HATCH_DATA_DIR": str(hatch_data),
                             # nox points uv at this venv; hatch must target its own
                             "UV_PYTHON": None, "UV_PROJECT_ENVIRONMENT": None})  # fmt: skip
    wheels = sorted(str(w) for w in wheelhouse.glob("*.whl"))
    session.run("python", str(ROOT / "tools" / "check_wheels.py"), *wheels)
    # third-party requirements (torch and its own dependencies) join the wheelhouse first,
    # then everything is installed with the index switched off
    session.run("python", "-m", "pip", "download", "-q", "-d", str(wheelhouse), *wheels,
                env=_env())  # fmt: skip
    offline = ROOT / ".nox" / "pins-offline"
    shutil.rmtree(offline, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", *_venv_params(), str(offline), external=True)
    py = str(offline / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse),
                *[Path(w).name.split("-")[0].replace("_", "-") for w in wheels],
                external=True, env={"PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""})  # fmt: skip
    session.run(py, "-m", "pip", "check", external=True)
    modules = ", ".join(p.module for p in pkgs.packages())
    session.run(py, "-c", f"import {modules}; print('every package imports')", external=True)


@nox.session(venv_params=_venv_params())
def bench(session: nox.Session) -> None:
    """Every package's benchmark (or those named after --; ``--quick`` for small shapes), one
    combined JSON, a markdown table and a chart; the latest summary is copied to docs/."""
    quick = [a for a in session.posargs if a == "--quick"]
    chosen = [a for a in session.posargs if a != "--quick"] or _packages()
    unknown = sorted(set(chosen) - set(_packages()))
    if unknown:
        session.error(f"unknown package(s) {unknown}; choose from {_packages()}")
    # every layer through hp-models, without fla (the stock-model benchmarks run transformers'
    # torch path on CPU); triton and numpy for the kernel benchmarks
    _install_packages(session, [MODELS])
    _install(session, "matplotlib", "numpy", "triton>=3.0")
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    for dist in chosen:
        target = out / f"{dist}.json"
        target.unlink(missing_ok=True)
        for script in sorted((PACKAGES_DIR / dist / "benchmarks").glob("bench_*.py")):
            session.run("python", str(script), "--out", str(target), *quick, env=_env())
    session.run("python", str(ROOT / "tools" / "bench_summary.py"), str(out), env=_env())
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    shutil.copy(out / "summary.md", docs / "benchmarks.md")
    shutil.copy(out / "summary.png", docs / "benchmarks.png")
    session.log(f"latest summary: {docs / 'benchmarks.md'} and {docs / 'benchmarks.png'}")


@nox.session(venv_params=_venv_params())
def demo(session: nox.Session) -> None:
    """The main job: a stock HF model parallelised by hp-models on local ranks, vs serial."""
    _install_packages(session, [MODELS])  # every layer, no fla (as in integration)
    _install(session, "-r", str(ROOT / "examples" / "requirements.txt"))
    # on Ctrl-C the job needs a moment to end torchrun and every rank: nox's default is to
    # escalate to SIGKILL after half a second
    session.run("python", str(ROOT / "examples" / "train_hybrid.py"), *session.posargs,
                env=_env(), interrupt_timeout=15.0)  # fmt: skip
