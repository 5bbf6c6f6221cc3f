"""``parallelize_attention`` on the stock Hugging Face grouped-query attention modules
(``Qwen3NextAttention``: gated, q/k norms, partial rotary; ``Qwen3Attention``;
``LlamaAttention``), float64, against the stock serial module (sdpa): the output, the input
gradient and every parameter gradient (summed over ranks), at cp 2 and cp 4 (one spawn each):
2 key/value heads at cp 4 (each kv head replicated to the two ranks whose query heads use it)
and at cp 2, one query head per rank, head groups sharing one kv exchange or each with its
own, heads that do not align with the ranks (6 query / 3 kv heads at cp 2), overlap on and
off, packed documents (each document run alone through the stock module). The bytes of the
key/value exchange are the plan's (recorded), and rejected calls raise on every rank before
any collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.dtensor.testing import run_distributed

HIDDEN, D, SEQ, BATCH = 32, 8, 16, 2
# name -> (family, query heads, key/value heads, attention_bias)
VARIANTS: dict[str, tuple[str, int, int, bool]] = {
    "qwen3next_h8_kv2": ("qwen3_next", 8, 2, False),
    "qwen3next_h4_kv2": ("qwen3_next", 4, 2, True),
    "llama_h8_kv4": ("llama", 8, 4, True),
    "qwen3_h8_kv8": ("qwen3", 8, 8, False),
    "qwen3_h6_kv3": ("qwen3", 6, 3, False),
    "qwen3_h12_kv3": ("qwen3", 12, 3, True),
}
TABLES = ([0, 3, 4, 13, 16], [0, 8, 9, 16])  # inside a block, spanning ranks, length 1
# (variant, overlap, head_groups, table index or None)
CASES = {
    4: [
        ("qwen3next_h8_kv2", True, 1, None),  # kv head j -> ranks 2j, 2j+1 (m = 1)
        ("qwen3next_h8_kv2", True, 2, None),  # 2 groups of 1 query head, one kv exchange
        ("qwen3next_h8_kv2", False, 1, None),
        ("qwen3next_h8_kv2", True, 1, 0),
        ("qwen3next_h8_kv2", False, 1, 1),
        ("qwen3next_h4_kv2", True, 1, None),  # one query head per rank, biases
        ("llama_h8_kv4", True, 2, None),
        ("qwen3_h8_kv8", True, 2, None),  # MHA: one kv exchange per group
        ("qwen3_h12_kv3", True, 1, None),  # ranks need kv {0}, {0, 1}, {1, 2}, {2}: padded
    ],
    2: [
        ("qwen3next_h8_kv2", True, 1, None),  # Hkv = P: plain Ulysses of k, v
        ("qwen3next_h8_kv2", False, 1, None),
        ("qwen3next_h8_kv2", True, 4, 0),
        ("qwen3next_h8_kv2", False, 1, 1),
        ("llama_h8_kv4", True, 2, None),  # 2 groups, each its own kv heads (2 exchanges)
        ("qwen3_h6_kv3", True, 1, None),  # ranks need kv {0, 1} and {1, 2} (m = 2)
        ("qwen3_h6_kv3", False, 1, 0),
    ],
}
RECORDED = ("qwen3next_h8_kv2", True, 1, None)
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _config(family: str, heads: int, kv: int, bias: bool) -> Any:
    from transformers import LlamaConfig, Qwen3Config, Qwen3NextConfig

    sizes = dict(
        hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv, head_dim=D,
        attention_bias=bias, attention_dropout=0.0, vocab_size=50, intermediate_size=16,
        num_hidden_layers=1, attn_implementation="sdpa", max_position_embeddings=64,
    )  # fmt: skip
    if family == "qwen3_next":
        return Qwen3NextConfig(**sizes, partial_rotary_factor=0.5)
    return (Qwen3Config if family == "qwen3" else LlamaConfig)(**sizes)


def _modules(family: str) -> tuple[type, type]:
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as mod

        return mod.Qwen3NextAttention, mod.Qwen3NextRotaryEmbedding
    if family == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as mod3

        return mod3.Qwen3Attention, mod3.Qwen3RotaryEmbedding
    from transformers.models.llama import modeling_llama as modl

    return modl.LlamaAttention, modl.LlamaRotaryEmbedding


def build(variant: str, heads: int | None = None, kv: int | None = None) -> nn.Module:
    family, h, k, bias = VARIANTS[variant]
    cls, _ = _modules(family)
    torch.manual_seed(0)
    m = cls(_config(family, heads or h, kv or k, bias), layer_idx=0).double()
    with torch.no_grad():  # random weights, norms (and biases) included
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3))
    return m


def rope(m: nn.Module, variant: str, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    _, rotary = _modules(VARIANTS[variant][0])
    return rotary(m.config)(torch.zeros(1, dtype=torch.float64), positions[None])


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    return x, torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64, generator=g)


def _positions(offsets: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(b - a) for a, b in zip(offsets, offsets[1:])])


def reference(variant: str, table: int | None) -> dict[str, Any]:
    """The stock serial module on the whole sequence, or on each document alone."""
    m = build(variant)
    x, dy = _data(BATCH if table is None else 1)
    x.requires_grad_(True)
    offsets = [0, SEQ] if table is None else TABLES[table]
    outs = [
        m(x[:, a:b], rope(m, variant, torch.arange(b - a)), None)[0]
        for a, b in zip(offsets, offsets[1:])
    ]
    out = torch.cat(outs, 1)
    out.backward(dy)
    return {
        "out": out.detach(),
        "dx": x.grad,
        "grads": {n: p.grad for n, p in m.named_parameters()},
    }


def _mesh() -> Any:
    from hyper_parallel.dtensor import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


def _rank(cases: list[Any]) -> dict[str, Any]:
    from hyper_parallel.context_parallel import parallelize_attention, record_events

    mesh = _mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    s = SEQ // p
    results = []
    for case in cases:
        variant, overlap, groups, table = case
        m = build(variant)
        params = [id(q) for q in m.parameters()]
        parallelize_attention(m, mesh, overlap=overlap, head_groups=groups)
        x, dy = _data(BATCH if table is None else 1)
        xl = x[:, r * s : (r + 1) * s].clone().requires_grad_(True)
        kw: dict[str, Any] = {}
        if table is None:
            pos = torch.arange(r * s, (r + 1) * s)
        else:
            pos = _positions(TABLES[table])[r * s : (r + 1) * s]
            kw["cu_seqlens"] = torch.tensor(TABLES[table])
        with record_events() as rec:
            out, weights = m(
                hidden_states=xl, position_embeddings=rope(m, variant, pos), attention_mask=None,
                **kw,
            )  # fmt: skip
            out.backward(dy[:, r * s : (r + 1) * s])
        results.append({
            "out": out.detach(), "dx": xl.grad, "weights": weights,
            "grads": {n: q.grad for n, q in m.named_parameters()},
            "launches": [(e.name, e.phase, e.nbytes) for e in rec.events if e.kind == "launch"],
            "same_parameters": params == [id(q) for q in m.parameters()],
        })  # fmt: skip
    return {"results": results, "errors": _errors(mesh)}


def _errors(mesh: Any) -> dict[str, Any]:
    """Every rejected call (type, message) with no collective launched; the module works after."""
    from transformers import DynamicCache

    from hyper_parallel.context_parallel import (
        is_context_parallel,
        parallelize_attention,
        record_events,
        unparallelize_attention,
    )

    p, r = mesh.size(), mesh.get_local_rank()
    s = SEQ // p
    variant = "qwen3next_h8_kv2"
    m = build(variant)
    x, _ = _data(BATCH)
    xl = x[:, r * s : (r + 1) * s]
    pos = torch.arange(r * s, (r + 1) * s)
    tables = rope(m, variant, pos)
    neg = torch.finfo(torch.float64).min
    padded = torch.zeros(BATCH, 1, s, s, dtype=torch.float64).masked_fill(
        ~torch.ones(s, s, dtype=torch.bool).tril(), neg
    )
    padded[1, :, :, 0] = neg  # a left-padded second row: not plain causal
    odd = build("qwen3_h6_kv3", heads=p + 1, kv=1)  # p + 1 query heads: not divisible by P
    sliding = build("qwen3_h8_kv8")
    sliding.sliding_window = 4

    def call(**kw: Any) -> Any:
        kw.setdefault("position_embeddings", tables)
        kw.setdefault("attention_mask", None)
        return lambda: m(hidden_states=xl, **kw)

    report: dict[str, Any] = {}
    with record_events() as rec:
        report["wrong_class"] = _outcome(lambda: parallelize_attention(nn.Linear(2, 2), mesh))
        report["heads_not_divisible"] = _outcome(lambda: parallelize_attention(odd, mesh))
        report["sliding_window"] = _outcome(lambda: parallelize_attention(sliding, mesh))
        report["untouched"] = not is_context_parallel(odd) and not is_context_parallel(sliding)
        parallelize_attention(m, mesh)
        report["double"] = _outcome(lambda: parallelize_attention(m, mesh))
        report["mask"] = _outcome(call(attention_mask=padded))
        report["cache"] = _outcome(call(past_key_values=DynamicCache(config=m.config)))
        report["rope_width"] = _outcome(
            call(position_embeddings=tuple(t.repeat(1, 1, 2) for t in tables))
        )
        report["packed_batch"] = _outcome(call(cu_seqlens=torch.tensor([0, 5, SEQ])))
        report["launches"] = [e.name for e in rec.events if e.kind == "launch"]
    report["works_after"] = tuple(m(xl, tables, None)[0].shape)
    unparallelize_attention(m)
    report["undone"] = type(m).__name__ == "Qwen3NextAttention"
    return report


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("no error", "")
    except Exception as e:
        return (type(e).__name__, str(e))


EXPECTED_ERRORS = {
    "wrong_class": ("TypeError", "Qwen3NextAttention, Qwen3Attention, LlamaAttention"),
    "heads_not_divisible": ("ValueError", "num_attention_heads"),
    "sliding_window": ("ValueError", "sliding"),
    "double": ("RuntimeError", "already"),
    "mask": ("ValueError", "attention_mask"),
    "cache": ("ValueError", "past_key_values"),
    "rope_width": ("ValueError", "position_embeddings"),
    "packed_batch": ("ValueError", "batch"),
}


def test_kv_plan_sends_each_rank_the_kv_heads_its_query_heads_use() -> None:
    from hyper_parallel.context_parallel.gqa import kv_plan

    # 2 kv heads at cp 4: kv head j goes to ranks 2j and 2j + 1, one slot each
    plans = [kv_plan(8, 2, 4, 1, r) for r in range(4)]
    assert {p.send for p in plans} == {((0, 0, 1, 1),)}
    assert [p.local for p in plans] == [((0, 0),)] * 4
    # Hkv = P: plain Ulysses (no reordering); 2 groups of 1 query head share one exchange
    assert kv_plan(8, 2, 2, 1, 0).send == ((0, 1),)
    assert kv_plan(8, 2, 4, 2, 1).send == ((0, 0, 1, 1),) and kv_plan(8, 2, 4, 2, 1).exchanges == 1
    # groups that use their own kv heads: one exchange each, the same heads in all
    grouped = kv_plan(8, 4, 2, 2, 1)
    assert grouped.exchanges == 2 and grouped.send == ((0, 2), (1, 3))
    assert grouped.local == ((0, 0), (0, 0))
    # heads not aligned with ranks: m = 2, ranks needing one head get it twice (padding)
    ragged = kv_plan(12, 3, 4, 1, 1)
    assert ragged.send == ((0, 0, 0, 1, 1, 2, 2, 2),)
    assert ragged.local == ((0, 1, 1),)  # query heads 3, 4, 5 use kv 0, 1, 1


def _kv_bytes(world: int) -> int:
    """Bytes each rank receives in the forward's key/value all-to-all of RECORDED at cp
    ``world``: its block of the m = 1 head it needs from each of the P - 1 peers."""
    kv = VARIANTS[RECORDED[0]][2]
    m = max(1, kv // world)
    return (world - 1) * BATCH * (SEQ // world) * m * 2 * D * 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_stock_gqa_context_parallel_equals_serial_with_every_gradient(world: int) -> None:
    ranks = run_distributed(_rank, world, CASES[world], timeout=240)
    refs: dict[tuple[str, int | None], dict[str, Any]] = {}
    tol = {"rtol": 1e-10, "atol": 1e-10}
    for i, case in enumerate(CASES[world]):
        variant, _, _, table = case
        ref = refs.setdefault((variant, table), reference(variant, table))
        got = [res["results"][i] for res in ranks]
        tag = (world, *case)
        torch.testing.assert_close(torch.cat([g["out"] for g in got], 1), ref["out"], **tol)
        torch.testing.assert_close(torch.cat([g["dx"] for g in got], 1), ref["dx"], **tol)
        for name, want in ref["grads"].items():
            summed = sum(g["grads"][name] for g in got)
            # Qwen3NextRMSNorm computes in float32 (x.float()) also for float64 input: its
            # weight's gradient is a float32 sum over tokens, which the ranks split
            close = F32_TOL if "norm" in name and variant.startswith("qwen3next") else tol
            torch.testing.assert_close(
                summed, want, **close, msg=lambda msg, n=name, t=tag: f"{t} {n}: {msg}"
            )
        assert all(g["weights"] is None and g["same_parameters"] for g in got), tag
        if case == RECORDED:  # 3 exchanges a forward; the kv one carries the plan's bytes
            fwd = [(n, b) for n, ph, b in got[0]["launches"] if ph == "forward"]
            assert [n for n, _ in fwd] == ["a2a:kv", "a2a:q", "a2a:o"], fwd
            assert dict(fwd)["a2a:kv"] == _kv_bytes(world), fwd
            bwd = sorted(n for n, ph, _ in got[0]["launches"] if ph == "backward")
            assert bwd == ["a2a:dkv", "a2a:do", "a2a:dq"], bwd
    # packed documents change the answer
    assert not torch.allclose(
        refs[("qwen3next_h8_kv2", 0)]["out"], reference("qwen3next_h8_kv2", None)["out"][:1]
    )
    for rank, res in enumerate(ranks):
        rep = res["errors"]
        for case, (exc, fragment) in EXPECTED_ERRORS.items():
            got_exc, msg = rep[case]
            assert got_exc == exc and fragment in msg, (rank, case, got_exc, msg)
        assert rep["launches"] == [], (rank, rep["launches"])
        assert rep["untouched"] and rep["undone"], rank
        assert rep["works_after"] == (BATCH, SEQ // world, HIDDEN)
    for case in EXPECTED_ERRORS:  # the same error text on every rank
        assert len({res["errors"][case] for res in ranks}) == 1, case
