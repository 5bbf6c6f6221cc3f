#!/usr/bin/env python3
"""The torch compatibility matrix: one venv per torch version, the compact selection, results.

    python tools/compat.py run 2.7.1 [--keep] [--worktree]
                                                build .nox/compat-2_7_1 (torch 2.7.1, every
                                                package through hp-models, the test extras the
                                                selection needs) from HEAD exported with
                                                ``git archive`` (``--worktree``: the working tree
                                                as it is, recorded as ``+dirty`` if it differs),
                                                run tools/compat_selection.txt there, write
                                                compat-results/torch-2.7.1.json, delete the
                                                venv (unless --keep)
    python tools/compat.py render               docs/compatibility.md from compat-results/*.json

    python tools/compat.py run 2.7.1 --ci       the selection less the README examples, result
                                                in compat-results/ci/ (not a table row)

``nox -s compat -- 2.7.1 [--keep]`` calls ``run``; the default ``compat_ci`` sessions call
``run --ci``.

Installation: ``uv pip`` with ``torch==<version>`` and the repository's other pins
(constraints.txt without its torch line). pip's local settings (find-links, extra index URLs),
from the environment or ``pip config``, are passed to uv explicitly; pip's own constraint file
is not (it may cap torch). A torch that is only published as a CUDA build comes with the triton
its wheel pins; the CPU wheels get ``triton>=3.0`` through hp-kda-kernels' ``triton`` extra.
fla-core is never installed: the stock Kimi-Linear modules must run on transformers' torch path.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SELECTION = ROOT / "tools" / "compat_selection.txt"
RESULTS = ROOT / "compat-results"
DOC = ROOT / "docs" / "compatibility.md"
CONSTRAINTS = ROOT / "constraints.txt"

# the versions the table lists (Ascend teams run these); the floor and the newest run in CI
VERSIONS = ["2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
PACKAGES = [
    "hp-dtensor", "hp-mc2", "hp-context-parallel", "hp-kda-kernels", "hp-moe", "hp-models",
]  # fmt: skip
# every package through hp-models (which pulls in each layer, hp-moe included) plus the test
# needs of the selection (hp-moe's test extra: the stock experts' transformers); hp-kda-kernels'
# test extra is not used (it brings fla-core)
INSTALL = [
    "packages/hp-dtensor",
    "packages/hp-mc2",
    "packages/hp-context-parallel",
    "packages/hp-kda-kernels[triton]",
    "packages/hp-moe[test]",
    "packages/hp-models[test]",
    "-r",
    "tests/integration/requirements.txt",
]
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
# pins a torch release's own dependencies need on CPU, by torch version. triton 3.3-3.6 (the
# ones torch 2.7-2.11 pin): their interpreter turns a 1-element array into a Python int
# (``int(self.handle.data)``), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be
# converted to Python scalars"; seen with 3.3.1 and 3.6.0, the same code is in 3.4.0 and
# 3.5.1; 3.7.1 squeezes the array first).
_OLD_TRITON = ["numpy<2.4"]
EXTRA_PINS: dict[str, list[str]] = {
    v: _OLD_TRITON for v in ("2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0")
}


def venv_dir(version: str) -> Path:
    return ROOT / ".nox" / f"compat-{version.replace('.', '_')}"


def result_path(version: str, ci: bool = False) -> Path:
    """Where a run's JSON goes: ``compat-results/torch-<version>.json`` (a row of the table), or
    for a ``--ci`` run ``compat-results/ci/`` (ignored by git and by the table)."""
    return (RESULTS / "ci" if ci else RESULTS) / f"torch-{version}.json"


def selection(path: Path = SELECTION, ci: bool = False) -> list[str]:
    """The selection's node ids; ``ci``: less the README examples (what ``compat_ci`` runs)."""
    lines = path.read_text().splitlines()
    nodes = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
    return [n for n in nodes if not _is_readme_example(n)] if ci else nodes


