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


@pytest.mark.parametrize("world", [4])  # 4: also the 2-D mesh the resolver rejects
def test_every_start_equals_torchs_collective_and_is_recorded_once(world):
    for rank, r in enumerate(run_distributed(rank_comm, world, timeout=TIMEOUT)):
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
        if world == 4:
            assert r["errors"]["2-D"].startswith("ValueError: the test needs a 1-D mesh")
        assert r["errors"]["object"].startswith("TypeError: expected a 1-D DeviceMesh")


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
