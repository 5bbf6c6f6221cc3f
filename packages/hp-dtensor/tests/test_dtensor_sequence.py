"""The sequence context (``hyper_parallel.dtensor.sequence``) and its fingerprint checks
(``hyper_parallel.dtensor.fingerprint``).

Local: the one table validator's verdicts, the fingerprint, the summed-words check (equal
words pass, any group with a differing rank fails, whatever the other groups hold). On 2 and
4 gloo ranks: a context built from known lengths (offsets, total, document starts and resets
on the table's device, no communication), one gathered from uneven lengths (one all-gather,
checked; a table whose end is not the gathered total raises on every rank), ranks given
different tables raising the same ``SequenceMismatchError`` on every rank through each way of
comparing (the gather, ``verify``, an all-gather and an all-to-all exchange carrying the
fingerprint), a checked context comparing nothing again, and the fingerprint-carrying exchange
giving the unwrapped exchange's result and input gradient bit for bit through hp-dtensor's
node pair."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import (
    SequenceMismatchError,
    check_documents,
    comm,
    gather_sequence_context,
    init_device_mesh,
    overlap,
    sequence_context,
)
from hyper_parallel.dtensor.fingerprint import (
    SLOTS_PER_GROUP,
    check_summed,
    summed_slots,
    table_fingerprint,
)
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed

TABLE = [0, 3, 4, 8, 9, 16]


def test_check_documents() -> None:
    assert check_documents(torch.tensor(TABLE), total=16, batch=1) == tuple(TABLE)
    cases = {
        "start at 0": torch.tensor([1, 3, 16]),
        "strictly increasing": torch.tensor([0, 5, 3, 16]),
        "integer tensor": torch.tensor([0.0, 16.0]),
        "end at the sequence length T=16, got 15": torch.tensor([0, 3, 15]),
        "1-D tensor": torch.tensor([[0, 16]]),
    }
    for message, table in cases.items():
        with pytest.raises(ValueError, match=message):
            check_documents(table, total=16)
    with pytest.raises(ValueError, match="batch size 1"):
        check_documents(torch.tensor(TABLE), batch=2)
    with pytest.raises(ValueError, match="cu_seq_lens_q must start at 0"):
        check_documents(torch.tensor([2, 16]), what="cu_seq_lens_q")


def test_fingerprint() -> None:
    fp = table_fingerprint(TABLE)
    assert fp == table_fingerprint(list(TABLE)) and fp != 0
    assert table_fingerprint(None) == 0
    assert fp != table_fingerprint([0, 3, 4, 8, 10, 16])
    assert -(2**63) <= fp < 2**63


def _sums(held: list[tuple[int, int]], groups: int) -> list[int]:
    """The all-reduced vector of ranks holding ``(group, fingerprint)``."""
    v = [0] * (groups * SLOTS_PER_GROUP)
    for group, fp in held:
        for i, x in summed_slots(fp, group, groups):
            v[i] += x
    return v


def test_summed_words() -> None:
    a, b = table_fingerprint(TABLE), table_fingerprint([0, 16])
    check_summed(_sums([(0, a)] * 4 + [(1, b)] * 4, 2), 4, "x")  # groups may differ
    check_summed(_sums([(0, 0)] * 4, 1), 4, "x")  # no tables
    for held in ([(0, a)] * 3 + [(0, b)], [(0, a)] * 4 + [(1, b)] * 3 + [(1, 0)]):
        with pytest.raises(SequenceMismatchError, match="sequence group"):
            check_summed(_sums(held, 2), 4, "x")


# ---- distributed ---------------------------------------------------------------------------
class _Gather:
    """All-gather along dim 1; its gradient the reduce-scatter."""

    def __init__(self, g: comm.Group) -> None:
        self.g = g
        self.work: comm.Work | None = None

    def start(self, x: torch.Tensor) -> None:
        self.work = comm.start_all_gather(x, 1, self.g, "all_gather:t", "forward", "test")

    def finish(self) -> torch.Tensor:
        assert self.work is not None
        return self.work.wait()

    def start_grad(self, grad: torch.Tensor) -> None:
        self.work = comm.start_reduce_scatter(grad, 1, self.g, "rs:t", "backward", "test")

    def finish_grad(self) -> torch.Tensor:
        assert self.work is not None
        return self.work.wait()


class _SeqToHead(_Gather):
    """``[B, S/P, H, d] -> [B, S, H/P, d]``; its gradient the inverse all-to-all."""

    def start(self, x: torch.Tensor) -> None:
        self.work = comm.start_all_to_all(x, 2, 1, self.g, "a2a:t", "forward", "test")

    def start_grad(self, grad: torch.Tensor) -> None:
        self.work = comm.start_all_to_all(grad, 1, 2, self.g, "a2a:dt", "backward", "test")


def _caught(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _through(ex: Any, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    token = overlap.launch(ex, x)
    y = overlap.wait(ex, token)
    (y * dy).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


def _distributed() -> dict[str, Any]:
    P, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    g = comm.resolve_group(mesh)
    res: dict[str, Any] = {}
    table = torch.tensor(TABLE)
    # known, equal lengths: no communication
    with record_events() as rec:
        ctx = sequence_context(mesh, 16 // P, cu_seqlens=table, batch=1)
    res["local_launches"] = rec.names("launch")
    res["layout"] = (ctx.start, ctx.length, ctx.total, ctx.offsets, ctx.needs_check)
    res["starts"] = ctx.document_starts().tolist()
    res["resets"] = ctx.document_resets().tolist()
    # gathered, uneven lengths (rank r holds 2r + 2 rows of a 2 + 4 + ... sequence)
    lengths = [2 * i + 2 for i in range(P)]
    total = sum(lengths)
    uneven = torch.tensor([0, 1, total - 1, total])
    with record_events() as rec:
        gctx = gather_sequence_context(mesh, lengths[r], cu_seqlens=uneven)
    res["gathered"] = (gctx.lengths, gctx.start, gctx.needs_check, rec.names("launch"))
    res["gathered_end"] = _caught(
        lambda: gather_sequence_context(mesh, lengths[r], cu_seqlens=torch.tensor([0, 3]))
    )
    # different tables: every way of comparing raises on every rank
    mine = torch.tensor(TABLE if r else [0, 5, 16])
    res["mismatch_gather"] = _caught(
        lambda: gather_sequence_context(mesh, 16 // P, cu_seqlens=mine)
    )
    bad = sequence_context(mesh, 16 // P, cu_seqlens=mine)
    res["mismatch_verify"] = _caught(lambda: bad.verify("cpu", "verify"))
    # verify of an agreeing context: one gather, then nothing
    with record_events() as rec:
        ctx.verify("cpu", "verify")
        ctx.verify("cpu", "verify")
    res["verify_launches"] = (rec.names("launch"), ctx.needs_check)
    # exchanges carrying the fingerprint: bit for bit the unwrapped ones'
    gen = torch.Generator().manual_seed(r)
    for name, ex_cls, shape in (("ag", _Gather, (1, 4, 6)), ("a2a", _SeqToHead, (1, 4, P, 4))):
        x = torch.randn(*shape, dtype=torch.float64, generator=gen)
        out_shape = list(shape)
        out_shape[1] *= P
        if name == "a2a":
            out_shape[2] //= P
        dy = torch.randn(*out_shape, dtype=torch.float64, generator=gen)
        plain = _through(ex_cls(g), x, dy)
        c = sequence_context(mesh, 4, cu_seqlens=torch.tensor([0, 1, 4 * P]))
        wrapped = c.fingerprinted(ex_cls(g), dim=1)
        folded = _through(wrapped, x, dy)
        res[f"{name}_bitwise"] = all(torch.equal(a, b) for a, b in zip(plain, folded))
        res[f"{name}_received"] = len(set(wrapped.received())) == 1
        c.check(wrapped.received(), name)
        res[f"{name}_checked"] = not c.needs_check
        for dtype in (torch.bfloat16, torch.float32):
            xb = x.to(dtype)
            w = sequence_context(mesh, 16 // P, cu_seqlens=mine).fingerprinted(ex_cls(g))
            w.start(xb)
            w.finish()
            got = w.received()
            res[f"{name}_mismatch_{dtype}"] = _caught(lambda got=got: bad.check(got, "exchange"))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_context_distributed(world: int) -> None:
    res = run_distributed(_distributed, world, timeout=240)
    s = 16 // world
    for r, got in enumerate(res):
        assert got["local_launches"] == []
        assert got["layout"] == (r * s, s, 16, tuple(TABLE), True)
        pos = range(r * s, (r + 1) * s)
        starts = [max(o for o in TABLE[:-1] if o <= p) for p in pos]
        assert got["starts"] == starts
        assert got["resets"] == [[float(p == st and p > 0) for p, st in zip(pos, starts)]]
        lengths = tuple(2 * i + 2 for i in range(world))
        assert got["gathered"] == (lengths, sum(lengths[:r]), False, ["all_gather:block_lengths"])
        assert f"must end at the sequence length T={sum(lengths)}" in got["gathered_end"]
        assert got["verify_launches"] == (["all_gather:sequence_fingerprint"], False)
        for name in ("ag", "a2a"):
            assert got[f"{name}_bitwise"] and got[f"{name}_received"] and got[f"{name}_checked"]
    for key in ("mismatch_gather", "mismatch_verify", "ag_mismatch_torch.bfloat16",
                "ag_mismatch_torch.float32", "a2a_mismatch_torch.bfloat16",
                "a2a_mismatch_torch.float32"):  # fmt: skip
        messages = {got[key] for got in res}
        assert len(messages) == 1, (key, messages)  # the same error on every rank
        (message,) = messages
        assert message.startswith("SequenceMismatchError: "), message
        assert "ranks [0]: table fingerprint" in message and "different" in message