def _is_readme_example(nodeid: str) -> bool:
    """A package's README examples (``tests/test_*_readme.py``): each runs in an interpreter of
    its own, so they are most of the selection's time. The ``tests`` session runs them on the
    pinned torch and every row of the table on its own torch; ``compat_ci`` leaves them out."""
    return nodeid.split("::")[0].endswith("_readme.py")


def package_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    if parts[0] == "packages":
        return parts[1]
    return "hp-models"  # tests/integration: the stock models through hp-models


# ---- installation ------------------------------------------------------------------------
def _pip_setting(name: str) -> list[str]:
    """pip's ``name`` (find-links, extra-index-url), from PIP_* or ``pip config``; a list."""
    env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if env is None:
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "list"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.split(".")[-1] == name:
                env = value.strip().strip("'\"")
    return env.split() if env else []


def _uv() -> list[str]:
    uv = shutil.which("uv")
    if uv:
        return [uv]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode != 0:  # a setup problem, not a result: nothing is recorded
        raise SystemExit(
            "tools/compat.py needs uv: run it through `python3 tools/dev.py -s compat -- VERSION` "
            "(which provides it) or put uv on PATH"
        )
    return [sys.executable, "-m", "uv"]


def _constraints(version: str, path: Path) -> None:
    kept = [
        line
        for line in CONSTRAINTS.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith("torch")
    ]
    lines = [f"torch=={version}", *EXTRA_PINS.get(version, []), *kept]
    path.write_text("\n".join(lines) + "\n")


def install(version: str, venv: Path, python: str, src: Path = ROOT) -> None:
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*_uv(), "venv", "-q", "--allow-existing", "--python", python, str(venv)],
                   check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cons = Path(tmp) / "constraints.txt"
        _constraints(version, cons)
        args = [*_uv(), "pip", "install", "--python", str(venv / "bin" / "python")]
        args += ["--constraint", str(cons), "--index-strategy", "unsafe-best-match"]
        for link in _pip_setting("find-links"):
            args += ["--find-links", link]
        for url in _pip_setting("extra-index-url"):
            args += ["--extra-index-url", url]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
        env["UV_HTTP_TIMEOUT"] = "300"
        # uv caches a local package's wheel by its pyproject.toml, not its sources: without
        # this a run could test an earlier build of the same path
        for dist in PACKAGES:
            args += ["--reinstall-package", dist]
        subprocess.run([*args, *INSTALL], check=True, cwd=src, env=env)


