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
- Pipelines (``pipeline_model`` at (pp, cp, tp) = (2, 2, 1), ``1F1B`` and ``Interleaved1F1B``):
  every rank's held bytes and every collective (FSDP2's once a step, the stages' sends, the
  losses) equal its pp rank's plan, the activations in flight within :data:`ACT_TOL`.
- The schedules' bubble and what each rank keeps in flight, from torch's action orders; a
  pipeline plan adds up to the whole model's; the planner needs no process group and refuses
  to run beside one; the CLI ranks the meshes, pipelines too.
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


# pipelines: (kind, (pp, cp, tp), ep, grad_reduction, micro-batches, schedule, stages a rank);
# the activations checked under all-reduce (no FSDP2 buffers among the tensors)
PIPES = [
    ("deepseek", (2, 2, 1), 2, "fsdp", 2, "1F1B", 1),
    ("kimi", (2, 2, 1), 2, "allreduce", 2, "1F1B", 1),
    ("deepseek", (2, 2, 1), 2, "allreduce", 4, "Interleaved1F1B", 2),
]
PIPE_OVERRIDES = {**OVERRIDES, "deepseek": {"vocab_size": 50, "num_hidden_layers": 4}}
PIPE_ROWS = 2  # rows a micro-batch


def _pipe_step(cases: list[Any]) -> list[dict[str, Any]]:
    """On each rank, per case: two training steps of the tiny model under ``pipeline_model``,
    the second measured (torch's stages allocate their receive buffers, which the plan counts
    apart, in the first), then the optimizer's step."""
    import torch.distributed as dist

    from hyper_parallel.models import pipeline_model
    from hyper_parallel.models.plan.measure import count_collectives, held_bytes, track_activations

    out = []
    for i, (kind, dims, ep, reduction, m, schedule, v) in enumerate(cases):
        model = tiny_model(kind, dtype=torch.float32, **PIPE_OVERRIDES[kind])
        model.train()
        name = f"pipe{i}"
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))
        mesh = unflatten(world, name, dims, ("pp", "cp", "tp"))
        pm = pipeline_model(
            model, mesh, microbatches=m, schedule=schedule, stages_per_rank=v, ep=ep,
            grad_reduction=reduction,
        )  # fmt: skip
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        batch = random_batch(vocab=50, bsz=PIPE_ROWS * m, seq=SEQ)
        pm.step(**batch)
        pm.zero_grad()
        with count_collectives() as moved, track_activations() as trace:
            pm.step(**batch)
        trace.exclude_tensors([p.grad for p in pm.parameters() if p.grad is not None])
        opt.step()
        out.append({**held_bytes(pm, opt), "collectives": moved, "activations": trace.peak()})
    return out


def _pipe_plan(kind: str, dims: Any, ep: int, reduction: str, m: int, schedule: str, v: int) -> Any:
    pp, cp, tp = dims
    cfg_kind = {"deepseek": deepseek_config, "kimi": kimi_config}[kind]
    return plan_memory(
        cfg_kind(**PIPE_OVERRIDES[kind]),
        dims={"pp": pp, "cp": cp, "tp": tp},
        ep=ep,
        seq_len=SEQ,
        batch=PIPE_ROWS * m,
        dtype=torch.float32,
        grad_reduction=reduction,
        attn_implementation=ATTN[kind],
        microbatches=m,
        schedule=schedule,
        stages_per_rank=v,
    )


@pytest.mark.timeout(TIMEOUT + 30)
def test_pipeline_plan_equals_what_ranks_hold_move_and_keep() -> None:
    real = run_distributed(_pipe_step, 4, PIPES, timeout=TIMEOUT)
    for i, case in enumerate(PIPES):
        plan = _pipe_plan(*case)
        pp, reduction = case[1][0], case[3]
        per_rank = 4 // pp
        for pr in plan.ranks:
            ranks = range(pr.pp_rank * per_rank, (pr.pp_rank + 1) * per_rank)
            got = [real[r][i] for r in ranks]
            where = (case, pr.pp_rank)
            assert all(g["parameters"] == pr.parameters for g in got), where
            assert all(g["gradients"] == pr.gradients for g in got), where
            assert max(g["optimizer"] for g in got) == pr.optimizer, where
            if reduction == "allreduce":
                measured = max(g["activations"] for g in got)
                ratio = pr.activations / measured
                assert abs(ratio - 1) <= ACT_TOL, (where, pr.activations, measured, ratio)
            busiest: dict[str, int] = {}
            for g in got:
                for name, n in _merged(g["collectives"]).items():
                    busiest[name] = max(busiest.get(name, 0), n)
            assert set(busiest) == set(pr.collectives), (where, set(busiest) ^ set(pr.collectives))
            for name, n in pr.collectives.items():
                if name.startswith(("moe:dispatch", "moe:combine")):
                    assert abs(busiest[name] / n - 1) <= MOE_TOL, (where, name, busiest[name], n)
                else:
                    assert busiest[name] == n, (where, name, busiest[name], n)
        # FSDP2 gathers each stage once a step: the busiest rank's all-gather is its stage's
        if reduction == "fsdp":
            assert plan.collectives["fsdp.all_gather"] == max(
                pr.collectives["fsdp.all_gather"] for pr in plan.ranks
            )


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


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_schedules_bubble_and_in_flight_from_torchs_orders(pp: int, m: int) -> None:
    """Torch's orders give the textbook bubbles and what each rank keeps in flight."""
    from hyper_parallel.models.plan.schedule import bubble, in_flight_peak, rank_actions

    def most(schedule: str, v: int) -> list[int]:
        out = []
        for actions in rank_actions(schedule, pp, m, v):
            ones = {s: 1 for _, s, _ in actions}
            out.append(in_flight_peak(actions, ones, ones)[2])
        return out

    assert bubble("1F1B", pp, m, 1) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble("GPipe", pp, m, 1) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble("Interleaved1F1B", pp, m, 2) == pytest.approx((pp - 1) / (2 * m + pp - 1))
    # torch's split backward (input, weight gradients a forward's time each) fills the rest
    split = bubble("InterleavedZeroBubble", pp, m, 2, split_backward=True)
    assert split == pytest.approx((pp - 1) / (3 * 2 * m + pp - 1))
    assert most("1F1B", 1) == [min(m, pp - s) for s in range(pp)]
    assert most("GPipe", 1) == [m] * pp
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm = [min((2 - 1) * per_round + 2 * (pp - 1 - r), 2 * m) for r in range(pp)]
    assert most("Interleaved1F1B", 2) == [min(w + 1, 2 * m) for w in warm]


