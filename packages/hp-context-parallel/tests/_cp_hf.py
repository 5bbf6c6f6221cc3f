"""Stock Hugging Face MLA modules (tiny random configs, float64) for the hp-context-parallel
tests: builders, the serial reference on the full sequence, and the rank functions."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from hyper_parallel.context_parallel import parallelize_mla, record_events, shard_sequence
from hyper_parallel.dtensor import flatten, init_device_mesh

BATCH, SEQ, HIDDEN = 2, 16, 24
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
# name -> (family, q_lora_rank, rope_interleave, yarn, attention_bias)
VARIANTS: dict[str, tuple[str, int | None, bool, bool, bool]] = {
    "deepseek_interleave": ("deepseek", None, True, False, False),
    "deepseek_rotate_half_yarn_qlora": ("deepseek", 12, False, True, True),
    "deepseek_interleave_yarn_qlora": ("deepseek", 12, True, True, False),
    "kimi": ("kimi", None, False, False, False),
    "kimi_qlora": ("kimi", 12, False, False, True),
}
COMBOS = list(itertools.product(VARIANTS, ("expanded", "latent"), (True, False)))
RECORDED = "deepseek_interleave_yarn_qlora"


def _sizes(heads: int, q_lora: int | None, bias: bool) -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        attention_bias=bias,
        attention_dropout=0.0,
        max_position_embeddings=64,
        vocab_size=50,
        intermediate_size=32,
    )


def config(variant: str, heads: int = 4, layers: int = 1, attn: str = "sdpa") -> Any:
    family, q_lora, interleave, yarn, bias = VARIANTS[variant]
    sizes = _sizes(heads, q_lora, bias)
    if family == "deepseek":
        cfg = DeepseekV3Config(
            **sizes,
            num_hidden_layers=layers,
            first_k_dense_replace=layers,  # dense MLPs only
            moe_intermediate_size=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            rope_interleave=interleave,
            rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 1e4},
            attn_implementation=attn,
        )
    else:
        cfg = KimiLinearConfig(
            **sizes,
            num_hidden_layers=layers,
            layer_types=["full_attention"] * layers,
            mlp_layer_types=["dense"] * layers,
            attn_implementation=attn,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
    return cfg


def build(variant: str, heads: int = 4, seed: int = 0) -> nn.Module:
    """The stock attention module, float64, random weights (norm weights perturbed too)."""
    cfg = config(variant, heads)
    cls = DeepseekV3Attention if VARIANTS[variant][0] == "deepseek" else KimiLinearAttention
    torch.manual_seed(seed)
    m = cls(cfg, layer_idx=0).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "layernorm" in name else 0.3))
            if "layernorm" in name:
                p.add_(1.0)
    return m


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    dy = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    return x, dy


def rope_tables(m: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary embedding at the given (global) positions: ``[1, L, dr]``."""
    rotary = DeepseekV3RotaryEmbedding(m.config)
    return rotary(torch.zeros(1, dtype=torch.float64), positions[None])


def call(m: nn.Module, variant: str, x: torch.Tensor, positions: torch.Tensor, **kw: Any) -> Any:
    """Call ``m`` the way its decoder layer does (keyword arguments)."""
    if VARIANTS[variant][0] == "deepseek":
        kw.setdefault("position_embeddings", rope_tables(m, positions))
    kw.setdefault("attention_mask", None)
    return m(hidden_states=x, **kw)


def _run(m: nn.Module, variant: str, x: torch.Tensor, dy: torch.Tensor, positions) -> dict:
    x = x.clone().requires_grad_(True)
    out, weights = call(m, variant, x, positions, position_ids=positions[None])
    out.backward(dy)
    return {
        "out": out.detach(),
        "weights": weights,
        "dx": x.grad,
        "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
    }


def serial_reference(variant: str) -> dict[str, Any]:
    x, dy = inputs()
    return _run(build(variant), variant, x, dy, torch.arange(SEQ))


