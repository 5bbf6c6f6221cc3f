"""Sessions for the hyper-parallel layers monorepo (the package list comes from
packages/*/pyproject.toml: six packages today).

    nox                         the default set CI runs (``python3 tools/dev.py test`` runs it in
                                three lanes, tools/dev.py's LANES): tests, integration, lint,
                                pins, lowest, wheelhouse, compat_ci
    nox -s tests                every package's tests, each in its own venv with only that package
                                and the siblings it declares
    nox -s "tests(package='hp-mc2')"   one package
    nox -s integration          every package together (tests/integration), consistency checks on
    nox -s lint                 ruff, mypy, import-linter layering, repository checks, release
                                policy, the tools' own tests
    nox -s pins                 build every wheel with hatch, install offline from that
                                wheelhouse, pip check
    nox -s lowest               each package's tests against the lowest sibling releases its pins
                                admit
    nox -s wheelhouse           every wheel the integration session needs, for an offline CI
    nox -s bench [-- hp-mc2 ... --quick]  benchmarks (all packages, or the ones named);
                                writes bench-results/ and docs/benchmarks.{md,png}
    nox -s demo [-- args]       the main job (examples/train_hybrid.py)
    nox -s release -- DIST      release one package (RELEASING.md)
    nox -s compat -- 2.10.0 [--keep]  the compact cross-version selection on one torch release
                                (tools/compat.py, docs/compatibility.md); compat_ci (default):
                                on the declared floor and the newest torch, less the README
                                examples

torch: CI pins it through ``constraints.txt`` (torch==2.13.0, the CPU wheel). On NPU or CUDA
images that come with their own torch (and torch_npu), set ``HP_USE_SYSTEM_TORCH=1``: the
venvs then see the interpreter's site-packages and no second torch is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tools"))
import _packages as pkgs  # noqa: E402  (the package list, from packages/*/pyproject.toml)
import release as releasing  # noqa: E402  (the release policy: RELEASING.md)

PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints.txt"
SYSTEM_TORCH = os.environ.get("HP_USE_SYSTEM_TORCH", "") not in ("", "0")
# an offline CI: every wheel comes from this folder (``nox -s wheelhouse`` writes it), no index
WHEELHOUSE = os.environ.get("HP_WHEELHOUSE", "")
# what an Ascend/CUDA image brings itself and the wheelhouse leaves out
IMAGE_OWNED = re.compile(r"^(torch|torch[-_]npu|triton|nvidia[-_].*|cuda[-_].*)$", re.I)

MODELS = "hp-models"  # the package on top: installing it installs every layer

nox.options.sessions = [
    "tests",
    "integration",
    "lint",
    "tools",
    "pins",
    "lowest",
    "wheelhouse",
    "compat_ci",
]
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
    links = os.environ.get("PIP_FIND_LINKS", "")
    if WHEELHOUSE:  # the index is off; the wheelhouse (and the image's own wheels) serve all
        links = " ".join(filter(None, [str(Path(WHEELHOUSE).resolve()), links]))
        env.update(PIP_NO_INDEX="1", UV_NO_INDEX="1", UV_OFFLINE="1", PIP_FIND_LINKS=links)
    if links:
        env["UV_FIND_LINKS"] = links.replace(" ", ",")
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
    # a reused venv keeps an earlier build of a package whose version did not move (uv and pip
    # see the same version and skip it), and uv's cache keys a local package's wheel on its
    # pyproject.toml, not its sources: rebuild the repository's own packages every time, so a
    # session always tests the working tree
    _install(session, "--no-deps", "--force-reinstall", *[t.split("[")[0] for t in targets])


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
    """Every package together (tests/integration, tests/integration/test_main_job.py: the main
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
    sibling-pin consistency, namespace guard, no references outside the repository (the tools'
    own tests: the ``tools`` session)."""
    _install(session, "ruff>=0.6", "mypy>=1.10", "import-linter>=2.1")
    _install_packages(session, _packages(), extra="test")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    for pkg in pkgs.packages():
        session.run("mypy", "-p", pkg.module, env={"MYPYPATH": str(pkg.src)})
    session.run("lint-imports", "--no-cache")
    session.run("python", str(ROOT / "tools" / "check_repo.py"))
    session.run("python", str(ROOT / "tools" / "release.py"), "check")


@nox.session(venv_params=_venv_params())
def tools(session: nox.Session) -> None:
    """The repository tools' own tests (tests/tools: the release policy on throw-away commits,
    the lanes and their signals, the compat and benchmark reports, the communication rule).
    Apart from ``lint`` so that the lanes can balance them."""
    _install(session, "pytest>=8", "pytest-timeout>=2.3", "matplotlib")
    session.run("python", "-m", "pytest", str(ROOT / "tests" / "tools"), "-q", *session.posargs,
                env=_env())  # fmt: skip


@nox.session(venv_params=_venv_params())
def pins(session: nox.Session) -> None:
    """Build every sdist and wheel with hatch, ``twine check --strict`` them (LICENSE inside),
    install the wheels offline from that wheelhouse, pip check."""
    wheelhouse = ROOT / ".nox" / "pins-wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    wheelhouse.mkdir(parents=True)
    _install(session, "hatch", "pip", "twine>=6")
    # hatch keeps its build environments in a data dir of its own: a private one per run
    # means a stale or half-made environment from elsewhere can never be picked up
    hatch_data = ROOT / ".nox" / "hatch-data"
    shutil.rmtree(hatch_data, ignore_errors=True)
    for dist in _packages():
        with session.chdir(PACKAGES_DIR / dist):
            session.run("hatch", "build", "-t", "wheel", "-t", "sdist", str(wheelhouse),
                        silent=True,
                        env={**_env(), "HATCH_DATA_DIR": str(hatch_data),
                             # nox points uv at this venv; hatch must target its own
                             "UV_PYTHON": None, "UV_PROJECT_ENVIRONMENT": None})  # fmt: skip
    wheels = sorted(str(w) for w in wheelhouse.glob("*.whl"))
    sdists = sorted(str(s) for s in wheelhouse.glob("*.tar.gz"))
    session.run("python", str(ROOT / "tools" / "check_wheels.py"), *wheels, *sdists)
    session.run("twine", "check", "--strict", *wheels, *sdists)
    sdist_dir = ROOT / ".nox" / "sdists"  # aside: what is installed below is the wheels
    shutil.rmtree(sdist_dir, ignore_errors=True)
    sdist_dir.mkdir(parents=True)
    for sdist in sdists:
        shutil.move(sdist, sdist_dir)
    # third-party requirements (torch and its own dependencies) join the wheelhouse first,
    # then everything is installed with the index switched off
    session.run("python", "-m", "pip", "download", "-q", "-d", str(wheelhouse), *wheels,
                env=_env())  # fmt: skip
    offline = ROOT / ".nox" / "pins-offline"
    shutil.rmtree(offline, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", *_venv_params(), str(offline), external=True)
    py = str(offline / "bin" / "python")
    # --pre: between releases the packages are X.Y.Z.devN, which pip skips by name otherwise.
    # --no-compile: pip would byte-compile all of torch and transformers (measured: 42 s of CPU,
    # 120 s -> 31 s at load 8 on 2 cores); the import check below compiles what it imports
    session.run(py, "-m", "pip", "install", "-q", "--pre", "--no-index", "--no-compile",
                "--find-links", str(wheelhouse),
                *[Path(w).name.split("-")[0].replace("_", "-") for w in wheels],
                external=True, env={"PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""})  # fmt: skip
    session.run(py, "-m", "pip", "check", external=True)
    # every package imports, and from the wheel installed in the offline venv
    imports = ("import importlib, os, sys\n"
               f"for name in {[p.module for p in pkgs.packages()]!r}:\n"
               "    where = os.path.realpath(importlib.import_module(name).__file__)\n"
               "    assert where.startswith(os.path.realpath(sys.prefix) + os.sep), where\n"
               "print('every package imports from its wheel')")  # fmt: skip
    session.run(py, "-c", imports, external=True)


@nox.session(venv_params=_venv_params())
@nox.parametrize("package", [p.dist for p in pkgs.packages() if p.deps])
def lowest(session: nox.Session, package: str) -> None:
    """One package's tests with its own current code and every hp-* sibling at the lowest
    release its ranges admit, each built from that release's commit (``-- --full``: run the
    tests even where those releases ship the current code)."""
    pkg = pkgs.by_dist()[package]
    chosen = releasing.lowest_admitted(pkg)
    src = Path(tempfile.mkdtemp(prefix=f"lowest-{package}-", dir=session.create_tmp()))
    targets = [str(releasing.export(pkgs.by_dist()[r.dist], r.version, src / r.dist))
               for r in chosen.values()]  # fmt: skip
    _install(session, *targets, f"{pkg.root}[test]")
    # what was installed is exactly what was asked for: the lowest releases and this package
    expected = {r.dist: r.version for r in chosen.values()} | {package: pkg.version_text()}
    session.run("python", "-c", _CHECK_INSTALLED, json.dumps(expected), pkg.module, env=_env())
    same = [r for r in chosen.values() if releasing.same_code(pkgs.by_dist()[r.dist], r.commit)]
    if len(same) == len(chosen) and "--full" not in session.posargs:
        names = ", ".join(f"{r.dist}=={r.version}" for r in same)
        session.log(f"{package}: every sibling's lowest release ({names}) ships the code of the "
                    "current sibling, which the tests session ran this "
                    "package's tests against; imports checked, tests not repeated")  # fmt: skip
        return
    args = [a for a in session.posargs if a != "--full"]
    session.run("python", "-m", "pytest", str(pkg.root / "tests"), *args, env=_env())


# installed versions == the expected ones, and every module of the package imports
_CHECK_INSTALLED = """
import importlib, importlib.metadata as md, json, pkgutil, sys
expected, top = json.loads(sys.argv[1]), sys.argv[2]
got = {d: md.version(d) for d in expected}
assert got == expected, f"installed {got}, expected {expected}"
mod = importlib.import_module(top)
names = [m.name for m in pkgutil.walk_packages(mod.__path__, top + ".")]
for name in names:
    importlib.import_module(name)