def _versions(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for d in ('torch', 'triton', 'transformers'):\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: out[d] = ''\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


# ---- running and recording ---------------------------------------------------------------
def _cases(junit: Path) -> list[dict[str, Any]]:
    cases = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        file = tc.get("file") or ""
        classname = tc.get("classname") or ""
        if not file:  # classname: packages.hp-dtensor.tests.test_dtensor_mesh
            file = classname.replace(".", "/") + ".py"
        nodeid = f"{file}::{tc.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300]
                break
        cases.append(
            {
                "nodeid": nodeid,
                "package": package_of(nodeid),
                "outcome": outcome,
                "time_s": round(float(tc.get("time") or 0.0), 2),
                "message": message,
            }
        )
    return cases


def summarize(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for pkg in PACKAGES:
        mine = [c for c in cases if c["package"] == pkg]
        counts = {k: sum(c["outcome"] == k for c in mine) for k in ("passed", "failed", "skipped")}
        if not mine:
            status = "not run"
        elif counts["failed"]:
            status = "failed"
        elif counts["passed"]:
            status = "passed"
        else:
            status = "not applicable"
        reasons = sorted({c["message"] for c in mine if c["outcome"] == "skipped"})
        failures = [f"{c['nodeid']}: {c['message']}" for c in mine if c["outcome"] == "failed"]
        out[pkg] = {"status": status, **counts, "skip_reasons": reasons, "failures": failures}
    return out


def _commit() -> str:
    """The checkout's HEAD, ``+dirty`` where packages/ or tests/ differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "packages", "tests"],
            cwd=ROOT, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return ""
    return head + ("+dirty" if dirty else "")


def _snapshot(dest: Path) -> str | None:
    """The checkout's ``HEAD`` exported to ``dest`` (``git archive``): what a row records is
    then exactly one commit's code, whatever is being edited in the working tree meanwhile.
    The short hash, or None outside a git checkout."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if head.returncode != 0:
        return None
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit("git archive HEAD failed")
    return head.stdout.strip()


def run(version: str, keep: bool, python: str, worktree: bool = False, ci: bool = False) -> int:
    _uv()  # fails here, before any result is written, when uv is missing
    venv = venv_dir(version)
    record: dict[str, Any] = {
        "torch_requested": version,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": f"nox -s compat_ci -- {version}" if ci else f"nox -s compat -- {version}",
        "selection": "ci: without the README examples" if ci else "full",
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only (gloo)",
    }
    rc = 1
    shutil.rmtree(venv, ignore_errors=True)
    src = ROOT
    if not worktree:  # HEAD's code, exported beside the venv (removed with it)
        commit = _snapshot(venv / "src")
        if commit is not None:
            src, record["commit"] = venv / "src", commit
    record.setdefault("commit", _commit())
    try:
        t0 = time.monotonic()
        try:
            install(version, venv, python, src)
        except subprocess.CalledProcessError as exc:
            record["install_error"] = f"installation failed (exit {exc.returncode})"
            record["install_s"] = round(time.monotonic() - t0, 1)
            record["packages"] = {
                p: {"status": "failed", "passed": 0, "failed": 0, "skipped": 0,
                    "skip_reasons": [], "failures": [record["install_error"]]}
                for p in PACKAGES
            }  # fmt: skip
            return 1
        record["install_s"] = round(time.monotonic() - t0, 1)
        record["versions"] = _versions(venv)
        junit = venv / "compat-junit.xml"
        t1 = time.monotonic()
        # the selection as the tested commit has it (not the working tree's, which may name
        # tests that commit does not have)
        proc = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pytest",
             *selection(src / SELECTION.relative_to(ROOT), ci), f"--junitxml={junit}",
             "-o", "junit_family=xunit1", "-p", "no:cacheprovider", "-q"],
            cwd=src, env={**os.environ, **ENV},
        )  # fmt: skip
        record["tests_s"] = round(time.monotonic() - t1, 1)
        # the machine may be shared: the load over the run's last 15 minutes qualifies tests_s
        record["load_avg_15min"] = round(os.getloadavg()[2], 1)
        record["pytest_exit"] = proc.returncode
        cases = _cases(junit) if junit.exists() else []
        record["packages"] = summarize(cases)
        record["tests"] = cases
        rc = 0 if proc.returncode == 0 else 1
        return rc
    finally:
        out = result_path(version, ci)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"[compat] torch {version}: {out.relative_to(ROOT)}", flush=True)
        for pkg, s in record.get("packages", {}).items():
            print(f"[compat]   {pkg:20s} {s['status']:15s} {s['passed']} passed, "
                  f"{s['failed']} failed, {s['skipped']} skipped", flush=True)  # fmt: skip
        if keep:
            print(f"[compat] kept {venv.relative_to(ROOT)}", flush=True)
        else:
            shutil.rmtree(venv, ignore_errors=True)


# ---- the table ---------------------------------------------------------------------------
def _cell(s: dict[str, Any]) -> str:
    counts = f"{s['passed']} passed"
    if s["skipped"]:
        counts += f", {s['skipped']} skipped"
    if s["failed"]:
        counts += f", {s['failed']} failed"
    if s["status"] == "not applicable":
        return "not applicable: " + "; ".join(s["skip_reasons"])
    return f"{s['status']} ({counts})"


