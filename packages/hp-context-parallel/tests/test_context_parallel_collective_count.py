"""One forward (and backward) of a context-parallel MLA issues only its schedule's collectives.

Inside the ranks every collective function of ``torch.distributed`` is wrapped to count its
calls (the outermost call only: a renamed function forwarding to its old name counts once);
a stock Hugging Face ``DeepseekV3Attention`` rewritten by ``parallelize_mla`` then runs one
forward and one backward on 2 gloo ranks, for both strategies, overlap on and off, plain
causal and with packed documents. With consistency mode off (the default) the counted calls
are exactly the schedule's — the launches the event recorder lists, and the numbers the
strategies document: expanded a2a Q, K, V, O forward and dO, dQ, dK, dV backward; latent
all-gather of the latent and a2a Q, O forward, a2a dO, dQ and the latent's reduce-scatter
backward — and no all-reduce (the former per-call agreement step). The forward also reads
nothing back to the host for a plain causal call; with packed documents given as a table, the
table (a CPU tensor here: no device sync) once and the table fingerprints the first exchange
brought (every rank's, compared so that ranks given different tables all raise) once. With
consistency mode on the ranks' comparison adds its two all-gathers per forward, and still no
all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_hf import build, call, cp_mesh, inputs, rope_tables

from hyper_parallel.context_parallel import parallelize_mla, record_events, shard_sequence
from hyper_parallel.dtensor import consistency_checks
from hyper_parallel.dtensor.testing import run_distributed

# name in torch.distributed -> the kind it is counted as (old and new names of one collective
# count as one kind; the recorder's launch names map onto the same kinds)
_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_list",
    "all_gather_object": "all_gather_list",
    "all_gather_into_tensor": "all_gather_tensor",
    "all_gather_single": "all_gather_tensor",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "p2p",
    "recv": "p2p",
    "isend": "p2p",
    "irecv": "p2p",
    "batch_isend_irecv": "p2p",
}
_RECORDED = {"a2a": "all_to_all_single", "all_gather": "all_gather_tensor"}
_RECORDED["reduce_scatter"] = "reduce_scatter_tensor"
# what each strategy documents (pipeline's and strategies' docstrings), per forward / backward
SCHEDULE = {
    "expanded": ({"all_to_all_single": 4}, {"all_to_all_single": 4}),
    "latent": (
        {"all_gather_tensor": 1, "all_to_all_single": 2},
        {"all_to_all_single": 2, "reduce_scatter_tensor": 1},
    ),
}
# host reads: each is a device-to-host sync when the tensor is on an accelerator
_TENSOR_READS = ("tolist", "item", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def _counting() -> Iterator[Counter]:
    """Count the outermost calls of torch.distributed's collectives and of the tensor
    host reads while inside."""
    counts: Counter = Counter()
    depth = [0]

    def wrap(fn: Any, key: str) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[key] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    saved_dist = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    saved_tensor = {n: vars(torch.Tensor).get(n) for n in _TENSOR_READS}
    saved_equal = torch.equal
    try:
        for name, fn in saved_dist.items():
            setattr(dist, name, wrap(fn, _COLLECTIVES[name]))
        for name in _TENSOR_READS:
            setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name), f"read:{name}"))
        torch.equal = wrap(saved_equal, "read:equal")
        yield counts
    finally:
        for name, fn in saved_dist.items():
            setattr(dist, name, fn)
        for name, original in saved_tensor.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        torch.equal = saved_equal


def _split(counts: Counter) -> tuple[dict[str, int], dict[str, int]]:
    collectives = {k: v for k, v in counts.items() if not k.startswith("read:")}
    reads = {k[5:]: v for k, v in counts.items() if k.startswith("read:")}
    return collectives, reads


def _one_step(m: Any, packed: bool, consistency: bool) -> dict[str, Any]:
    mesh = cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    x, dy = inputs()
    if packed:
        x, dy = x[:1], dy[:1]
    s = x.shape[1] // p
    xl = shard_sequence(x, mesh).clone().requires_grad_(True)
    positions = torch.arange(r * s, (r + 1) * s)
    kw: dict[str, Any] = {"cu_seqlens": torch.tensor([0, 5, x.shape[1]])} if packed else {}
    if packed:  # per-document positions
        positions = torch.tensor([t if t < 5 else t - 5 for t in positions.tolist()])
    kw["position_embeddings"] = rope_tables(m, positions)  # computed outside the counting
    with contextlib.ExitStack() as stack:
        stack.enter_context(consistency_checks(consistency))
        rec = stack.enter_context(record_events())
        with _counting() as fwd:
            out, _ = call(m, "deepseek_interleave", xl, positions, **kw)
        with _counting() as bwd:
            out.backward(shard_sequence(dy, mesh))
    launches = Counter(
        (_RECORDED[e.name.partition(":")[0]], e.phase) for e in rec.events if e.kind == "launch"
    )
    (f_coll, f_reads), (b_coll, _) = _split(fwd), _split(bwd)
    return {
        "forward": f_coll,
        "backward": b_coll,
        "forward_reads": f_reads,
        "recorded_forward": {k: v for (k, ph), v in launches.items() if ph == "forward"},
        "recorded_backward": {k: v for (k, ph), v in launches.items() if ph == "backward"},
        "grad_finite": bool(torch.isfinite(xl.grad).all()),
    }


def rank_counts() -> dict[tuple, dict[str, Any]]:
    mesh = cp_mesh()
    results = {}
    for strategy in ("expanded", "latent"):
        for overlap in (True, False):
            m = parallelize_mla(build("deepseek_interleave"), mesh, strategy=strategy,
                                overlap=overlap)  # fmt: skip
            for packed in (False, True):
                results[(strategy, overlap, packed, False)] = _one_step(m, packed, False)
            if overlap:
                results[(strategy, overlap, False, True)] = _one_step(m, False, True)
    return results


@pytest.mark.timeout(240)
def test_one_forward_issues_only_the_schedules_collectives():
    reports = run_distributed(rank_counts, 2, timeout=200)
    for rank, rep in enumerate(reports):
        assert len(rep) == 10
        for (strategy, overlap, packed, consistency), got in rep.items():
            tag = (rank, strategy, overlap, packed, consistency)
            fwd, bwd = SCHEDULE[strategy]
            # the recorder's launches are the documented schedule ...
            assert got["recorded_forward"] == fwd, tag
            assert got["recorded_backward"] == bwd, tag
            # ... and, consistency off, exactly what torch.distributed was asked to do
            extra = {"all_gather_list": 2} if consistency else {}  # the ranks' comparison
            assert got["forward"] == {**fwd, **extra}, (tag, got["forward"])
            assert got["backward"] == bwd, (tag, got["backward"])
            assert "all_reduce" not in got["forward"], tag  # no per-call agreement step
            if not consistency:
                # no host read for a plain causal call; packed: the table and the fingerprints
                assert got["forward_reads"] == ({"tolist": 2} if packed else {}), (
                    tag,
                    got["forward_reads"],
                )
            assert got["grad_finite"], tag
