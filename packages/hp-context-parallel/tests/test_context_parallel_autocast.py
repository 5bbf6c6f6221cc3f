"""A context-parallel stock MLA block (``DeepseekV3Attention`` with q LoRA and YaRN,
``KimiLinearAttention``) under ``torch.autocast`` (bf16, fp16, CPU, float32 weights), both
strategies, overlap on: the exchanges carry what the serial module computes in, so the output
and every gradient have the serial module's dtypes, the output lands within 0.1 of the serial
module's own low-precision spread (``‖serial under autocast − serial in float32‖``: every rank
rounds where the serial module does) and the gradients within 2x (each rank's parameter
gradient is its own tokens' share, rounded in the low precision before the shares are summed:
rounding of the order of the spread itself). Backward is also run inside the autocast region.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _cp_hf import SEQ, VARIANTS, build, inputs
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from hyper_parallel.context_parallel import parallelize_mla, shard_sequence
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed

FORWARD_FRACTION, GRAD_FRACTION = 0.1, 2.0
CASES = [
    ("deepseek_rotate_half_yarn_qlora", "latent", torch.bfloat16, False),
    ("deepseek_interleave", "expanded", torch.float16, True),
    ("kimi", "latent", torch.bfloat16, True),
]


def _run(m: Any, variant: str, x: Any, dy: Any, positions: Any, amp: Any, inside: bool) -> dict:
    x = x.clone().requires_grad_()
    kw: dict[str, Any] = {"attention_mask": None, "position_ids": positions[None]}
    if VARIANTS[variant][0] == "deepseek":  # the model's rotary tables, in its float32
        rotary = DeepseekV3RotaryEmbedding(m.config)
        kw["position_embeddings"] = rotary(torch.zeros(1), positions[None])
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        y, _ = m(hidden_states=x, **kw)
        if inside:
            y.backward(dy.to(y.dtype))
    if not inside:
        y.backward(dy.to(y.dtype))
    return {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


def _cases() -> list[list[str]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    p, r = mesh.size(), mesh.get_local_rank()
    X, dY = (t.float() for t in inputs())
    block = torch.arange(r * SEQ // p, (r + 1) * SEQ // p)
    out = []
    for variant, strategy, amp, inside in CASES:
        serial = build(variant).float()
        f32 = _run(copy.deepcopy(serial), variant, X, dY, torch.arange(SEQ), None, False)
        low = _run(copy.deepcopy(serial), variant, X, dY, torch.arange(SEQ), amp, False)
        par = parallelize_mla(copy.deepcopy(serial), mesh, strategy=strategy, overlap=True)
        got = _run(
            par, variant, shard_sequence(X, mesh), shard_sequence(dY, mesh), block, amp, inside
        )
        bad = []
        for key, want in low.items():
            if key not in ("y", "dx"):
                dist.all_reduce(got[key])  # each rank's share of a replicated parameter
            ref, base = want, f32[key]
            if key in ("y", "dx"):
                ref, base = shard_sequence(want, mesh), shard_sequence(base, mesh)
            if got[key].dtype != ref.dtype:
                bad.append(f"{variant} {amp} {key}: dtype {got[key].dtype}, serial {ref.dtype}")
                continue
            spread = float(torch.linalg.vector_norm(ref.double() - base.double()))
            diff = float(torch.linalg.vector_norm(got[key].double() - ref.double()))
            fraction = FORWARD_FRACTION if key == "y" else GRAD_FRACTION
            if not diff <= fraction * spread + 1e-7:
                bad.append(f"{variant} {amp} {key}: |par - serial| {diff:.3g}, spread {spread:.3g}")
        out.append(bad)
    return out


@pytest.mark.timeout(240)
def test_mla_under_autocast_matches_the_serial_module_under_autocast():
    for rank, per_case in enumerate(run_distributed(_cases, 2, timeout=200)):
        for case, bad in zip(CASES, per_case):
            assert not bad, (rank, case, bad)