def render() -> str:
    records = {}
    for path in sorted(RESULTS.glob("torch-*.json")):
        rec = json.loads(path.read_text())
        records[rec["torch_requested"]] = rec
    head = "| torch | " + " | ".join(PACKAGES) + " | triton | install / tests | date, commit |"
    lines = [
        "# Supported torch versions",
        "",
        "Generated by `python tools/compat.py render` from `compat-results/torch-*.json`, each "
        "written by one run of `nox -s compat -- <torch version>` (`python3 tools/dev.py -s "
        "compat -- <torch version>`): a fresh venv with that torch, every package installed "
        "through hp-models, and the compact selection in `tools/compat_selection.txt` "
        "(hp-dtensor's mesh tests, each layer's parity tests on stock Hugging Face modules "
        "(hp-moe's: the stock experts at ep 2 and 4), the stock-model integration at mesh "
        "(2, 2) with FSDP2 and with the all-reduce, a "
        "(dp, cp, tp) = (2, 2, 1) mesh, every README example) on CPU over gloo, on the code of "
        "the commit in the last column (`git archive`). CI (`nox`'s default sessions) runs it "
        "on the declared floor and on the newest torch (`compat_ci`). Rows whose counts differ "
        "ran the selection as it was at their commit.",
        "",
        head,
        "|" + "---|" * (len(PACKAGES) + 4),
    ]
    notes = []
    for version in VERSIONS:
        rec = records.get(version)
        if rec is None:
            lines.append(f"| {version} | " + " | ".join(["not run"] * len(PACKAGES)) + " | | | |")
            continue
        pk = rec.get("packages", {})
        cells = [_cell(pk[p]) if p in pk else "not run" for p in PACKAGES]
        got = rec.get("versions", {})
        timing = f"{rec.get('install_s', '?')} s / {rec.get('tests_s', '–')} s"
        lines.append(
            f"| {got.get('torch', version)} | " + " | ".join(cells)
            + f" | {got.get('triton', '') or '–'} | {timing} | {rec['date']}"
            + (f", `{rec['commit']}`" if rec.get("commit") else "") + " |"
        )  # fmt: skip
        for p in PACKAGES:
            s = pk.get(p)
            if s is None:
                continue
            for reason in s["skip_reasons"] if s["status"] != "not applicable" else []:
                notes.append(f"- torch {version}, {p}: skipped: {reason}")
            for failure in s["failures"]:
                notes.append(f"- torch {version}, {p}: FAILED {failure}")
        if rec.get("install_error"):
            notes.append(f"- torch {version}: {rec['install_error']}")
    loads = [r["load_avg_15min"] for r in records.values() if "load_avg_15min" in r]
    lines += [
        "",
        "Install time includes downloading torch (the CUDA builds from PyPI are several GB; "
        "they run on CPU) and its own pinned triton (the column); test time is the selection "
        "alone, on a 2-core machine"
        + (
            f" that other jobs shared (15-minute load average {min(loads)}–{max(loads)} at the "
            "end of the runs), so the times are upper bounds."
            if loads and max(loads) > 3
            else "."
        ),
        "",
    ]
    pinned = sorted({p for pins in EXTRA_PINS.values() for p in pins})
    for pin in pinned:
        on = ", ".join(v for v in VERSIONS if pin in EXTRA_PINS.get(v, []))
        lines += [
            f"With torch {on} the venv also pins `{pin}`: the triton those releases pin (3.3-3.6)"
            " runs the Triton kernels on CPU (`TRITON_INTERPRET=1`) only with an older NumPy; "
            "compiled kernels on a GPU do not go through the interpreter.",
            "",
        ]
    if notes:
        lines += ["## Skips and failures", "", *notes, ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one torch version: venv, selection, JSON")
    r.add_argument("version", help=f"a torch release, e.g. {VERSIONS[0]}")
    r.add_argument("--keep", action="store_true", help="keep the venv afterwards")
    r.add_argument("--python", default=sys.executable, help="interpreter for the venv")
    r.add_argument("--worktree", action="store_true",
                   help="test the working tree as it is (default: HEAD, exported)")  # fmt: skip
    r.add_argument("--ci", action="store_true",
                   help="the selection less the README examples, result under compat-results/ci/ "
                        "(what nox -s compat_ci runs; not a row of the table)")  # fmt: skip
    sub.add_parser("render", help="write docs/compatibility.md from compat-results/")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.version, args.keep, args.python, args.worktree, args.ci)
    DOC.write_text(render())
    print(f"[compat] wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
