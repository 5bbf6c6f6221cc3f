"""The modeled link: a collective takes at least its modeled time, compute issued between an
async launch and its wait hides the link (max, not sum), a blocking call pays all of it, and
no result changes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import all_gather_single, reduce_scatter_single
from hyper_parallel.dtensor.simlink import simulated_link
from hyper_parallel.dtensor.testing import run_distributed

LATENCY = 0.05
LINK_S = 0.4  # modeled time of one all-gather below


def _busy(seconds: float) -> float:
    """Sleep-free compute for about ``seconds``; returns its measured duration."""
    a = torch.randn(128, 128)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def _collectives() -> list[torch.Tensor]:
    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, generator=g)
    out = [torch.empty(4 * p, 3)]
    all_gather_single(out[0], x)
    rs = torch.empty(4 // p, 3)
    reduce_scatter_single(rs, x.contiguous())
    a2a = torch.empty_like(x)
    dist.all_to_all_single(a2a, x, async_op=True).wait()
    ar = x.clone()
    dist.all_reduce(ar)
    recv = torch.empty_like(x)
    works = [dist.isend(x, (rank + 1) % p), dist.irecv(recv, (rank - 1) % p)]
    for w in works:
        w.wait()
    return [out[0], rs, a2a, ar, recv]


def _model_check() -> dict[str, float]:
    x = torch.randn(1024, 256)
    out = torch.empty(2 * 1024, 256)
    nbytes = out.numel() * out.element_size() // 2  # (P-1)/P of the gathered buffer
    bandwidth = nbytes / (LINK_S - LATENCY)
    res: dict[str, float] = {}
    plain = _collectives()
    with simulated_link(LATENCY, bandwidth) as stats:
        linked = _collectives()
        res["same_results"] = float(all(torch.equal(a, b) for a, b in zip(plain, linked)))
        stats.collectives = stats.bytes = 0
        stats.modeled_s = 0.0
        # one blocking collective: at least the modeled time
        t0 = time.perf_counter()
        all_gather_single(out, x)
        res["blocking_s"] = time.perf_counter() - t0
        res["modeled_s"] = stats.modeled_s
        res["counted_bytes"] = stats.bytes / nbytes
        dist.barrier()
        # launch, compute, wait: max(compute, link)
        t0 = time.perf_counter()
        work = all_gather_single(out, x, async_op=True)
        res["compute_s"] = _busy(LINK_S * 1.25)
        work.wait()
        res["overlapped_s"] = time.perf_counter() - t0
        dist.barrier()
        # blocking call, then the same compute: the sum
        t0 = time.perf_counter()
        all_gather_single(out, x)
        res["compute2_s"] = _busy(LINK_S * 1.25)
        res["serial_s"] = time.perf_counter() - t0
        dist.barrier()
        # two launched together share the link: the second is carried after the first
        t0 = time.perf_counter()
        out2 = torch.empty_like(out)
        works = [all_gather_single(o, x, async_op=True) for o in (out, out2)]
        for w in works:
            w.wait()
        res["two_in_flight_s"] = time.perf_counter() - t0
    return res


@pytest.mark.timeout(120)
def test_simulated_link_hides_under_compute_and_changes_no_result():
    for r in run_distributed(_model_check, 2, timeout=100):
        assert r["same_results"] == 1.0
        assert r["counted_bytes"] == 1.0
        assert r["modeled_s"] == pytest.approx(LINK_S)
        assert r["blocking_s"] >= LINK_S
        # overlapped: the wait after compute longer than the link adds (almost) nothing
        assert r["overlapped_s"] - r["compute_s"] < 0.5 * LINK_S, r
        # blocking then compute: compute starts only after the whole link time
        assert r["serial_s"] >= r["compute2_s"] + LINK_S, r
        # one link: two transfers in flight together take both transfer times, one latency
        assert r["two_in_flight_s"] >= 2 * LINK_S - LATENCY, r


def _late_sender() -> float:
    """Rank 0 sends 0.2 s late; rank 1's blocking receive (launched at once) returns after
    the send plus the modeled time, not after the modeled time alone."""
    x = torch.ones(1000)
    dist.barrier()
    with simulated_link(0.3, 1e12):
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            time.sleep(0.2)
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        return time.perf_counter() - t0


@pytest.mark.timeout(60)
def test_a_blocking_receive_pays_the_link_after_the_send():
    sender, receiver = run_distributed(_late_sender, 2, timeout=50)
    # the send starts 0.2 s after the sender's barrier exit and its modeled time is 0.3 s; the
    # receiver left the barrier a little later (tens of ms on a loaded host), so it waits at
    # least 0.5 s less that skew, and a receive that paid the modeled time alone would be 0.3
    assert sender >= 0.5, (sender, receiver)
    assert receiver >= 0.5 - 0.05, (sender, receiver)


def _bad_link() -> str:
    try:
        with simulated_link(0.0, 0.0):
            pass
    except ValueError as exc:
        return str(exc)
    return ""


def test_simulated_link_rejects_a_bandwidth_of_zero():
    assert "bytes_per_s > 0" in _bad_link()