def test_pipeline_plan_adds_up_to_the_whole_model() -> None:
    """A pipeline's stages hold the whole model's bytes between them, each FSDP2 unit gathered
    once a step; the split is the runtime's; the dims may carry pp."""
    from hyper_parallel.models.pipeline.split import balanced_split, layer_costs
    from hyper_parallel.models.plan.placement import build_on_meta

    cfg = deepseek_config(**PIPE_OVERRIDES["deepseek"])
    kw: dict[str, Any] = dict(ep=2, seq_len=SEQ, dtype=torch.float32, attn_implementation="sdpa")
    whole = plan_memory(cfg, dims=(1, 2, 1), batch=4, **kw)
    pipe = plan_memory(cfg, dims={"pp": 2, "cp": 2, "tp": 1}, batch=4, microbatches=4, **kw)
    assert plan_memory(cfg, dims=(2, 1, 2, 1), batch=4, microbatches=4, **kw) == pipe
    assert plan_memory(cfg, dims=(1, 2, 1), pp=2, batch=4, microbatches=4, **kw) == pipe
    costs, head = layer_costs(build_on_meta(cfg, torch.float32))
    assert list(pipe.stage_layers) == balanced_split(costs, 2, last_extra=head)
    assert pipe.mesh_dims == (2, 1, 2, 1) and pipe.devices == 4 and pipe.pipelined
    assert pipe.bubble == pytest.approx(1 / 5)
    stages = pipe.stage_plans
    for what in ("parameters", "gradients", "optimizer"):
        assert sum(getattr(sp, what) for sp in stages) == getattr(whole, what), what
    rs = "fsdp.reduce_scatter"
    assert sum(sp.collectives[rs] for sp in stages) == whole.collectives[rs]
    # each unit gathered once (the whole model gathers a layer twice): less than half
    ag = "fsdp.all_gather"
    assert sum(sp.collectives[ag] for sp in stages) < whole.collectives[ag]
    assert pipe.collectives[ag] < whole.collectives[ag] / 2
    # the busiest rank: its total, the most of any rank
    assert pipe.total == max(r.total for r in pipe.ranks)
    hidden = 1 * SEQ // 2 * cfg.hidden_size * 4  # a micro-batch's hidden states on one rank
    assert pipe.collectives["p2p:pipeline"] == 4 * hidden
    assert pipe.pipeline_buffers == 4 * hidden
    with pytest.raises(ValueError, match="pp"):
        plan_memory(cfg, dims=(2, 1, 2, 1), pp=4, batch=4, microbatches=4, **kw)
    with pytest.raises(ValueError, match="microbatches"):
        plan_memory(cfg, dims=(2, 1, 2, 1), batch=6, microbatches=4, **kw)
    with pytest.raises(ValueError, match="1F1B"):
        plan_memory(cfg, dims=(4, 1, 1, 1), batch=2, microbatches=2, **kw)


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
            "--max-microbatches",
            "2",
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "|" in line[2:]]
    ranked = [r for r in rows if r.split("|")[1].strip().isdigit() and r.count("|") > 15]
    # pp = 1: every mesh; pp = 2 (the 3 layers fill 2 stages): 1F1B with 2 micro-batches
    assert len(ranked) == len(meshes(cfg, 4, 64)) + len(meshes(cfg, 2, 64))
    assert "fsdp.all_gather" in out
    assert sum("1F1B, 2 |" in r for r in ranked) == len(meshes(cfg, 2, 64))
