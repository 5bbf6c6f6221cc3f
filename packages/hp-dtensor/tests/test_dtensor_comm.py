"""The communication runtime: every ``start_*`` equals torch's blocking collective, is recorded
with the one byte rule (the same bytes the modeled link counts), appears in a torch.profiler
trace, is listed while pending, waits exactly once; the group resolver's fields and errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import all_gather_single, comm, init_device_mesh
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.simlink import simulated_link
from hyper_parallel.dtensor.testing import run_distributed

TIMEOUT = 120.0


def _reference(x: torch.Tensor, p: int, rank: int) -> dict[str, torch.Tensor]:
    """torch's own blocking collectives on dim 0 / dim 1 layouts."""
    gathered = torch.empty(p * x.shape[0], *x.shape[1:])
    all_gather_single(gathered, x.contiguous())
    summed = x.clone()
    dist.all_reduce(summed)
    a2a = torch.empty_like(x)
    dist.all_to_all_single(a2a, x.contiguous())
    return {
        "ag": gathered,
        "rs": summed.chunk(p, 0)[rank],
        "a2a": a2a,
        "ar": summed,
    }


def rank_comm() -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("x",))
    g = comm.resolve_group(mesh, "the test")
    x = torch.randn(4 * p, 3, generator=torch.Generator().manual_seed(rank))
    ref = _reference(x, p, rank)
    out: dict = {"group": (g.size, g.rank, g.ranks, g.device_type, g.prev, g.next)}
    with record_events() as rec:
        works = {
            "ag": comm.start_all_gather(x, 0, g, "all_gather:t", "forward", "test"),
            "rs": comm.start_reduce_scatter(x, 0, g, "reduce_scatter:t", "forward", "test"),
            "a2a": comm.start_all_to_all(x, 0, 0, g, "a2a:t", "forward", "test"),
            "ar": comm.start_all_reduce(x.clone(), g, "all_reduce:t", "forward", "test"),
        }
        out["pending"] = sorted(comm.pending_collectives())
        results = {k: w.wait() for k, w in works.items()}
        nxt, prv = (rank + 1) % p, (rank - 1) % p
        recv = torch.empty_like(x)
        r = comm.start_recv(recv, prv, g, "recv:t", "forward", "test")
        s = comm.start_send(x, nxt, g, "send:t", "forward", "test")
        s.wait()
        out["recv_ok"] = torch.equal(
            r.wait(), torch.randn(4 * p, 3, generator=torch.Generator().manual_seed(prv))
        )
    out["pending_after"] = comm.pending_collectives()
    out["same"] = {k: torch.equal(results[k], ref[k]) for k in ref}
    out["events"] = [(e.kind, e.name, e.nbytes) for e in rec.events]
    try:
        works["ag"].wait()
        out["twice"] = None
    except RuntimeError as e:
        out["twice"] = str(e)
    # the modeled link counts exactly the bytes the recorder does
    with simulated_link(0.0, 1e12) as stats, record_events() as rec2:
        for w in [
            comm.start_all_gather(x, 0, g, "all_gather:t", "forward", "test"),
            comm.start_reduce_scatter(x, 0, g, "reduce_scatter:t", "forward", "test"),
            comm.start_all_to_all(x, 0, 0, g, "a2a:t", "forward", "test"),
            comm.start_all_reduce(x.clone(), g, "all_reduce:t", "forward", "test"),
        ]:
            w.wait()
    out["link_bytes"] = (stats.bytes, rec2.bytes_received())
    # a user's torch.profiler trace names each launch and wait
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.start_all_to_all(x, 0, 0, g, "a2a:profiled", "forward", "test").wait()
    out["profiled"] = sorted({e.name for e in prof.events() if e.name.startswith("hp.comm")})
    # one rank: nothing is sent, a finished Work
    solo = [dist.new_group([i]) for i in range(p)][rank]
    g1 = comm.resolve_group(solo)
    with record_events() as rec3:
        w1 = comm.start_all_to_all(x, 0, 0, g1, "a2a:solo", "forward", "test")
    out["solo"] = (torch.equal(w1.wait(), x), [e.nbytes for e in rec3.events if e.kind == "launch"])
    # leaked collectives of an owner are reported and forgotten
    comm.start_all_gather(x, 0, g, "all_gather:leak", "forward", "leaky").wait()
    leak = comm.start_all_gather(x, 0, g, "all_gather:leak2", "forward", "leaky")
    try:
        comm.raise_if_pending("the test", "leaky")
        out["leak"] = None
    except RuntimeError as e:
        out["leak"] = str(e)
    leak.wait()
    # a collective in flight on another lane (an interleaved computation) is not this lane's leak
    previous = comm.set_lane(1)
    other = comm.start_all_gather(x, 0, g, "all_gather:lane1", "forward", "leaky")
    comm.set_lane(2)
    out["other_lane"] = comm.leaked_by("leaky")
    comm.set_lane(1)
    out["own_lane"] = comm.leaked_by("leaky")
    comm.set_lane(previous)
    other.wait()
    errors = {}
    mesh2 = init_device_mesh("cpu", (p // 2, 2), mesh_dim_names=("a", "b")) if p >= 4 else None
    for name, bad in (("2-D", mesh2), ("object", object())):
        if bad is None:
            continue
        try:
            comm.resolve_group(bad, "the test")
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


# ---- start_all_to_all_v: uneven rows ---------------------------------------------------------
ROW = (2, 3)  # the shape of one row
ROW_BYTES = 2 * 3 * 4  # float32
# SPLITS[P][i][j]: rows group rank i sends to group rank j. 4 ranks: rank 0 sends nothing,
# rank 2 receives nothing, ranks 1 and 3 keep rows of their own. 2 ranks, two pairs of the
# 4-rank world: in pair (0, 1) rank 1 sends nothing and rank 0 receives nothing.
SPLITS = {
    4: [[0, 0, 0, 0], [2, 1, 0, 3], [1, 0, 0, 2], [3, 2, 0, 1]],
    2: [[0, 3], [0, 0]],
    "2b": [[2, 1], [4, 0]],
}


def _rows(src: int, dst: int, n: int) -> torch.Tensor:
    """The ``n`` rows group rank ``src`` sends to ``dst``: every row names its route."""
    i = torch.arange(n, dtype=torch.float32)
    base = torch.arange(6, dtype=torch.float32).view(ROW)
    return 1000 * src + 100 * dst + 10 * i[:, None, None] + base


def _expected(splits: list[list[int]], rank: int) -> torch.Tensor:
    return torch.cat([_rows(j, rank, row[rank]) for j, row in enumerate(splits)])


def _a2av_case(splits: list[list[int]], g: comm.Group) -> dict:
    """One uneven all-to-all on ``g``: its result, its Work's bytes and the recorded bytes."""
    me, p = g.rank, g.size
    send = splits[me]
    recv = [splits[j][me] for j in range(p)]
    x = torch.cat([_rows(me, j, n) for j, n in enumerate(send)])
    with record_events() as rec:
        work = comm.start_all_to_all_v(x, send, recv, g, "a2av:t", "forward", "test")
        out = work.wait()
    return {
        "same": torch.equal(out, _expected(splits, me)),
        "shape": tuple(out.shape),
        "nbytes": work.nbytes,
        "recorded": [e.nbytes for e in rec.events if e.kind == "launch"],
    }


def rank_a2av() -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    g = comm.resolve_group(init_device_mesh("cpu", (p,), mesh_dim_names=("x",)))
    out: dict = {4: _a2av_case(SPLITS[4], g)}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = comm.resolve_group(pairs[rank // 2])
    out[2 if rank < 2 else "2b"] = _a2av_case(SPLITS[2 if rank < 2 else "2b"], pair)
    # the modeled link counts an uneven all_to_all_single by its input splits, and counts
    # what the recorder does for start_all_to_all_v
    send = SPLITS[4][rank]
    recv = [SPLITS[4][j][rank] for j in range(p)]
    x = torch.ones(sum(send), *ROW)
    with simulated_link(0.0, 1e12) as stats:
        dist.all_to_all_single(torch.empty(sum(recv), *ROW), x, recv, send)
    plain = stats.bytes
    with simulated_link(0.0, 1e12) as stats, record_events() as rec:
        comm.start_all_to_all_v(x, send, recv, g, "a2av:link", "forward", "test").wait()
    out["link"] = (plain, stats.bytes, rec.bytes_received())
    # wrong split lengths or row counts raise before any communication, on the raising rank
    errors = {}
    for name, args in {
        "send splits": (x, send[:-1], recv),
        "recv splits": (x, send, recv + [0]),
        "rows": (torch.ones(sum(send) + 1, *ROW), send, recv),
    }.items():
        try:
            comm.start_all_to_all_v(*args, g, "a2av:bad", "forward", "test")
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["pending"] = comm.pending_collectives()
    # one rank: nothing is exchanged, the rows come back
    solo = comm.resolve_group([dist.new_group([i]) for i in range(p)][rank])
    y = torch.randn(3, *ROW)
    w = comm.start_all_to_all_v(y, [3], [3], solo, "a2av:solo", "forward", "test")
    out["solo"] = (torch.equal(w.wait(), y), w.nbytes)
    return out


def _rank_all() -> dict:
    return {"comm": rank_comm(), "a2av": rank_a2av()}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """Every 4-rank check's results, by rank (one spawn for the module)."""
    return run_distributed(_rank_all, 4, timeout=TIMEOUT)


def test_every_start_equals_torchs_collective_and_is_recorded_once(four_ranks):
    world = 4  # 4: also the 2-D mesh the resolver rejects
    for rank, r in enumerate(rank["comm"] for rank in four_ranks):
        assert r["same"] == {"ag": True, "rs": True, "a2a": True, "ar": True}
        assert r["recv_ok"]
        assert r["group"] == (
            world, rank, tuple(range(world)), "cpu",
            rank - 1 if rank else None, rank + 1 if rank + 1 < world else None,
        )  # fmt: skip
        assert r["pending"] == sorted(
            f"{n}:t (forward)" for n in ("all_gather", "reduce_scatter", "a2a", "all_reduce")
        )
        assert r["pending_after"] == []
        buf = 4 * world * 3 * 4  # bytes of x
        launches = {n: b for k, n, b in r["events"] if k == "launch"}
        assert launches == {
            "all_gather:t": comm.link_bytes("all_gather", buf * world, world),
            "reduce_scatter:t": comm.link_bytes("reduce_scatter", buf, world),
            "a2a:t": comm.link_bytes("all_to_all", buf, world),
            "all_reduce:t": comm.link_bytes("all_reduce", buf, world),
            "send:t": buf,
            "recv:t": buf,
        }
        kinds = [k for k, n, _ in r["events"] if n == "a2a:t"]
        assert kinds == ["launch", "wait_begin", "wait"]
        assert "already waited" in r["twice"]
        assert r["link_bytes"][0] == r["link_bytes"][1] > 0
        assert r["profiled"] == ["hp.comm.launch a2a:profiled", "hp.comm.wait a2a:profiled"]
        assert r["solo"] == (True, [0])
        assert "all_gather:leak2 (forward)" in r["leak"] and "leak (" not in r["leak"]
        assert r["other_lane"] == [] and r["own_lane"] == ["all_gather:lane1 (forward)"]
        if world == 4:
            assert r["errors"]["2-D"].startswith("ValueError: the test needs a 1-D mesh")
        assert r["errors"]["object"].startswith("TypeError: expected a 1-D DeviceMesh")


@pytest.mark.parametrize("p", [4, 2, "2b"])
def test_all_to_all_v_delivers_uneven_rows_and_records_the_rows_sent_to_others(p, four_ranks):
    splits = SPLITS[p]
    size = len(splits)
    ranks = range(4) if p == 4 else (range(2) if p == 2 else range(2, 4))
    for group_rank, rank in enumerate(ranks):
        r = four_ranks[rank]["a2av"][p]
        assert r["same"], (p, rank)
        recv_rows = sum(splits[j][group_rank] for j in range(size))
        assert r["shape"] == (recv_rows, *ROW)
        send = splits[group_rank]
        to_others = sum(send) - send[group_rank]
        assert (
            r["nbytes"]
            == to_others * ROW_BYTES
            == comm.all_to_all_v_bytes(ROW_BYTES, send, group_rank)
        )
        assert r["recorded"] == [r["nbytes"]]
    # the edge ranks are really there: one sends nothing, one receives nothing
    assert four_ranks[0]["a2av"][4]["nbytes"] == 0 and four_ranks[2]["a2av"][4]["shape"][0] == 0


def test_the_modeled_link_counts_an_uneven_all_to_all_by_its_splits(four_ranks):
    for rank, r in enumerate(rank["a2av"] for rank in four_ranks):
        send = SPLITS[4][rank]
        assert r["link"] == ((sum(send) - send[rank]) * ROW_BYTES,) * 3, rank
    # not the even rule (3/4 of the input): rank 1 holds 6 rows and 5 of them leave it
    even = comm.link_bytes("all_to_all", 6 * ROW_BYTES, 4)
    assert four_ranks[1]["a2av"]["link"][0] == 5 * ROW_BYTES != even


def test_all_to_all_v_rejects_wrong_split_lengths_and_row_counts(four_ranks):
    for rank, r in enumerate(rank["a2av"] for rank in four_ranks):
        rows = sum(SPLITS[4][rank])
        assert r["errors"] == {
            "send splits": "start_all_to_all_v: 3 send and 4 receive splits for a group of 4",
            "recv splits": "start_all_to_all_v: 4 send and 5 receive splits for a group of 4",
            "rows": f"start_all_to_all_v: {rows + 1} rows, splits sum to {rows}",
        }
        assert r["pending"] == []
        assert r["solo"] == (True, 0)


def test_all_to_all_v_bytes_counts_only_rows_leaving_the_rank():
    assert comm.all_to_all_v_bytes(24, [2, 1, 0, 3], 1) == 24 * 5
    assert comm.all_to_all_v_bytes(24, [0, 0, 0, 0], 0) == 0
    assert comm.all_to_all_v_bytes(24, [7], 0) == 0  # one rank: nothing leaves


def test_the_byte_rule():
    assert comm.link_bytes("all_gather", 400, 4) == 300
    assert comm.link_bytes("reduce_scatter", 400, 4) == 300
    assert comm.link_bytes("all_to_all", 400, 4) == 300
    assert comm.link_bytes("all_reduce", 400, 4) == 600
    assert comm.link_bytes("send", 400, 4) == comm.link_bytes("recv", 400, 2) == 400
    assert comm.link_bytes("all_reduce", 400, 1) == comm.link_bytes("send", 400, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        comm.link_bytes("gossip", 1, 2)


def test_device_backends_are_written_once():
    from hyper_parallel.dtensor.devices import BACKENDS, bind_device, process_group_backend

    assert [process_group_backend(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    assert sorted(BACKENDS) == ["cpu", "cuda", "npu"]
    assert bind_device("cpu", 3) == torch.device("cpu")
    for bad in ("tpu", "CPU"):
        with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda', 'npu'\]"):
            bind_device(bad, 0)
