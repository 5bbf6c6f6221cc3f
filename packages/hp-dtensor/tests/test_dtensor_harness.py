"""The harness itself: results by rank, a raising rank surfaces its traceback, a hang fails
within the timeout instead of blocking the test run; ranks start with the caller's modules
already imported by the fork server."""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor.testing import DistributedTimeout, RankFailure, run_distributed

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
