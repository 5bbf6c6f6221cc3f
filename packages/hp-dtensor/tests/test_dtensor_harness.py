"""The harness itself: results by rank, a raising rank surfaces its traceback, a hang fails
within the timeout instead of blocking the test run; ranks start with the caller's modules
already imported by the fork server; inside a rank pool (one per test module, from hp-dtensor's
pytest plugin) calls share their ranks, and a call's changes to a rank do not reach the next."""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor.testing import (
    DistributedTimeout,
    RankFailure,
    rank_pool,
    run_distributed,
)

_IMPORTED_BY = os.getpid()  # the process that imported this module


def _rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() + offset, t.item(), torch.get_num_threads()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_results_come_back_in_rank_order(world):
    results = run_distributed(_rank_and_sum, world, 100, timeout=60)
    total = world * (world - 1) / 2
    assert results == [(100 + r, total, 1) for r in range(world)]


def _rank_two_raises():
    if dist.get_rank() == 2:
        raise ZeroDivisionError("rank two divides by zero")
    dist.barrier()  # the others wait for rank 2, which never arrives
    return dist.get_rank()


def test_raising_rank_surfaces_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(_rank_two_raises, 4, timeout=120)
    assert info.value.rank == 2
    assert info.value.exc_types[2] == "ZeroDivisionError"
    assert "rank two divides by zero" in info.value.failures[2]
    assert "_rank_two_raises" in info.value.failures[2]  # the traceback names the function
    assert "rank 2 raised ZeroDivisionError" in str(info.value)
    # peers stuck in the barrier do not hold the caller until the 120 s timeout
    assert time.monotonic() - start < 60


def _rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return os.getpid()


def test_hanging_rank_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(_rank_one_hangs, 2, timeout=10)
    assert 1 in info.value.pending
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_world_size_is_rejected(bad):
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_rank_and_sum, bad, 0)


def _who_imported():
    return _IMPORTED_BY, os.getpid(), os.getppid(), os.environ.get("HP_TEST_PRELOAD")


@pytest.mark.skipif(
    "forkserver" not in mp.get_all_start_methods(), reason="ranks are spawned: nothing preloaded"
)
def test_fork_server_preloads_the_callers_modules_and_names_them_to_nobody_else():
    """The test module (and everything the caller imported from outside the installation) is
    imported once, by the fork server, not again by every rank; the variable naming the
    modules reaches neither the ranks nor the caller's environment."""
    for imported_by, pid, parent, leaked in run_distributed(_who_imported, 2, timeout=60):
        assert imported_by != pid, "the rank imported the test module itself"
        assert imported_by == parent, "not imported by the fork server the rank came from"
        assert leaked is None
    assert "HP_TEST_PRELOAD" not in os.environ


def _state_then_change(mark):
    """This rank's pid and what an earlier call may have left behind; then leave some of it."""
    seen = (os.getpid(), os.environ.get("HP_HARNESS_MARK"), torch.get_default_dtype(),
            torch.is_grad_enabled(), torch.get_num_threads())  # fmt: skip
    os.environ["HP_HARNESS_MARK"] = mark
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return seen, t.item()


_MESHES = []  # in a rank: the mesh each call got from hp-dtensor's (world-scoped) cache


def _cached_mesh():
    from hyper_parallel.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    same_in_call = init_device_mesh("cpu", (2,)) is mesh
    from_earlier_call = any(m is mesh for m in _MESHES)
    _MESHES.append(mesh)
    return os.getpid(), same_in_call, from_earlier_call


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    return os.getpid()


def test_pool_reuses_its_ranks_and_a_call_leaves_nothing_behind():
    with rank_pool():
        first = run_distributed(_state_then_change, 2, "a", timeout=60)
        second = run_distributed(_state_then_change, 2, "b", timeout=60)
        other_size = run_distributed(_state_then_change, 4, "c", timeout=60)
        third = run_distributed(_state_then_change, 2, "d", timeout=60)
    for r in range(2):
        assert second[r][0][0] == first[r][0][0] == third[r][0][0], "ranks were not reused"
        for seen, total in (first[r], second[r], third[r]):
            assert seen[1:] == (None, torch.float32, True, 1), seen  # nothing left behind
            assert total == 2.0
    assert {o[0][0] for o in other_size}.isdisjoint({f[0][0] for f in first})
    assert [o[1] for o in other_size] == [4.0] * 4


def test_each_pooled_call_runs_in_a_process_group_of_its_own():
    """Same processes, but the world of one call (its groups, and every world-scoped cache of
    meshes and groups) is destroyed before the next call builds its own."""
    with rank_pool():
        first = run_distributed(_cached_mesh, 2, timeout=60)
        second = run_distributed(_cached_mesh, 2, timeout=60)
    assert [f[0] for f in first] == [s[0] for s in second]  # the same processes
    assert all(f[1] and s[1] for f, s in zip(first, second))  # cached within a call
    assert not any(s[2] for s in second)  # but not across calls


def test_a_failed_call_ends_its_pool_and_the_next_call_starts_fresh_ranks():
    with rank_pool():
        before = [seen[0] for seen, _ in run_distributed(_state_then_change, 2, "a", timeout=60)]
        with pytest.raises(RankFailure) as info:
            run_distributed(_fail_on_rank_one, 2, timeout=60)
        assert info.value.rank == 1 and "rank one fails" in info.value.failures[1]
        after = [seen[0] for seen, _ in run_distributed(_state_then_change, 2, "b", timeout=60)]
    assert set(before).isdisjoint(after)


def test_a_hang_inside_a_pool_fails_within_the_timeout_and_the_pool_recovers():
    with rank_pool():
        start = time.monotonic()
        with pytest.raises(DistributedTimeout):
            run_distributed(_rank_one_hangs, 2, timeout=10)
        assert time.monotonic() - start < 30
        assert [r[1] for r in run_distributed(_rank_and_sum, 2, 0, timeout=60)] == [1.0, 1.0]


def test_pool_off_starts_ranks_for_every_call(monkeypatch):
    monkeypatch.setenv("HP_TEST_POOL", "0")
    with rank_pool():
        first = run_distributed(_state_then_change, 2, "a", timeout=60)
        second = run_distributed(_state_then_change, 2, "b", timeout=60)
    assert {f[0][0] for f in first}.isdisjoint({s[0][0] for s in second})


def test_the_pytest_plugin_pools_the_ranks_of_a_test_module():
    """No explicit scope: hp-dtensor's pytest plugin (entry point ``pytest11``) opened one for
    this module, so both calls run on the same ranks."""
    first = run_distributed(_state_then_change, 2, "a", timeout=60)
    second = run_distributed(_state_then_change, 2, "b", timeout=60)
    assert [f[0][0] for f in first] == [s[0][0] for s in second]
