"""``parallelize_mla`` given hp-dtensor's sequence context (``sequence_context=``), and ranks
given different packed-document tables with consistency mode off, on the stock Hugging Face
``KimiLinearAttention`` and ``DeepseekV3Attention``, 2 and 4 gloo ranks, float64, both
strategies, overlap on and off.

- Given a context (checked by the caller, or not), the output and every gradient equal the same
  call given ``cu_seqlens`` (to rounding); a checked context reads nothing back to the host
  (no ``tolist``/``item`` in the forward); neither adds a collective (an unchecked context's
  fingerprint rides on the first exchange).
- Different tables on different ranks, consistency mode off: given as ``cu_seqlens`` or as
  unchecked contexts, every rank raises the same ``SequenceMismatchError``, and the layer
  works again afterwards (nothing leaked).
- A context given with a table, or with blocks of different lengths: ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_hf import HIDDEN, build, call, cp_mesh, rope_tables
from torch.overrides import TorchFunctionMode

from hyper_parallel.context_parallel import parallelize_mla, record_events
from hyper_parallel.dtensor import gather_sequence_context, sequence_context
from hyper_parallel.dtensor.testing import run_distributed

SEQ = 16
TABLE = [0, 1, 3, 12, 13, 16]
CASES = [  # (variant, strategy, overlap)
    ("kimi_qlora", "expanded", True),
    ("kimi_qlora", "latent", True),
    ("deepseek_interleave", "latent", False),
    ("deepseek_interleave", "expanded", False),
]


class _Reads(TorchFunctionMode):
    """Counts the calls that read a tensor's values to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("tolist", "item", "__bool__", "__int__"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _positions(offsets: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(b - a) for a, b in zip(offsets, offsets[1:])])


def _caught(fn: Any) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors(
    m: Any, variant: str, x: torch.Tensor, pos: torch.Tensor, extra: dict, checked: Any
) -> dict[str, Any]:
    """Different tables on different ranks, and bad contexts."""
    mesh, table = checked.group, torch.tensor(TABLE)
    p, r, s = checked.size, checked.rank, checked.length

    def run(**kw: Any) -> str:
        return _caught(lambda: call(m, variant, x, pos, **kw, **extra))

    mine = torch.tensor(TABLE if r else [0, 5, SEQ])
    uneven = sequence_context(mesh, [s + 1] + [s] * (p - 2) + [s - 1])
    return {
        "mismatch_table": run(cu_seqlens=mine),
        "mismatch_context": run(sequence_context=sequence_context(mesh, s, cu_seqlens=mine)),
        "after": run(cu_seqlens=table),  # nothing leaked: the layer works again
        "both": run(cu_seqlens=table, sequence_context=checked),
        "uneven": run(sequence_context=uneven),
    }


def _rank() -> list[dict[str, Any]]:
    mesh = cp_mesh()
    p, r = mesh.size(), dist.get_rank()
    s = SEQ // p
    g = torch.Generator().manual_seed(5)
    x_full = torch.randn(1, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    dy = torch.randn(1, s * p, HIDDEN, dtype=torch.float64, generator=g)[:, r * s : (r + 1) * s]
    table = torch.tensor(TABLE)
    out = []
    for variant, strategy, overlap in CASES:
        m = build(variant)
        parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
        pos = _positions(TABLE)[r * s : (r + 1) * s]
        extra = {}
        if variant.startswith("deepseek"):
            extra["position_embeddings"] = rope_tables(m, pos)
        runs = {}
        checked = gather_sequence_context(mesh, s, cu_seqlens=table)
        for how in ("table", "checked", "unchecked"):
            kw: dict[str, Any] = dict(extra)
            if how == "table":
                kw["cu_seqlens"] = table
            elif how == "checked":
                kw["sequence_context"] = checked
            else:
                kw["sequence_context"] = sequence_context(mesh, s, cu_seqlens=table)
            m.zero_grad()
            xl = x_full[:, r * s : (r + 1) * s].clone().requires_grad_()
            reads = _Reads()
            with record_events() as rec:
                with reads:
                    y, _ = call(m, variant, xl, pos, **kw)
                y.backward(dy)
            runs[how] = {
                "out": y.detach(), "dx": xl.grad,
                "grads": {n: q.grad for n, q in m.named_parameters()},
                "launches": rec.names("launch"), "reads": reads.n,
                "checked": not kw.get("sequence_context", checked).needs_check,
            }  # fmt: skip
        res = _errors(m, variant, x_full[:, r * s : (r + 1) * s], pos, extra, checked)
        res["runs"] = runs
        out.append(res)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_mla_given_a_sequence_context(world: int) -> None:
    ranks = run_distributed(_rank, world, timeout=500)
    tol = {"rtol": 1e-12, "atol": 1e-12}
    for i, case in enumerate(CASES):
        for r, res in enumerate(ranks):
            runs = res[i]["runs"]
            want = runs["table"]
            for how in ("checked", "unchecked"):
                got = runs[how]
                torch.testing.assert_close(got["out"], want["out"], **tol)
                torch.testing.assert_close(got["dx"], want["dx"], **tol)
                for name, grad in want["grads"].items():
                    if grad is not None:
                        torch.testing.assert_close(got["grads"][name], grad, **tol)
                assert got["launches"] == want["launches"], (case, how)  # no extra collective
                assert got["checked"], (case, how)
            assert want["reads"] >= 1 and runs["checked"]["reads"] == 0, (case, r)
            assert res[i]["after"] == "no error"
            assert "not both" in res[i]["both"]
            assert "equal blocks" in res[i]["uneven"] or "describes block" in res[i]["uneven"]
        for key in ("mismatch_table", "mismatch_context"):
            messages = {res[i][key] for res in ranks}
            assert len(messages) == 1, (case, key, messages)  # the same error on every rank
            (message,) = messages
            assert message.startswith("SequenceMismatchError: "), message
            assert "ranks [0]: table fingerprint" in message
