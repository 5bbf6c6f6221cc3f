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


COMPUTE_S = 0.1  # the "compute" of the measured steps below: a sleep, steady on a busy host


def _blocking_step(buf: torch.Tensor) -> None:
    time.sleep(COMPUTE_S)
    dist.all_reduce(buf)


def _overlapped_step(buf: torch.Tensor) -> None:
    work = dist.all_reduce(buf, async_op=True)
    time.sleep(COMPUTE_S)
    work.wait()


def _measured_link() -> dict[str, object]:
    """``measure_under_link`` on a blocking step (compute, then a blocking all-reduce), its
    twin and the overlapped step (the all-reduce launched before the compute, waited after),
    the bandwidth calibrated on the blocking one."""
    from hyper_parallel.dtensor.benchmarking import bytes_per_call, measure_under_link

    buf = torch.ones(64 * 1024)
    cases = {
        "blocking": lambda: _blocking_step(buf),
        "overlapped": lambda: _overlapped_step(buf),
        "blocking_twin": lambda: _blocking_step(buf),
    }
    m = measure_under_link(cases, "blocking", latency_s=1e-3, repeats=3, runs=2)
    fixed = measure_under_link(
        {"overlapped": cases["overlapped"]}, latency_s=1e-3, bandwidth=1e9, repeats=1, runs=0
    )
    return {
        "bytes": bytes_per_call(cases["blocking"]),
        "m": m,
        "ours": m.fields("overlapped"),
        "twin": m.fields("blocking_twin"),
        "self": m.fields("blocking"),
        "record": m.record("x/overlapped_vs_blocking", "overlapped", repeats=3),
        "line": m.calibration_line(),
        "fixed": fixed,
    }


@pytest.mark.timeout(240)
def test_measure_under_link_calibrates_and_compares_against_the_baseline():
    results = run_distributed(_measured_link, 2, timeout=200)
    r = results[0]
    m, ours, twin, own = r["m"], r["ours"], r["twin"], r["self"]
    # an all-reduce moves 2(P-1)/P of its buffer: at P = 2 the whole float32 buffer
    assert r["bytes"] == 64 * 1024 * 4
    assert m.calibrated and m.bytes_per_step == r["bytes"]
    assert m.bytes_per_s == pytest.approx(m.bytes_per_step / m.t_compute_s)
    assert m.t_step_s > 0 and m.t_compute_s > 0
    assert set(m.cases) == {"blocking", "overlapped", "blocking_twin"}
    for case in m.cases.values():
        assert len(case.times_s) == 3 and case.t_link_s > 0 and case.added_s >= 0
    expected = {
        "simulated", "link_latency_s", "link_bytes_per_s", "t_link_s", "t_link_ours_s",
        "link_added_ours_s", "link_added_baseline_s", "t_step_blocking_s",
        "t_compute_blocking_s", "link_bytes_per_step", "hidden_fraction",
        "hidden_fraction_paired", "link_over_compute",
    }  # fmt: skip
    assert set(ours) == set(twin) == set(own) == expected
    # every case moves the same bytes: the same modeled link time, latency + bytes / bandwidth
    link_s = 1e-3 + m.bytes_per_step / m.bytes_per_s
    assert ours["t_link_s"] == ours["t_link_ours_s"] == pytest.approx(link_s)
    assert twin["t_link_ours_s"] == pytest.approx(link_s)
    # the baseline against itself hides nothing, by definition
    assert own["hidden_fraction"] == 0.0 and own["hidden_fraction_paired"] == 0.0
    # the overlapped step hides what its blocking twin pays
    assert ours["hidden_fraction"] > twin["hidden_fraction"]
    assert ours["hidden_fraction_paired"] > twin["hidden_fraction_paired"]
    assert ours["link_added_ours_s"] < ours["link_added_baseline_s"]
    record = r["record"]
    assert record["ours"] == "overlapped" and record["baseline"] == "blocking"
    assert record["ours_s"] == m.cases["overlapped"].time_s
    assert record["baseline_s"] == m.cases["blocking"].time_s
    assert record["repeats"] == 3 and expected <= set(record)
    assert "MiB/step -> bandwidth" in r["line"]
    # a fixed bandwidth: no calibration, no calibration fields
    fixed = r["fixed"]
    assert not fixed.calibrated and fixed.bytes_per_s == 1e9 and fixed.t_step_s is None
    assert fixed.cases["overlapped"].t_link_s == pytest.approx(1e-3 + r["bytes"] / 1e9)
    # both ranks saw the same (slowest-rank) figures
    assert results[1]["m"] == m


def test_measure_under_link_needs_a_baseline_to_calibrate_on():
    from hyper_parallel.dtensor.benchmarking import measure_under_link

    with pytest.raises(ValueError, match="baseline"):
        measure_under_link({"a": lambda: None}, latency_s=0.0, repeats=1)
    with pytest.raises(ValueError, match="not one of the cases"):
        measure_under_link({"a": lambda: None}, "b", latency_s=0.0, repeats=1)
