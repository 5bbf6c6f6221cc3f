"""parallelize_mla equals the serial MLA block: outputs, input and every parameter gradient."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _cp_testutil import TIMEOUT, build, inputs, rank_parallel_mla, serial_reference

from hyper_parallel.context_parallel import MLAConfig, MultiHeadLatentAttention
from hyper_parallel.dtensor.testing import run_distributed

COMBOS = list(itertools.product(("expanded", "latent"), (True, False), (True, False)))
_CACHE: dict[int, list] = {}


def _parallel_results(world: int) -> list:
    if world not in _CACHE:
        _CACHE[world] = run_distributed(rank_parallel_mla, world, COMBOS, timeout=TIMEOUT)
    return _CACHE[world]


def _naive_mla(m: MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    """Reference twin of the serial block: explicit per-head loops and an explicit softmax."""
    c = m.config
    b, s, _ = x.shape
    q = m.q_proj(x) if c.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
    q = q.view(b, s, c.num_heads, c.qk_head_dim)
    kv_a = m.kv_a_proj_with_mqa(x)
    latent = m.kv_a_layernorm(kv_a[..., : c.kv_lora_rank])
    k_rope = kv_a[..., c.kv_lora_rank :]
    kv = m.kv_b_proj(latent).view(b, s, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    dr = c.qk_rope_head_dim
    pos = torch.arange(s, dtype=torch.float64)
    heads = []
    for h in range(c.num_heads):
        qh_nope, qh_rope = q[:, :, h, : c.qk_nope_head_dim], q[:, :, h, c.qk_nope_head_dim :]
        kh_nope, vh = kv[:, :, h, : c.qk_nope_head_dim], kv[:, :, h, c.qk_nope_head_dim :]

        def rope(t):  # rotate pairs (i, i + dr/2) by pos * theta^(-2i/dr)
            out = torch.empty_like(t)
            for i in range(dr // 2):
                ang = pos * c.rope_theta ** (-2 * i / dr)
                a, bb = t[..., i], t[..., i + dr // 2]
                out[..., i] = a * ang.cos() - bb * ang.sin()
                out[..., i + dr // 2] = bb * ang.cos() + a * ang.sin()
            return out

        qh = torch.cat([qh_nope, rope(qh_rope)], -1)
        kh = torch.cat([kh_nope, rope(k_rope)], -1)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(c.qk_head_dim)
        scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
        heads.append(torch.softmax(scores, -1) @ vh)
    return m.o_proj(torch.cat(heads, -1))


@pytest.mark.parametrize("q_lora", [True, False])
def test_serial_mla_matches_naive_per_head_reference(q_lora):
    m = build(q_lora)
    x, _ = inputs()
    torch.testing.assert_close(m(x), _naive_mla(m, x), rtol=1e-10, atol=1e-10)


def test_serial_mla_is_causal():
    m = build(True)
    x, _ = inputs()
    x2 = x.clone()
    x2[:, 9:] += 1.0
    torch.testing.assert_close(m(x)[:, :9], m(x2)[:, :9], rtol=0, atol=0)
    assert not torch.allclose(m(x)[:, 9:], m(x2)[:, 9:])


def test_mla_config_rejects_bad_values():
    good = dict(hidden_size=8, num_heads=2, q_lora_rank=None, kv_lora_rank=4,
                qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)  # fmt: skip
    MLAConfig(**good)
    for key, bad in [("num_heads", 0), ("qk_rope_head_dim", 3), ("q_lora_rank", 0),
                     ("hidden_size", True), ("rope_theta", -1.0)]:  # fmt: skip
        with pytest.raises(ValueError):
            MLAConfig(**{**good, key: bad})


def test_serial_mla_rejects_wrong_hidden_size():
    with pytest.raises(ValueError, match="hidden_states"):
        build(False)(torch.zeros(1, 4, 7, dtype=torch.float64))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy,overlap,q_lora", COMBOS)
def test_parallel_mla_matches_serial_outputs_and_every_gradient(world, strategy, overlap, q_lora):
    ref = serial_reference(q_lora)
    per_rank = [r[(strategy, overlap, q_lora)] for r in _parallel_results(world)]
    out = torch.cat([r["out"] for r in per_rank], dim=1)
    dx = torch.cat([r["dx"] for r in per_rank], dim=1)
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out, ref["out"], **tol)
    torch.testing.assert_close(dx, ref["dx"], **tol)
    assert set(per_rank[0]["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        summed = sum(r["grads"][name] for r in per_rank)
        torch.testing.assert_close(summed, g, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_parallel_latent_strategy_uses_only_its_rows_of_kv_b_proj():
    per_rank = [r[("latent", True, False)] for r in _parallel_results(2)]
    rows = per_rank[0]["grads"]["kv_b_proj.weight"].shape[0] // 2
    assert torch.count_nonzero(per_rank[0]["grads"]["kv_b_proj.weight"][rows:]) == 0
    assert torch.count_nonzero(per_rank[1]["grads"]["kv_b_proj.weight"][:rows]) == 0
    assert torch.count_nonzero(per_rank[0]["grads"]["kv_b_proj.weight"][:rows]) > 0


def test_parallel_style_composes_with_parallelize_module_and_can_be_undone():
    from _cp_testutil import rank_parallel_style

    results = run_distributed(rank_parallel_style, 2, timeout=TIMEOUT)
    m = build(False)
    x, _ = inputs()
    ref = m(x).detach()
    torch.testing.assert_close(torch.cat([r["out"] for r in results], 1), ref)
    for r in results:
        assert r["was_cp"] and r["undone"]
        torch.testing.assert_close(r["serial_after_undo"], ref, rtol=0, atol=0)


def test_deep_copy_of_a_parallel_block_stays_parallel_on_the_same_mesh():
    from _cp_testutil import rank_deepcopy_parallel

    assert run_distributed(rank_deepcopy_parallel, 2, timeout=TIMEOUT) == [True, True]
