"""tools/bench_summary.py: records of every package's latest run (docs/bench-records/) make one
summary; a package run again replaces only its own rows; the run notes come last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_summary  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _write(directory: Path, dist: str, ours: float) -> None:
    rec = {"name": f"{dist}/x_vs_y", "ours_s": ours, "baseline_s": 2.0, "world_size": 2}
    (directory / f"{dist}.json").write_text(json.dumps([rec]))


def test_each_package_keeps_its_own_rows_and_notes_come_last(tmp_path: Path) -> None:
    _write(tmp_path, "hp-mc2", 1.0)
    _write(tmp_path, "hp-models", 1.5)
    records, sources = bench_summary.load_records(tmp_path)
    assert sources == {"hp-mc2": 1, "hp-models": 1}
    _write(tmp_path, "hp-models", 0.5)  # hp-models benchmarked again
    records, _ = bench_summary.load_records(tmp_path)
    md = bench_summary.markdown(records, "Load average 1.\n")
    assert "| hp-mc2 | `hp-mc2/x_vs_y` | 1000.00 | 2000.00 | 0.500x |" in md
    assert "| hp-models | `hp-models/x_vs_y` | 500.00 | 2000.00 | 0.250x |" in md
    assert md.rstrip().endswith("## Run notes\n\nLoad average 1.")
    assert "Run notes" not in bench_summary.markdown(records)


def test_the_committed_records_render_every_package() -> None:
    records, sources = bench_summary.load_records(ROOT / "docs" / "bench-records")
    assert set(sources) == {
        "hp-context-parallel",
        "hp-kda-kernels",
        "hp-mc2",
        "hp-models",
        "hp-moe",
    }
    assert all(r["ours_s"] > 0 and r["baseline_s"] > 0 for r in records)


def _link(name: str, world: int, cores: int, **extra: object) -> dict[str, object]:
    return {
        "name": name,
        "ours_s": 1.0,
        "baseline_s": 2.0,
        "simulated": True,
        "t_link_s": 1.0,
        "hidden_fraction": 0.8,
        "world_size": world,
        "world": world,
        "cores": cores,
        "cores_per_rank": cores / world,
        "load": 0.2,
        "oversubscribed": world > cores,
        **extra,
    }


def test_one_core_per_rank_rows_are_the_headline_and_oversubscribed_rows_follow(
    tmp_path: Path,
) -> None:
    rows = [
        _link("moe/link/ours_auto_vs_blocking", 2, 2, hidden_fraction_runs=[0.79, 0.8, 0.82]),
        _link("moe/link/ours_auto_vs_blocking_p4", 4, 2),
        {"name": "old/plain_p4", "ours_s": 1.0, "baseline_s": 2.0, "world_size": 4},
    ]
    (tmp_path / "hp-moe.json").write_text(json.dumps(rows))
    records, _ = bench_summary.load_records(tmp_path)
    md = bench_summary.markdown(records)
    head, _, over = md.partition("## Oversubscribed (4 ranks on 2 cores)")
    assert "`moe/link/ours_auto_vs_blocking`" in head and "0.79 / 0.80 / 0.82" in head
    assert "1 (load 0.2)" in head
    assert "ours_auto_vs_blocking_p4" not in head and "old/plain_p4" not in head
    # the oversubscribed rows (a record predating the fields by its world_size) in their own
    # plain and link tables
    assert "`old/plain_p4`" in over and "`moe/link/ours_auto_vs_blocking_p4`" in over
    assert "### Modeled link (simulation), oversubscribed (4 ranks on 2 cores)" in over
    assert bench_summary.oversubscription(records[0]) is None
    assert bench_summary.oversubscription(records[1]) == (4, 2)