def cp_mesh() -> Any:
    """World 4: the 1-D mesh flattened from a (cp=2, tp=2) mesh; otherwise a plain 1-D mesh."""
    ws = dist.get_world_size()
    if ws == 4:
        return flatten(init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp")))
    return init_device_mesh("cpu", (ws,), mesh_dim_names=("cp",))


def rank_parallel(combos: list[tuple[str, str, bool]]) -> dict[tuple, dict[str, Any]]:
    """On every rank: each (variant, strategy, overlap) context-parallel, forward + backward."""
    mesh = cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    results = {}
    for variant, strategy, overlap in combos:
        m = build(variant)
        params = [id(q) for q in m.parameters()]
        parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
        x, dy = inputs()
        block = torch.arange(r * SEQ // p, (r + 1) * SEQ // p)
        args = (m, variant, shard_sequence(x, mesh), shard_sequence(dy, mesh), block)
        if variant == RECORDED and overlap:  # the schedule of a stock module, as recorded
            with record_events() as rec:
                res = _run(*args)
            res["events"] = [(e.kind, e.name, e.phase) for e in rec.events]
        else:
            res = _run(*args)
        res["same_parameters"] = params == [id(q) for q in m.parameters()]
        results[(variant, strategy, overlap)] = res
    return results


# ---- whole models: what a model-level package does ------------------------------------------
MODEL_VARIANTS = ("deepseek_interleave", "kimi_qlora")


def build_model(variant: str, attn: str, seed: int = 0) -> nn.Module:
    """A 2-layer stock base model (dense MLPs, MLA layers only), float64."""
    from transformers import DeepseekV3Model, KimiLinearModel

    cfg = config(variant, layers=2, attn=attn)
    cls = DeepseekV3Model if VARIANTS[variant][0] == "deepseek" else KimiLinearModel
    torch.manual_seed(seed)
    model = cls(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def model_ids(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=g)
    dy = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=g)
    return ids, dy


def _run_model(model: nn.Module, ids, dy, positions) -> dict[str, Any]:
    out = model(input_ids=ids, position_ids=positions[None], use_cache=False).last_hidden_state
    out.backward(dy)
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def serial_model_reference(variant: str) -> dict[str, Any]:
    ids, dy = model_ids()
    return _run_model(build_model(variant, "sdpa"), ids, dy, torch.arange(SEQ))


def rank_models(cases: list[tuple[str, str, str]]) -> dict[tuple, dict[str, Any]]:
    """Each (variant, attn_implementation, strategy): parallelize every layer's self_attn,
    call the model on this rank's block of input_ids with the global position_ids (the model
    builds its own RoPE tables and causal mask from them); record the mask the attention got."""
    mesh = cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    results = {}
    for variant, attn, strategy in cases:
        model = build_model(variant, attn)
        masks: list[Any] = []
        for layer in model.layers:
            parallelize_mla(layer.self_attn, mesh, strategy=strategy)
            layer.self_attn.register_forward_pre_hook(
                lambda mod, args, kwargs, seen=masks: seen.append(kwargs.get("attention_mask")),
                with_kwargs=True,
            )
        ids, dy = model_ids()
        block = torch.arange(r * SEQ // p, (r + 1) * SEQ // p)
        res = _run_model(model, shard_sequence(ids, mesh), shard_sequence(dy, mesh), block)
        m0 = masks[0]
        res["mask"] = None if m0 is None else (tuple(m0.shape), str(m0.dtype))
        results[(variant, attn, strategy)] = res
    return results


# ---- rejected calls -------------------------------------------------------------------------
def rank_hf_errors() -> dict[str, Any]:
    """Every rejected input of a stock module, on every rank (type, message), with no
    collective launched: those each rank rejects on its own (consistency mode off), then the
    asymmetric ones, in consistency mode; accepted masks; then the module still works and can
    be undone."""
    from transformers import DynamicCache

    from hyper_parallel.context_parallel import (
        pending_collectives,
        record_events,
        unparallelize_mla,
    )
    from hyper_parallel.dtensor import consistency_checks

    mesh = cp_mesh()
    p, r = mesh.size(), mesh.get_local_rank()
    sl = SEQ // p
    variant = "deepseek_rotate_half_yarn_qlora"
    m = build(variant)
    params, keys = [id(q) for q in m.parameters()], list(m.state_dict())
    x, _ = inputs()
    xl = shard_sequence(x, mesh)
    block = torch.arange(r * sl, (r + 1) * sl)
    causal = torch.ones(sl, sl).tril().bool()
    neg = torch.finfo(torch.float64).min
    additive = torch.zeros(BATCH, 1, sl, sl, dtype=torch.float64).masked_fill(~causal, neg)
    padded = additive.clone()
    padded[1, :, :, 0] = neg  # the second sequence is left-padded: not plain causal
    global_rows = (torch.arange(SEQ)[None, :] <= block[:, None])[None, None]  # [1,1,Sl,S]

    def run(**kw: Any) -> Any:
        return lambda: call(m, variant, xl, block, **kw)

    def model_with_default_cache() -> Any:
        model = build_model(variant, "sdpa")
        for layer in model.layers:
            parallelize_mla(layer.self_attn, mesh)
        ids, _ = model_ids()
        return model(input_ids=shard_sequence(ids, mesh), position_ids=block[None])

    cases: dict[str, Any] = {
        "unknown_family": lambda: parallelize_mla(nn.Linear(2, 2), mesh),
        "heads_not_divisible": lambda: parallelize_mla(build(variant, heads=3), mesh),
    }
    report: dict[str, Any] = {}
    with record_events() as rec:
        for name, fn in cases.items():
            report[name] = _outcome(fn)
        parallelize_mla(m, mesh, strategy="latent")
        calls = {
            "past_key_values": run(past_key_values=DynamicCache(config=m.config)),
            "model_default_use_cache": model_with_default_cache,
            "padding_mask": run(attention_mask=padded),
            "bool_mask_not_causal": run(attention_mask=torch.ones(1, 1, sl, sl, dtype=torch.bool)),
            "mask_2d": run(attention_mask=torch.ones(BATCH, sl)),
            "hidden_width": lambda: call(m, variant, xl[..., :-1], block),
            "rope_of_full_sequence": run(position_embeddings=rope_tables(m, torch.arange(SEQ))),
            "packed": run(cu_seq_lens_q=torch.tensor([0, sl])),
            "packed_batch": run(cu_seqlens=torch.tensor([0, 5, SEQ])),
            "packed_order": run(cu_seqlens=torch.tensor([0, 5, 5, SEQ])),
            "packed_start": run(cu_seqlens=torch.tensor([1, SEQ])),
        }
        with consistency_checks(False):  # rejected by each rank alone, no communication
            for name, fn in calls.items():
                report[name] = _outcome(fn)
            m.train()
            m.attention_dropout = 0.1
            report["dropout_in_training"] = _outcome(run())
            m.attention_dropout = 0.0
        # asymmetric inputs: no rank can see them alone (off, they would hang or, for tables,
        # compute wrong attention); consistency mode compares the calls and verdicts
        asymmetric = {
            "mask_on_one_rank": run(attention_mask=padded if r == 1 else additive),
            "packed_tables_differ": lambda: call(
                m, variant, xl[:1], block, cu_seqlens=torch.tensor([0, 5 + r, SEQ])
            ),
            "blocks_differ": lambda: call(m, variant, xl[:, : sl - r], block[: sl - r]),
            "leak_on_one_rank": lambda: (_leak() if r == 1 else None, run()()),
        }
        with consistency_checks():
            for name, fn in asymmetric.items():
                report[name] = _outcome(fn)
        report["pending_after"] = pending_collectives()
        launches = [e.name for e in rec.events if e.kind == "launch"]
        report["launches_during_errors"] = [n for n in launches if n != "a2a:stale"]

    plain = call(m, variant, xl, block)[0].detach()
    report["accepted_masks_agree"] = all(
        torch.equal(call(m, variant, xl, block, attention_mask=mask)[0].detach(), plain)
        for mask in (additive, causal[None, None], global_rows)
    )
    report["output"] = plain
    unparallelize_mla(m)
    report["undone"] = (
        type(m) is DeepseekV3Attention
        and [id(q) for q in m.parameters()] == params
        and list(m.state_dict()) == keys
    )
    report["serial_after_undo"] = call(m, variant, x, torch.arange(SEQ))[0].detach()
    return report


def _leak() -> None:
    """A collective of a context-parallel block left pending on this rank only (a size-1
    group: registered, nothing sent), as an exception between launch and wait leaves one."""
    from hyper_parallel.context_parallel.transport import BLOCK_OWNER, Group, start_all_to_all

    one = Group(None, 1, 0)
    start_all_to_all(torch.zeros(1, 2, 2), 1, 2, one, "a2a:stale", "forward", BLOCK_OWNER)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("no error", "")
    except Exception as e:
        return (type(e).__name__, str(e))
