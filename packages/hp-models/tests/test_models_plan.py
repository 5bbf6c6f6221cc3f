"""The mesh planner against real steps on 4 gloo ranks (tiny float32 models).

- What the ranks hold: for DeepSeek-V3 and Kimi-Linear on two meshes with ``ep`` (FSDP2),
  every rank's parameter, gradient and optimizer bytes equal ``plan_memory``'s.
- What they move: every collective's bytes in one real step (hp-dtensor's recorder and FSDP2's
  own collectives) equal the plan's, the MoE dispatch and combine within the routing's
  imbalance (the plan assumes balanced routing).
- Activations: the measured peak of one forward + backward (every storage created in the
  step, parameter gradients left out) within :data:`ACT_TOL` of the plan's, for KDA + MLA +
  MoE (Kimi-Linear) and MLA + MoE (DeepSeek-V3), with and without cp, with and without
  activation checkpointing.
- The planner needs no process group and refuses to run beside one; the CLI ranks the meshes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, plan_memory, shard_batch
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.plan.traffic import collective_name
from hyper_parallel.models.testing import (
    deepseek_config,
    import_transformers,
    kimi_config,
    qwen3_next_config,
    random_batch,
    tiny_model,
)

pytestmark = pytest.mark.skipif(not fsdp_available(), reason="needs FSDP2 that can sum")

TIMEOUT = 240.0
SEQ = 64
# the delta-rule models' sequence: one 64-token chunk a rank at cp·tp = 4 (the chunk kernel at
# its real chunk size and head dims)
SEQ_DELTA: dict[str, int] = {}
ACT_TOL = 0.25  # |plan / measured - 1| for the activations' peak
MOE_TOL = 0.5  # the dispatch/combine bytes of one rank vs balanced routing (tiny batches)
# the model's overrides: a vocabulary of 50 gives uneven FSDP2 chunks
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek": {"vocab_size": 50},
    "kimi": {"vocab_size": 50, "num_experts": 8},
    "qwen3-next": {"vocab_size": 50},
}
# the attention CPU's sdpa runs: MLA's q/k and v head dims differ, so the unfused math (it
# keeps the probabilities); Qwen3-Next's gated attention has one head dim: the fused kernel
ATTN = {"deepseek": "sdpa-math", "kimi": "sdpa-math", "qwen3-next": "sdpa"}
# (kind, (dp, cp, tp), ep, grad_reduction, activation checkpointing)
HELD = [
    ("deepseek", (1, 2, 2), 2, "fsdp", False),
    ("kimi", (2, 1, 2), 4, "fsdp", False),
    ("qwen3-next", (1, 2, 2), 4, "fsdp", False),
]
ACTS = [
    ("kimi", (1, 2, 2), 2, "allreduce", False),
    ("kimi", (1, 2, 2), 2, "allreduce", True),
    ("kimi", (4, 1, 1), 4, "allreduce", False),
    ("deepseek", (1, 4, 1), 2, "allreduce", False),
    ("deepseek", (2, 1, 2), 2, "allreduce", True),
    ("qwen3-next", (1, 2, 2), 2, "allreduce", False),
    ("qwen3-next", (2, 1, 2), 2, "allreduce", True),
]


def _config(kind: str) -> Any:
    make = {"deepseek": deepseek_config, "kimi": kimi_config, "qwen3-next": qwen3_next_config}
    return make[kind](**OVERRIDES[kind])


def _step(cases: list[Any]) -> list[dict[str, Any]]:
    """On each rank, per case: one training step (forward, backward, AdamW step) of the tiny
    model placed by ``parallelize_model``, measured."""
    import torch.distributed as dist

    from hyper_parallel.models.plan.measure import count_collectives, held_bytes, track_activations

    out = []
    for i, (kind, dims, ep, reduction, ac) in enumerate(cases):
        model = tiny_model(kind, dtype=torch.float32, **OVERRIDES[kind])
        model.train()
        if ac:
            model.gradient_checkpointing_enable()
        name = f"plan{i}"  # a root mesh of its own per case
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))
        mesh = unflatten(world, name, dims, ("dp", "cp", "tp"))
        parallelize_model(model, mesh, ep=ep, grad_reduction=reduction)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = random_batch(vocab=50, bsz=2 * dims[0], seq=SEQ_DELTA.get(kind, SEQ))
        local = shard_batch(batch, mesh)
        with count_collectives() as moved, track_activations() as trace:
            model(**local).loss.backward()
        trace.exclude_tensors([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        out.append({**held_bytes(model, opt), "collectives": moved, "activations": trace.peak()})
    return out


def _plan(kind: str, dims: Any, ep: int, reduction: str, ac: bool) -> Any:
    return plan_memory(
        _config(kind),
        dims=dims,
        ep=ep,
        seq_len=SEQ_DELTA.get(kind, SEQ),
        batch=2 * dims[0],
        dtype=torch.float32,
        grad_reduction=reduction,
        activation_checkpointing=ac,
        attn_implementation=ATTN[kind],
    )


def _merged(moved: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, n in moved.items():
        out[collective_name(name)] = out.get(collective_name(name), 0) + n
    return out


@pytest.mark.timeout(TIMEOUT + 30)
def test_plan_equals_what_ranks_hold_and_move() -> None:
    real = run_distributed(_step, 4, HELD, timeout=TIMEOUT)
    for i, case in enumerate(HELD):
        plan = _plan(*case)
        for r in range(4):
            got = real[r][i]
            where = f"{case}, rank {r}"
            assert got["parameters"] == plan.parameters, where
            assert got["gradients"] == plan.gradients, where
            # the states are shaped like the unpadded shards: the busiest rank's are planned
            assert got["optimizer"] <= plan.optimizer, where
            for name, n in _merged(got["collectives"]).items():
                assert name in plan.collectives, (where, name)
                if not name.startswith(("moe:dispatch", "moe:combine")):
                    assert n <= plan.collectives[name], (where, name)
        # each collective's busiest rank moves what the plan says (a chain's ends send or
        # receive only)
        busiest: dict[str, int] = {}
        for r in range(4):
            for name, n in _merged(real[r][i]["collectives"]).items():
                busiest[name] = max(busiest.get(name, 0), n)
        assert set(busiest) == set(plan.collectives), case
        for name, n in plan.collectives.items():
            if name.startswith(("moe:dispatch", "moe:combine")):
                assert abs(busiest[name] / n - 1) <= MOE_TOL, (case, name, busiest[name], n)
            else:
                assert busiest[name] == n, (case, name, busiest[name], n)
        assert max(real[r][i]["optimizer"] for r in range(4)) == plan.optimizer, case
        # the routed rows over the ranks: the plan's balanced share, on average
        total = sum(_merged(real[r][i]["collectives"])["moe:dispatch"] for r in range(4))
        assert abs(total / (4 * plan.collectives["moe:dispatch"]) - 1) <= MOE_TOL / 2, case


@pytest.mark.timeout(TIMEOUT + 30)
def test_plan_activations_within_tolerance_of_measured_peak() -> None:
    real = run_distributed(_step, 4, ACTS, timeout=TIMEOUT)
    for i, case in enumerate(ACTS):
        plan = _plan(*case)
        measured = max(real[r][i]["activations"] for r in range(4))
        ratio = plan.activations / measured
        assert abs(ratio - 1) <= ACT_TOL, (case, plan.activations, measured, ratio)
    # checkpointing keeps less, as planned and as measured
    off, on = (max(real[r][j]["activations"] for r in range(4)) for j in (0, 1))
    assert on < off
    assert _plan(*ACTS[1]).activations < _plan(*ACTS[0]).activations


# one delta-rule layer at the real head dim (128) and chunk size (64), reduced hidden size and
# heads: (kind, hidden, heads (KDA) or (key heads, value heads) (Gated DeltaNet)), 2 ranks,
# 256 tokens a rank (4 chunks)
LAYERS = [("kda", 256, (2,)), ("gdn", 256, (1, 2))]
LAYER_TOKENS = 256


def _delta_layer(kind: str, hidden: int, heads: tuple[int, ...]) -> Any:
    """A stock KDA / Gated DeltaNet layer on transformers' torch path, fast gates (as the
    planner assumes)."""
    from hyper_parallel.kda.testing import import_torch_path

    tf = import_transformers()
    torch.manual_seed(0)
    if kind == "kda":
        mod = import_torch_path("transformers.models.kimi_linear.modeling_kimi_linear")
        cfg = tf.KimiLinearConfig(
            hidden_size=hidden, num_hidden_layers=1,
            linear_attn_config={"head_dim": 128, "num_heads": heads[0],
                                "short_conv_kernel_size": 4},
        )  # fmt: skip
        layer = mod.KimiLinearDeltaAttention(cfg, layer_idx=0)
        with torch.no_grad():  # the bare layer leaves them uninitialised: hp-kda-kernels' bench
            layer.forget_gate.A_log.uniform_(1.0, 16.0).log_()
            layer.forget_gate.dt_bias.uniform_(-7.0, -2.3)
        return layer
    mod = import_torch_path("transformers.models.qwen3_next.modeling_qwen3_next")
    cfg = tf.Qwen3NextConfig(
        hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        linear_num_key_heads=heads[0], linear_num_value_heads=heads[1],
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"],
    )  # fmt: skip
    return mod.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)  # its own gates decay fast


def _layer_peaks(cases: list[Any]) -> list[int]:
    """On each rank: the activation peak of one forward + backward of its block through the
    layer under ``parallelize_kda`` / ``parallelize_gated_deltanet`` (the parameters, the
    input and their gradients left out; the output, a residual add's input in a model, too)."""
    import torch.distributed as dist

    from hyper_parallel.kda import parallelize_gated_deltanet, parallelize_kda
    from hyper_parallel.models.plan.measure import track_activations

    P, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    peaks = []
    for kind, hidden, heads in cases:
        layer = _delta_layer(kind, hidden, heads)
        (parallelize_kda if kind == "kda" else parallelize_gated_deltanet)(
            layer, mesh, local_kernel="torch"
        )
        x = torch.randn(1, LAYER_TOKENS * P, hidden, generator=torch.Generator().manual_seed(1))
        x = x[:, LAYER_TOKENS * r : LAYER_TOKENS * (r + 1)].contiguous().requires_grad_()
        with track_activations() as trace:
            out = layer(x)
            loss = out.sum()
            trace.exclude_tensors([out])
            del out
            loss.backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        trace.exclude_tensors([*grads, x.grad])
        peaks.append(trace.peak())
    return peaks


@pytest.mark.timeout(TIMEOUT + 30)
def test_plan_delta_rule_layer_within_tolerance_of_measured_peak() -> None:
    """One KDA and one Gated DeltaNet layer at the real head dim, chunk size and chunk kernel
    (the lean path): the planner's bytes for the block (``mixer_bytes(peak=True)``) within
    :data:`ACT_TOL` of the measured peak on the busiest of 2 ranks."""
    from hyper_parallel.models.plan.activations import LayerShape, mixer_bytes

    real = run_distributed(_layer_peaks, 2, LAYERS, timeout=TIMEOUT)
    for i, (kind, hidden, heads) in enumerate(LAYERS):
        if kind == "kda":
            dims = {"D": hidden, "H": heads[0], "K": 128, "conv": 4}
        else:
            dims = {"D": hidden, "Hk": heads[0], "Hv": heads[1], "K": 128, "V": 128, "conv": 4}
        shape = LayerShape(kind, "dense", tuple(sorted(dims.items())))
        plan = mixer_bytes(
            shape, rows=1, seq=2 * LAYER_TOKENS, p=2, b=4, attn_implementation="flash",
            kda_kernel="torch", peak=True,
        )  # fmt: skip
        measured = max(real[r][i] for r in range(2))
        assert abs(plan / measured - 1) <= ACT_TOL, (kind, plan, measured, plan / measured)


def test_plan_refuses_beside_a_process_group_and_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        plan_memory(_config("kimi"), dims=(1, 2, 2), seq_len=63, dtype=torch.float32)
    with pytest.raises(ValueError, match="batch"):
        plan_memory(_config("kimi"), dims=(2, 1, 2), seq_len=64, batch=3)
    with pytest.raises(ValueError, match="attn_implementation"):
        plan_memory(_config("deepseek"), dims=(1, 2, 2), seq_len=64, attn_implementation="fast")


def test_cli_ranks_every_valid_mesh(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from hyper_parallel.models.plan.__main__ import main
    from hyper_parallel.models.plan.search import meshes

    cfg = _config("deepseek")  # 4 heads, 4 routed experts
    found = meshes(cfg, 8, 64, tp_max=8)
    assert all(d[0] * d[1] * d[2] == 8 and 4 % (d[1] * d[2]) == 0 for d, _ in found)
    assert {ep for _, ep in found} == {1, 2, 4}
    assert ((2, 2, 2), 4) in found and ((1, 8, 1), 1) not in found  # 8 > 4 heads
    cfg.save_pretrained(tmp_path)
    main(
        [
            "--model",
            str(tmp_path),
            "--devices",
            "4",
            "--seq-len",
            "64",
            "--dtype",
            "fp32",
            "--device",
            "H100",
            "--device-memory",
            "1MiB",
            "--checkpointing",
            "off",
            "--top",
            "100",
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "|" in line[2:]]
    ranked = [r for r in rows if r.split("|")[1].strip().isdigit()]
    assert len(ranked) == len(meshes(cfg, 4, 64))
    assert "fsdp.all_gather" in out
