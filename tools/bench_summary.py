#!/usr/bin/env python3
"""Combine every package's benchmark records into one summary.

    python tools/bench_summary.py DIR [--out OUTDIR]

Reads ``DIR/*.json`` (each a JSON list of records written by
``hyper_parallel.dtensor.benchmarking.write_records``: ``name``, ``ours_s``, ``baseline_s``,
``ratio``, ``peak_mem_ours``, ``peak_mem_baseline``, ...; a single record object is accepted
too) and writes into ``OUTDIR`` (default ``DIR``)

- ``DIR/summary.json``: ``{"records": [...], "sources": {...}}``, each record tagged with the
  file (package) it came from;
- ``DIR/summary.md``: one markdown table (ours vs baseline, ratio, peak memory) of the plain
  runs and, for records marked ``simulated: true`` (run under hp-dtensor's
  ``simulated_link``), a separate "Modeled link (simulation)" table with each row's link
  parameters (``link_latency_s``, ``link_bytes_per_s``), ``t_link_s`` (modeled link seconds
  per step), ``hidden_fraction`` and ``link_added_ours_s`` (the seconds ours' waits slept
  per step) where the record has them;
- ``DIR/summary.png``: a horizontal bar chart of the ratios (ours / baseline, < 1 is faster)
  with a line at 1.0; simulated rows are hatched and labelled ``[sim]``.

Headline and oversubscribed rows: a record with ``oversubscribed: true`` (more local ranks than
cores, ``hyper_parallel.dtensor.benchmarking.run_facts``: each rank's compute, its gloo copies
and the other ranks' work time-share the cores) goes to a second section, "Oversubscribed (N
ranks on C cores)", one per (N, C), with its own plain and modeled-link tables; the headline
tables hold the runs at one core per rank or more. A record from before these fields is judged
by its ``world_size`` against ``RECORDED_CORES`` (the machine docs/bench-records were measured
on). Modeled-link rows of a repeated run (``--repeat``) show each run's hidden fraction beside
the median.

A ``DIR/notes.md`` (the machine, its load, what each package's run measured) is appended to
the markdown as "Run notes". ``nox -s bench`` keeps the records of each package's latest full
run in ``docs/bench-records/`` and draws ``docs/benchmarks.md`` from all of them, so a package
benchmarked again replaces only its own rows.

Needs matplotlib for the chart (``nox -s bench`` installs it); without it the script stops
with a clear message before writing anything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

OUTPUTS = ("summary.json", "summary.md", "summary.png")
# the cores of the machine the committed records (docs/bench-records) were measured on, for
# records that predate the ``cores`` / ``oversubscribed`` fields (docs/bench-records/notes.md)
RECORDED_CORES = 2
REQUIRED = ("name", "ours_s", "baseline_s")


def load_records(directory: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    records: list[dict[str, Any]] = []
    sources: dict[str, int] = {}
    for path in sorted(directory.glob("*.json")):
        if path.name in OUTPUTS:
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SystemExit(f"bench_summary: {path} is not valid JSON: {exc}") from None
        items = data if isinstance(data, list) else [data]
        for i, rec in enumerate(items):
            missing = [k for k in REQUIRED if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise SystemExit(f"bench_summary: {path} record {i} lacks {missing}")
            rec = dict(rec)
            if not isinstance(rec.get("ratio"), int | float):
                b = rec["baseline_s"]
                rec["ratio"] = rec["ours_s"] / b if b else math.nan
            rec["source"] = path.stem
            records.append(rec)
        sources[path.stem] = len(items)
    return records, sources


def _ms(seconds: Any) -> str:
    return f"{seconds * 1e3:.2f}" if isinstance(seconds, int | float) else "-"


def _mib(n: Any) -> str:
    return f"{n / 2**20:.1f}" if isinstance(n, int | float) else "-"


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def _bandwidth(bps: Any) -> str:
    if not isinstance(bps, int | float):
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} B/s"


def oversubscription(record: dict[str, Any]) -> tuple[int, int] | None:
    """``(ranks, cores)`` of a record run with more local ranks than cores, else ``None``."""
    world = record.get("world", record.get("world_size"))
    if not isinstance(world, int):
        return None
    cores = record.get("cores")
    if not isinstance(cores, int):
        per_rank = record.get("cores_per_rank")
        cores = round(per_rank * world) if isinstance(per_rank, int | float) else RECORDED_CORES
    over = record.get("oversubscribed")
    if over is None:
        over = world > cores
    return (world, cores) if over else None


def _runs(record: dict[str, Any]) -> str:
    values = record.get("hidden_fraction_runs")
    if not isinstance(values, list) or len(values) < 2:
        return "-"
    return " / ".join(_num(v, ".2f") for v in values)


def _per_rank(record: dict[str, Any]) -> str:
    per_rank = record.get("cores_per_rank")
    load = record.get("load")
    text = _num(per_rank, ".2g")
    return f"{text} (load {load:.1f})" if isinstance(load, int | float) else text


def link_markdown(
    records: list[dict[str, Any]], title: str = "## Modeled link (simulation)"
) -> str:
    """The modeled-link table of the records marked ``simulated``, under ``title``."""
    lines = [
        "| package | comparison | ours (ms) | baseline (ms) | ratio (ours / baseline) "
        "| link latency | link bandwidth | T_link (ms/step) | hidden fraction "
        "| link added to ours (ms/step) | ranks | hidden fraction of each run "
        "| cores per rank (load) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        latency = r.get("link_latency_s")
        lines.append(
            f"| {r['source']} | `{r['name']}` | {_ms(r['ours_s'])} | {_ms(r['baseline_s'])} "
            f"| {r['ratio']:.3f}x | {_num(latency * 1e6 if latency is not None else None, '.0f')}"
            f" µs | {_bandwidth(r.get('link_bytes_per_s'))} | {_ms(r.get('t_link_s'))} "
            f"| {_num(r.get('hidden_fraction'), '.2f')} | {_ms(r.get('link_added_ours_s'))} "
            f"| {r.get('world_size', '-')} | {_runs(r)} | {_per_rank(r)} |"
        )
    return (
        f"{title}\n\nNot a measurement of any real interconnect: these runs "
        "use hp-dtensor's `simulated_link`, under which every collective completes no earlier "
        "than launch + latency + bytes / bandwidth; the remaining time is slept in the waiting "
        "thread, so compute issued between a collective's launch and its wait hides it, while a "
        "blocking call pays all of it. Compute is real (this CPU). T_link: modeled link time "
        "per step, of the baseline where a hidden fraction is given (else of ours); "
        "hidden fraction = (T_baseline − T_ours) / T_link (1: all "
        "communication hidden, 0: none). Link added to ours: the time ours' waits slept per "
        "step, i.e. what the modeled link adds to ours' own step (median of 3 steps; '-' where "
        "a record predates it): the hidden fraction also counts ours' own "
        "step being slower than the baseline's compute (on this CPU mostly gloo's real "
        "transfers, which run beside ours' matmuls but inside the baseline's modeled waits)."
        "\n\n" + "\n".join(lines) + "\n"
    )


def markdown(records: list[dict[str, Any]], notes: str = "") -> str:
    """The summary: the plain table, the modeled-link table (if any record is simulated) and
    ``notes`` as "Run notes" (if given)."""
    headline = [r for r in records if oversubscription(r) is None]
    plain = [r for r in headline if not r.get("simulated")]
    simulated = [r for r in headline if r.get("simulated")]
    text = _plain_markdown(plain)
    if simulated:
        text += "\n" + link_markdown(simulated)
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        key = oversubscription(r)
        if key is not None:
            groups.setdefault(key, []).append(r)
    for (world, cores), rows in sorted(groups.items()):
        text += (
            f"\n## Oversubscribed ({world} ranks on {cores} cores)\n\nMore local ranks than "
            "cores: each rank's compute, its gloo copies and the other ranks' work time-share "
            "the cores, so these rows judge the oversubscription as much as the schedule; the "
            "headline tables above are the runs at one core per rank.\n"
        )
        rows_plain = [r for r in rows if not r.get("simulated")]
        rows_link = [r for r in rows if r.get("simulated")]
        if rows_plain:
            text += "\n" + _plain_table(rows_plain)
        if rows_link:
            text += "\n" + link_markdown(
                rows_link, f"### Modeled link (simulation), oversubscribed ({world} ranks on "
                f"{cores} cores)"
            )  # fmt: skip
    if notes.strip():
        text += "\n## Run notes\n\n" + notes.strip() + "\n"
    return text


def _plain_markdown(records: list[dict[str, Any]]) -> str:
    return (
        "# Benchmark summary\n\nratio < 1: ours is faster than the baseline (median of "
        "interleaved repetitions, one run). Headline tables: runs at one core per rank or more; "
        "runs with more ranks than cores follow in their own sections, labelled "
        "oversubscribed.\n\n" + _plain_table(records)
    )


def _plain_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| package | comparison | ours (ms) | baseline (ms) | ratio (ours / baseline) "
        "| peak mem ours / baseline (MiB) | device | ranks |",
        "|---|---|---:|---:|---:|---|---|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['source']} | `{r['name']}` | {_ms(r['ours_s'])} | {_ms(r['baseline_s'])} "
            f"| {r['ratio']:.3f}x | {_mib(r.get('peak_mem_ours'))} / "
            f"{_mib(r.get('peak_mem_baseline'))} | {r.get('device', '-')} "
            f"| {r.get('world_size', '-')} |"
        )
    return "\n".join(lines) + "\n"


def chart(records: list[dict[str, Any]], path: Path, plt: Any) -> None:
    labels = [
        f"{r['source']}: {r['name']}" + (" [sim]" if r.get("simulated") else "") for r in records
    ]
    ratios = [r["ratio"] if math.isfinite(r["ratio"]) else 0.0 for r in records]
    height = max(2.5, 0.35 * len(records) + 1.2)
    fig, ax = plt.subplots(figsize=(10, height))
    sources = sorted({r["source"] for r in records})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [palette[sources.index(r["source"]) % len(palette)] for r in records]
    y = list(range(len(records)))[::-1]
    bars = ax.barh(y, ratios, color=colors)
    for bar, r in zip(bars, records):
        if r.get("simulated"):
            bar.set_hatch("//")
            bar.set_edgecolor("black")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("time ratio, ours / baseline (< 1: ours faster)")
    for yi, value in zip(y, ratios):
        ax.text(value, yi, f" {value:.2f}x", va="center", fontsize=7)
    ax.set_title("hyper-parallel layers: benchmark ratios")
    ax.set_xlim(0, max([1.2, *ratios]) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    out_dir = None
    if len(argv) == 3 and argv[1] == "--out":
        out_dir = Path(argv[2])
        argv = argv[:1]
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[0])
    out_dir = out_dir or directory
    if not directory.is_dir():
        print(f"bench_summary: {directory} is not a directory", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "bench_summary: matplotlib is required for summary.png "
            "(pip install matplotlib, or run `nox -s bench`)",
            file=sys.stderr,
        )
        return 1
    records, sources = load_records(directory)
    if not records:
        print(f"bench_summary: no benchmark records (*.json) in {directory}", file=sys.stderr)
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(
        json.dumps({"records": records, "sources": sources}, indent=2) + "\n"
    )
    notes = directory / "notes.md"
    md = markdown(records, notes.read_text() if notes.is_file() else "")
    (out_dir / "summary.md").write_text(md)
    chart(records, out_dir / "summary.png", plt)
    print(md)
    for name in OUTPUTS:
        print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
