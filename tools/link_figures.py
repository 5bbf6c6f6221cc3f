#!/usr/bin/env python3
"""The modeled-link figures of issue 39, at one core per rank: run it in a quiet window.

    python tools/link_figures.py [--dry-run] [--quick] [--keep-going] [--only DIST]

What it measures (each benchmark at its default world, ``link_world``: at most one rank per
available core, 2 on a 2-core host; every figure the median of 3 runs, each run interleaving
its cases, ``--repeat 3``; every record with the time split, ``--split``):

- hp-moe, ``chunks="auto"`` vs its blocking twin (``bench_moe.py --link-only --link-chunks ''``:
  auto alone, with the one-chunk blocking step the split needs);
- hp-mc2, the gated MLP at ``auto`` and the plain MLP (separate styles and the fused block) at
  ``auto``, vs torch's blocking TP + SP (``bench_mc2.py --link-only --link-chunks ''``; the split
  adds each style at one chunk);
- MLA (hp-context-parallel), ``parallelize_mla``'s default (expanded, ``head_groups="auto"``) vs
  blocking (``bench_context_parallel.py --block mla --link-only --link-groups ''
  --link-strategies expanded``; the split adds the one-group pipeline).

Targets (issue 39): hp-moe auto >= 0.8 or within 0.05 of its ceiling (1 - 1/C); mc2 gated auto
>= 0.8; the plain MLP >= 0.77; MLA default >= 0.8. For a figure short of its target the report
prints how its step splits (hp-dtensor's ``link_time_split``, shares of the blocking step's
modeled link time, summing to 1 - hidden fraction): the link the schedule did not hide, the
chunking overhead (ours' plain step less the same schedule's at one chunk / one head group) and
the copies' CPU time (the rest: gloo's real copies on the cores ours' compute needs).

Records: each benchmark writes ``bench-results/link-figures/<dist>.json``; their records then
replace, in ``docs/bench-records/<dist>.json`` (what ``nox -s bench`` and
``tools/bench_summary.py`` read), the records of the same name and world size (the 4-rank
rows stay, in the oversubscribed table), and ``docs/benchmarks.md`` is redrawn. Nothing is
merged when a run fails or with ``--quick`` (small shapes, one run: a smoke test of this
script). Add the run's machine and load to ``docs/bench-records/notes.md`` by hand.

Runtime on 2 cores (full shapes, 3 runs each): hp-moe ~2 min, hp-mc2 ~9 min (gated ~3.5,
plain ~5.5), MLA ~4 min: ~15 minutes, at most 20. It warns when the 1-minute load average at
its start is above 0.5 (the figures are then not a quiet run's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-results" / "link-figures"
RECORDS = ROOT / "docs" / "bench-records"

# (dist, script, arguments)
RUNS: list[tuple[str, str, list[str]]] = [
    ("hp-moe", "packages/hp-moe/benchmarks/bench_moe.py", ["--link-only", "--link-chunks", ""]),
    ("hp-mc2", "packages/hp-mc2/benchmarks/bench_mc2.py", ["--link-only", "--link-chunks", ""]),
    (
        "hp-context-parallel",
        "packages/hp-context-parallel/benchmarks/bench_context_parallel.py",
        ["--block", "mla", "--link-only", "--link-groups", "", "--link-strategies", "expanded"],
    ),
]
COMMON = ["--repeat", "3", "--split"]

# (dist, record name, target, label); the hp-moe target is also met within 0.05 of the ceiling
FIGURES: list[tuple[str, str, float, str]] = [
    ("hp-moe", "moe_experts_fwd_bwd/link/ours_auto_vs_blocking", 0.8, "hp-moe auto"),
    (
        "hp-mc2",
        "mc2_gated_mlp_fwd_bwd/link/gated_ours_auto_vs_torch_tp_sp",
        0.8,
        "hp-mc2 gated MLP auto",
    ),
    ("hp-mc2", "mc2_mlp_fwd_bwd/link/ours_auto_vs_torch_tp_sp", 0.77, "hp-mc2 plain MLP auto"),
    (
        "hp-mc2",
        "mc2_mlp_fwd_bwd/link/fused_auto_vs_torch_tp_sp",
        0.77,
        "hp-mc2 plain MLP, fused, auto",
    ),
    (
        "hp-context-parallel",
        "cp_mla_fwd_bwd/link/expanded_overlap_vs_blocking",
        0.8,
        "MLA default (expanded, head_groups auto)",
    ),
]
SPLIT = ("split_unhidden_link", "split_chunking_overhead", "split_copies_cpu")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _merge(dist: str, new: list[dict[str, Any]]) -> None:
    """``new`` into docs/bench-records/<dist>.json: a record of the same name and world size
    is replaced, every other record kept."""
    path = RECORDS / f"{dist}.json"
    old = json.loads(path.read_text()) if path.exists() else []
    keys = {(r["name"], r.get("world_size")) for r in new}
    kept = [r for r in old if (r["name"], r.get("world_size")) not in keys]
    path.write_text(json.dumps(kept + new, indent=2) + "\n")


def _meets(r: dict[str, Any], target: float, dist: str) -> bool:
    h = r["hidden_fraction"]
    if dist == "hp-moe" and isinstance(r.get("ceiling"), int | float):
        return bool(h >= target or h >= r["ceiling"] - 0.05)
    return bool(h >= target)


def report(records: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = []
    for dist, name, target, label in FIGURES:
        rows = [r for r in records.get(dist, []) if r["name"] == name]
        if not rows:
            lines.append(f"{label}: no record ({name})")
            continue
        r = rows[0]
        runs = " / ".join(f"{v:.2f}" for v in r.get("hidden_fraction_runs", []))
        extra = f", ceiling {r['ceiling']:.2f} (C = {r['chunks']})" if "ceiling" in r else ""
        ok = _meets(r, target, dist)
        lines.append(
            f"{label}: hidden {r['hidden_fraction']:.2f} (runs {runs}; target {target}{extra}) "
            f"{'MEETS' if ok else 'SHORT'}  [{r.get('world')} ranks, "
            f"{r.get('cores_per_rank')} cores/rank, load {r.get('load', float('nan')):.2f}]"
        )
        if not ok and all(k in r for k in SPLIT):
            lines.append(
                f"    split of the blocking link time: not hidden by the schedule "
                f"{r['split_unhidden_link']:.2f}, chunking overhead "
                f"{r['split_chunking_overhead']:.2f}, copies' CPU time "
                f"{r['split_copies_cpu']:.2f} (schedule's own hidden share "
                f"{r.get('schedule_hidden_share', float('nan')):.2f})"
            )
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--quick", action="store_true", help="small shapes, one run, no merge")
    p.add_argument("--keep-going", action="store_true", help="go on after a failed benchmark")
    p.add_argument(
        "--only", action="append", choices=[d for d, _, _ in RUNS],
        help="this package's figures alone (repeatable); the others' records stay as they are",
    )  # fmt: skip
    a = p.parse_args(argv)
    common = ["--quick", "--repeat", "1", "--split"] if a.quick else COMMON
    load = _load()
    if load > 0.5 and not a.dry_run:
        print(f"warning: load average {load:.2f} at the start: not a quiet window")
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    failed = []
    start = time.perf_counter()
    for dist, script, args in RUNS:
        if a.only and dist not in a.only:
            continue
        out = OUT / f"{dist}.json"
        cmd = [sys.executable, str(ROOT / script), *args, *common, "--out", str(out)]
        print("$", " ".join(repr(c) if c == "" else c for c in cmd), flush=True)
        if a.dry_run:
            continue
        out.unlink(missing_ok=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        print(f"  {dist}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(dist)
            if not a.keep_going:
                break
            continue
        results[dist] = json.loads(out.read_text())
    if a.dry_run:
        return 0
    print(f"\n== link figures, one core per rank ({time.perf_counter() - start:.0f} s) ==")
    lines = report(results)
    print("\n".join(lines))
    (OUT / "report.txt").write_text("\n".join(lines) + "\n")
    if failed or a.quick:
        print(f"not merged into {RECORDS}: " + (f"failed {failed}" if failed else "--quick"))
        return 1 if failed else 0
    for dist, new in results.items():
        _merge(dist, new)
    rc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_summary.py"), str(RECORDS), "--out", str(OUT)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    ).returncode
    if rc == 0:
        shutil.copy(OUT / "summary.md", ROOT / "docs" / "benchmarks.md")
        shutil.copy(OUT / "summary.png", ROOT / "docs" / "benchmarks.png")
        print(f"merged into {RECORDS}; docs/benchmarks.md redrawn; note the run in notes.md")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