print(f"installed {got}; {top} and its {len(names)} modules import")
"""


def _integration_requirements() -> list[str]:
    """What the integration session installs besides the packages: its own and the main job's
    requirements, the test runner, and the build backend the packages are built with."""
    reqs = ["-r", str(ROOT / "tests" / "integration" / "requirements.txt"),
            "-r", str(ROOT / "examples" / "requirements.txt")]  # fmt: skip
    return [*reqs, "pytest>=8", "pytest-timeout>=2.3", "hatchling>=1.27", "editables", "pip"]


@nox.session(venv_params=_venv_params())
def wheelhouse(session: nox.Session) -> None:
    """Every wheel ``integration`` needs except what the image owns (torch, torch_npu, triton
    and CUDA libraries) into a folder, for an offline CI: ``nox -s wheelhouse -- DIR
    [--platform TAG --python-version X.Y]`` (default DIR: .nox/offline-wheelhouse). Then
    proves it: a fresh venv installs the integration environment from DIR with ``--no-index``
    (torch from the machine's own wheels or site-packages), ``pip check``, every package
    imports. Use it with ``HP_WHEELHOUSE=DIR`` (tests/integration/README.md)."""
    args = list(session.posargs)
    target = Path(args.pop(0) if args and not args[0].startswith("-") else
                  ROOT / ".nox" / "offline-wheelhouse").resolve()  # fmt: skip
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    _install(session, "pip", "hatchling>=1.27")
    for dist in _packages():  # the packages themselves, built here
        session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(target), str(PACKAGES_DIR / dist), env=_env())  # fmt: skip
    ours = sorted(str(w) for w in target.glob("*.whl"))
    report = target / "resolution.json"
    # resolve the whole environment once (what pip would install into an empty venv) ...
    session.run("python", "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                "--report", str(report), *ours, *_integration_requirements(), "nox", "uv",
                env=_env())  # fmt: skip
    resolved = json.loads(report.read_text())["install"]
    pins = sorted({f"{r['metadata']['name']}=={r['metadata']['version']}" for r in resolved
                   if not r["metadata"]["name"].startswith("hp-")
                   and not IMAGE_OWNED.match(r["metadata"]["name"])})  # fmt: skip
    report.unlink()
    # ... then fetch exactly those, for the target platform if one is named
    platform = ["--only-binary=:all:", *args] if args else []
    session.run("python", "-m", "pip", "download", "-q", "--no-deps", "-d", str(target),
                *platform, *pins, env=_env())  # fmt: skip
    session.log(
        f"{target}: {len(list(target.iterdir()))} files; leaves out what the image "
        f"owns ({IMAGE_OWNED.pattern})"
    )
    if args:
        return  # built for another machine: it cannot be tried here
    # the proof: an empty venv, the index off, torch from what the machine already has
    offline = Path(session.create_tmp()) / "offline-venv"
    shutil.rmtree(offline, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", *_venv_params(), str(offline), external=True)
    py = str(offline / "bin" / "python")
    links = [f"--find-links={x}" for x in [target, *os.environ.get("PIP_FIND_LINKS", "").split()]]
    # uv (nox's own installer here) with the index off: only the folder and the machine's
    # wheels can serve; the constraints pin torch to the machine's own unless it is the system's
    constraint = [] if SYSTEM_TORCH else ["--constraint", str(CONSTRAINTS)]
    env = {"UV_INDEX_URL": None, "UV_EXTRA_INDEX_URL": None, "UV_FIND_LINKS": None,
           "UV_CONSTRAINT": None}  # fmt: skip
    session.run("uv", "pip", "install", "-q", "--python", py, "--no-index", *links, *constraint,
                *[str(PACKAGES_DIR / d) for d in _packages()], *_integration_requirements(),
                external=True, env=env)  # fmt: skip
    session.run("uv", "pip", "check", "--python", py, external=True)
    modules = ", ".join(p.module for p in pkgs.packages())
    session.run(py, "-c", f"import {modules}, pytest, transformers; print('offline install ok')",
                external=True)  # fmt: skip


@nox.session(venv_params=_venv_params())
def release(session: nox.Session) -> None:
    """``nox -s release -- DIST [--version X.Y.Z] [--commit]``: check, set the release version
    and date the changelog, build the sdist and wheel into dist/, ``twine check --strict``, and
    print what to upload (nothing is uploaded). ``--commit``: commit the release, tag it
    ``DIST==X.Y.Z`` and commit the next development version (RELEASING.md)."""
    args = list(session.posargs)
    commit = "--commit" in args
    args = [a for a in args if a != "--commit"]
    version = None
    if "--version" in args:
        i = args.index("--version")
        version = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1 or args[0] not in _packages():
        session.error(f"usage: nox -s release -- DIST [--version X.Y.Z] [--commit]; DIST in "
                      f"{_packages()}")  # fmt: skip
    pkg = pkgs.by_dist()[args[0]]
    files = [str(pkg.version_file), str(pkg.root / "CHANGELOG.md")]
    if releasing.changed_since("HEAD", [str(pkg.root)]):
        session.error(f"{pkg.dist} has uncommitted changes: a release must be a commit")
    problems = releasing.check()
    if problems:
        session.error("release checks failed:\n" + "\n".join(problems))
    try:
        version = releasing.prepare(pkg, version, None)
    except releasing.ReleaseError as exc:
        session.error(str(exc))
    out = ROOT / "dist" / f"{pkg.dist}-{version}"
    shutil.rmtree(out, ignore_errors=True)
    try:
        _install(session, "hatch", "twine>=6")
        hatch_data = Path(session.create_tmp()) / "hatch-data"
        with session.chdir(pkg.root):
            session.run("hatch", "build", "-t", "wheel", "-t", "sdist", str(out),
                        env={**_env(), "HATCH_DATA_DIR": str(hatch_data), "UV_PYTHON": None,
                             "UV_PROJECT_ENVIRONMENT": None})  # fmt: skip
        built = sorted(str(f) for f in out.iterdir())
        session.run("twine", "check", "--strict", *built)
    except BaseException:
        session.run("git", "checkout", "HEAD", "--", *files, external=True)  # undo prepare
        raise
    tag = f"{pkg.dist}=={version}"
    if commit:
        session.run("git", "commit", "-q", "-m", f"Release {pkg.dist} {version}", "--", *files,
                    external=True)  # fmt: skip
        session.run("git", "tag", tag, external=True)
        nxt = releasing.open_next(pkg)
        session.run("git", "commit", "-q", "-m", f"{pkg.dist}: open {nxt}", "--", *files,
                    external=True)  # fmt: skip
        session.log(f"released {pkg.dist} {version} (tag {tag}); main now at {nxt}")
    else:
        session.log(f"prepared {pkg.dist} {version}: now run\n"
                    f"  git commit -m 'Release {pkg.dist} {version}' -- {' '.join(files)}\n"
                    f"  git tag '{tag}'\n"
                    f"  python3 tools/release.py open {pkg.dist}\n"
                    f"  git commit -m '{pkg.dist}: open the next version' -- "
                    + " ".join(files))  # fmt: skip
    session.log(f"to publish (not done here): twine upload {' '.join(built)}")


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
    if quick:  # small shapes: a summary of this run only, docs/ untouched
        session.run("python", str(ROOT / "tools" / "bench_summary.py"), str(out), env=_env())
        return
    # docs/bench-records/: the latest full run of every package; docs/benchmarks.md from all
    records = ROOT / "docs" / "bench-records"
    records.mkdir(parents=True, exist_ok=True)
    for dist in chosen:
        if (out / f"{dist}.json").exists():  # a package without benchmarks writes none
            shutil.copy(out / f"{dist}.json", records / f"{dist}.json")
    session.run("python", str(ROOT / "tools" / "bench_summary.py"), str(records), "--out",
                str(out), env=_env())  # fmt: skip
    docs = ROOT / "docs"
    shutil.copy(out / "summary.md", docs / "benchmarks.md")
    shutil.copy(out / "summary.png", docs / "benchmarks.png")
    session.log(f"latest summary: {docs / 'benchmarks.md'} and {docs / 'benchmarks.png'}; "
                f"records of {', '.join(chosen)} in {records}; edit {records / 'notes.md'} "
                "with this run's machine and load")  # fmt: skip


@nox.session(venv_params=_venv_params())
def demo(session: nox.Session) -> None:
    """The main job: a stock HF model parallelised by hp-models on local ranks, vs serial."""
    _install_packages(session, [MODELS])  # every layer, no fla (as in integration)
    _install(session, "-r", str(ROOT / "examples" / "requirements.txt"))
    # on Ctrl-C the job needs a moment to end torchrun and every rank: nox's default is to
    # escalate to SIGKILL after half a second
    session.run("python", str(ROOT / "examples" / "train_hybrid.py"), *session.posargs,
                env=_env(), interrupt_timeout=15.0)  # fmt: skip


# the compat sessions CI runs: the declared torch floor and the newest torch (tools/compat.py)
COMPAT_CI = ["2.7.1", "2.15.0"]


def _compat(session: nox.Session, *args: str) -> None:
    # tools/compat.py builds its own venv per torch version (.nox/compat-<version>) with uv
    # (nox's own environment has it), runs tools/compat_selection.txt, writes
    # compat-results/torch-<version>.json and deletes the venv unless --keep
    session.run(sys.executable, str(ROOT / "tools" / "compat.py"), "run", *args, external=True)


@nox.session(venv_backend="none")
def compat(session: nox.Session) -> None:
    """``nox -s compat -- 2.10.0 [--keep] [--worktree]``: the compact cross-version selection on
    one torch release, on HEAD's code (``--worktree``: the working tree's); docs/compatibility.md,
    ``python tools/compat.py render`` redraws the table."""
    if not session.posargs:
        session.error("usage: nox -s compat -- <torch version> [--keep]")
    _compat(session, *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize("torch", COMPAT_CI)
def compat_ci(session: nox.Session, torch: str) -> None:
    """The compat selection less the README examples, on the declared floor and on the newest
    torch (part of CI; the examples are the ``tests`` session's on the pinned torch and each
    table row's on its own; here they were two thirds of the time). The result goes to
    compat-results/ci/, not into the table."""
    _compat(session, torch, "--ci", *session.posargs)
