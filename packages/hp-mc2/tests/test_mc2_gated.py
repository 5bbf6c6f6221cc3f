"""MC2GatedMLPParallel on the stock Hugging Face gated MLPs (LlamaMLP, DeepseekV3MLP,
KimiLinearMLP from transformers, tiny random configs): output, input gradient and every weight
gradient equal the serial module on the full sequence, in float64 at 2 and 4 ranks, with and
without bias, batch-first and sequence-first, on 1-D tp meshes and on the tp dim of a
("cp", "tp") mesh (tp of size 1 included); bf16 within a tolerance relative to each tensor's
scale; the npu path through the torch_npu double; the reference twin; ranks with different
thread counts agreeing on the chunk count.

Two process spawns (2 and 4 ranks) run every check; the tests read their parts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mc2_npu_double import GlooMC2Double
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    MC2GatedMLPParallel,
    default_chunks,
    gated_mlp,
    gated_mlp_reference,
    use_npu_ops,
)

TIMEOUT = 240.0
D = 8  # hidden size of the tiny configs (the intermediate size is a multiple of tp)
F64, BF16 = torch.float64, torch.bfloat16


def _hf_mlp(kind: str, ffn: int, dtype: torch.dtype = F64) -> torch.nn.Module:
    """A stock transformers MLP from a tiny random config (no download), seeded."""
    from transformers import DeepseekV3Config, KimiLinearConfig, LlamaConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    common = dict(
        hidden_size=D, intermediate_size=ffn, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    if kind == "llama":
        m = LlamaMLP(LlamaConfig(**common, mlp_bias=False, hidden_act="silu"))
    elif kind == "llama_bias":
        m = LlamaMLP(LlamaConfig(**common, mlp_bias=True, hidden_act="relu2"))
    elif kind == "llama_bias_gelu":
        m = LlamaMLP(LlamaConfig(**common, mlp_bias=True, hidden_act="gelu"))
    elif kind == "deepseek_v3":
        m = DeepseekV3MLP(DeepseekV3Config(**common, hidden_act="silu"))
    elif kind == "kimi_linear":
        m = KimiLinearMLP(KimiLinearConfig(**common, hidden_act="gelu_pytorch_tanh"))
    else:
        raise AssertionError(kind)
    # HF leaves nn.Linear's default init; biases scaled up so a dropped bias is visible.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.mul_(10)
    return m.to(dtype)


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rel(got: Any, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    if got is None:
        return float("inf")
    got = got.full_tensor() if isinstance(got, DTensor) else got
    scale = want.abs().max().item() or 1.0
    return (got.double() - want.double()).abs().max().item() / scale


def _parity(
    kind: str,
    mesh: Any,
    block: int,
    blocks: int,
    *,
    dtype: torch.dtype = F64,
    seq_dim: int = 1,
    **style: Any,
) -> dict[str, float]:
    """Serial module on the tokens this tp group covers (blocks ``block - t … block - t + tp``)
    vs the parallel module on this rank's block ``block`` of ``blocks``: relative errors of the
    output, the input gradient and every parameter gradient (``full_tensor`` of the DTensor)."""
    tp, t = mesh.size(), mesh.get_local_rank()
    B, S_blk = 2, 3
    ffn = 4 * tp if kind != "kimi_linear" else 6 * tp
    serial = _hf_mlp(kind, ffn, F64)
    par = parallelize_module(
        copy.deepcopy(serial).to(dtype), mesh, MC2GatedMLPParallel(sequence_dim=seq_dim, **style)
    )
    if dtype != F64:  # the reference sees the same rounded weights
        serial.load_state_dict({k: v.to(dtype).double() for k, v in serial.state_dict().items()})
    shape = (B, S_blk * blocks, D) if seq_dim == 1 else (S_blk * blocks, B, D)
    X, dY = _seeded(1, *shape).to(dtype).double(), _seeded(2, *shape).to(dtype).double()
    first = block - t  # the tp group's first block: its gather covers blocks first … first+tp-1
    group_x = X.narrow(seq_dim, first * S_blk, tp * S_blk).clone().requires_grad_()
    group_dy = dY.narrow(seq_dim, first * S_blk, tp * S_blk)
    y_ref = serial(group_x)
    y_ref.backward(group_dy)
    x = X.narrow(seq_dim, block * S_blk, S_blk).to(dtype).clone().requires_grad_()
    y = par(x)
    y.backward(dY.narrow(seq_dim, block * S_blk, S_blk).to(dtype))
    errs = {
        "y": _rel(y, y_ref.narrow(seq_dim, t * S_blk, S_blk)),
        "dx": _rel(x.grad, group_x.grad.narrow(seq_dim, t * S_blk, S_blk)),
    }
    for (name, p_ref), (_, p) in zip(serial.named_parameters(), par.named_parameters()):
        errs[f"d{name}"] = _rel(p.grad, p_ref.grad)
    return errs


def _placements(mesh: Any) -> dict[str, Any]:
    par = parallelize_module(_hf_mlp("llama_bias", 4 * mesh.size()), mesh, MC2GatedMLPParallel())
    return {n: (type(p).__name__, tuple(p.placements)) for n, p in par.named_parameters()}


def _functional_vs_reference(mesh: Any) -> dict[str, float]:
    """gated_mlp (chunked torch implementation) vs its reference twin, same local operands."""
    t = mesh.get_local_rank()
    group = mesh.get_group()
    m, fl = 5, 3
    ops = [
        _seeded(10 + i, *s)
        for i, s in enumerate([(m, D), (fl, D), (fl, D), (D, fl), (fl,), (fl,), (D,)])
    ]
    dy = _seeded(20 + t, m, D)
    grads = []
    for fn in (gated_mlp, gated_mlp_reference):
        leaves = [o.clone().requires_grad_() for o in ops]
        x, wg, wu, wd, bg, bu, bd = leaves
        y = fn(
            x,
            wg,
            wu,
            wd,
            group,
            act_fn=torch.nn.functional.silu,
            gate_bias=bg,
            up_bias=bu,
            down_bias=bd,
            chunks=2,
        )
        y.backward(dy)
        grads.append([y.detach(), *(leaf.grad for leaf in leaves)])
    return {f"t{i}": _rel(a, b) for i, (a, b) in enumerate(zip(*grads))}


def _saved_shapes(mesh: Any) -> list[tuple[int, ...]]:
    """Shapes autograd saves for the parallel block (D != F/tp so a gathered X is visible)."""
    par = parallelize_module(_hf_mlp("llama", 6 * mesh.size()), mesh, MC2GatedMLPParallel())
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    x = _seeded(3, 1, 4, D).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = par(x)
    y.sum().backward()
    return shapes


def _npu_double(mesh: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The npu path (the torch_npu test double over gloo) vs the torch implementation, same
    operands."""
    t = mesh.get_local_rank()
    group = mesh.get_group()
    d, fl, m = 256, 256, 4  # the kernels' smallest contraction dim
    ops = [
        _seeded(30 + i, *s) / 8
        for i, s in enumerate([(m, d), (fl, d), (fl, d), (d, fl), (fl,), (fl,), (d,)])
    ]
    dy = _seeded(40 + t, m, d)
    double = GlooMC2Double()
    out = {}
    for impl in ("npu", "torch"):
        leaves = [o.to(dtype).clone().requires_grad_() for o in ops]
        x, wg, wu, wd, bg, bu, bd = leaves
        with use_npu_ops(double):
            y = gated_mlp(
                x,
                wg,
                wu,
                wd,
                group,
                act_fn=torch.nn.functional.silu,
                gate_bias=bg,
                up_bias=bu,
                down_bias=bd,
                impl=impl,
            )
            y.backward(dy.to(dtype))
        out[impl] = [y.detach(), *(leaf.grad for leaf in leaves)]
    return {
        "errs": [_rel(a, b) for a, b in zip(out["npu"], out["torch"])],
        "calls": [
            (c.op, c.x2_shape, c.x2_transposed_view, c.kwargs.get("gather_output"))
            for c in double.calls
        ],
    }


def _deepcopy_runs(mesh: Any) -> list[float]:
    """A deep copy of a parallelized module (a reference model, EMA) computes the same."""
    par = parallelize_module(_hf_mlp("llama_bias", 4 * mesh.size()), mesh, MC2GatedMLPParallel())
    twin = copy.deepcopy(par)
    x = _seeded(5, 2, 3, D)
    return [_rel(twin(x), par(x)), float(twin.gate_proj.weight is par.gate_proj.weight)]


def _twice_backward(mesh: Any) -> str:
    par = parallelize_module(_hf_mlp("llama", 4 * mesh.size()), mesh, MC2GatedMLPParallel())
    y = par(_seeded(4, 1, 2, D).requires_grad_())
    y.sum().backward(retain_graph=True)
    try:
        y.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _two_ranks() -> dict[str, Any]:
    r, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    res: dict[str, Any] = {"parity": {}}
    for kind in ("llama", "llama_bias", "deepseek_v3", "kimi_linear"):
        res["parity"][kind] = _parity(kind, mesh, r, ws)
    res["parity"]["llama_bias_chunks3"] = _parity("llama_bias_gelu", mesh, r, ws, chunks=3)
    res["parity"]["llama_bias_seq_first"] = _parity("llama_bias", mesh, r, ws, seq_dim=0, chunks=2)
    res["bf16"] = {k: _parity(k, mesh, r, ws, dtype=BF16) for k in ("llama_bias", "kimi_linear")}
    # ranks disagree on threads: the default chunk count (hence the collectives) must not
    torch.set_num_threads(1 + r)
    res["threads_differ"] = _parity("llama", mesh, r, ws)
    res["default_chunks"] = default_chunks(4096, 1024, 1408, 2, "cpu")
    torch.set_num_threads(1)
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    cp_tp = unflatten(world, "world", (ws, 1), ("cp", "tp"))
    res["tp1_submesh"] = _parity("llama_bias", cp_tp["tp"], r, ws)
    res["placements"] = _placements(mesh)
    res["reference_twin"] = _functional_vs_reference(mesh)
    res["saved"] = _saved_shapes(mesh)
    res["npu"] = {str(dt): _npu_double(mesh, dt) for dt in (BF16, torch.float16)}
    res["twice"] = _twice_backward(mesh)
    res["deepcopy"] = _deepcopy_runs(mesh)
    return res


def _four_ranks() -> dict[str, Any]:
    r, ws = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    res: dict[str, Any] = {"parity": {}}
    for kind in ("llama", "llama_bias", "deepseek_v3", "kimi_linear"):
        res["parity"][kind] = _parity(kind, mesh, r, ws)
    res["parity"]["llama_bias_chunks3"] = _parity("llama_bias_gelu", mesh, r, ws, chunks=3)
    res["reference_twin"] = _functional_vs_reference(mesh)
    world = init_device_mesh("cpu", (ws,), mesh_dim_names=("world",))
    # rank (c, t) holds block c·tp + t, i.e. block r; the tp gather gives the cp chunk
    for cp, tp in ((2, 2), (4, 1)):
        sub = unflatten(world, "world", (cp, tp), ("cp", "tp"))["tp"]
        res["parity"][f"cp{cp}_tp{tp}"] = _parity("llama_bias", sub, r, ws)
    return res


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_four_ranks, 4, timeout=TIMEOUT)


def _assert_close(results: list[dict[str, float]], tol: float) -> None:
    for rank, errs in enumerate(results):
        assert "dup_proj.weight" in errs and "ddown_proj.weight" in errs, errs
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.timeout(300)
def test_gated_style_equals_stock_hf_mlps_float64_at_2_ranks(two_ranks):
    for case in two_ranks[0]["parity"]:
        _assert_close([res["parity"][case] for res in two_ranks], 1e-12)
    assert "dgate_proj.bias" in two_ranks[0]["parity"]["llama_bias"]


@pytest.mark.timeout(300)
def test_gated_style_equals_stock_hf_mlps_float64_at_4_ranks(four_ranks):
    for case in four_ranks[0]["parity"]:
        if not case.startswith("cp"):
            _assert_close([res["parity"][case] for res in four_ranks], 1e-12)


@pytest.mark.timeout(300)
def test_gated_style_on_tp_dim_of_cp_tp_mesh_including_tp_of_size_1(two_ranks, four_ranks):
    for case in ("cp2_tp2", "cp4_tp1"):
        _assert_close([res["parity"][case] for res in four_ranks], 1e-12)
    _assert_close([res["tp1_submesh"] for res in two_ranks], 1e-12)


@pytest.mark.timeout(300)
def test_gated_style_bf16_within_tolerance_relative_to_each_tensor_scale(two_ranks):
    # bf16 keeps 8 bits: one rounding of each product and of the sums, a few ulps of 2^-8
    for case in ("llama_bias", "kimi_linear"):
        _assert_close([res["bf16"][case] for res in two_ranks], 3e-2)


@pytest.mark.timeout(300)
def test_gated_style_shards_weights_as_dtensors(two_ranks):
    s0, s1, rep = (Shard(0),), (Shard(1),), (Replicate(),)
    want = {
        "gate_proj.weight": ("DTensor", s0),
        "gate_proj.bias": ("DTensor", s0),
        "up_proj.weight": ("DTensor", s0),
        "up_proj.bias": ("DTensor", s0),
        "down_proj.weight": ("DTensor", s1),
        "down_proj.bias": ("DTensor", rep),
    }
    for res in two_ranks:
        assert res["placements"] == want


@pytest.mark.timeout(300)
def test_ranks_with_different_thread_counts_run_the_same_collectives(two_ranks):
    _assert_close([res["threads_differ"] for res in two_ranks], 1e-12)
    assert {res["default_chunks"] for res in two_ranks} == {8}


@pytest.mark.timeout(300)
def test_functional_gated_mlp_equals_its_reference_twin(two_ranks, four_ranks):
    for res in [*two_ranks, *four_ranks]:
        assert max(res["reference_twin"].values()) <= 1e-12, res["reference_twin"]
        assert len(res["reference_twin"]) == 8  # y and the grads of all 7 operands


@pytest.mark.timeout(300)
def test_backward_keeps_no_gathered_copy_of_the_input(two_ranks):
    ws = 2
    for res in two_ranks:
        rows = [s for s in res["saved"] if len(s) == 2 and s[1] == D]
        # the local block [4, D] is saved; nothing with the gathered ws·4 rows
        assert (4, D) in rows and all(s[0] < ws * 4 for s in rows), res["saved"]


@pytest.mark.timeout(300)
def test_npu_path_through_kernel_double_equals_torch_impl(two_ranks):
    for res in two_ranks:
        for dtype, tol in (("torch.bfloat16", 2e-2), ("torch.float16", 4e-3)):
            got = res["npu"][dtype]
            assert max(got["errs"]) <= tol, (dtype, got["errs"])
            # forward: gate+up as one fused gather-matmul ([D, 2F/ws] transposed view, the
            # gathered input not returned), down as matmul-reduce-scatter; backward: the duals
            assert got["calls"] == [
                ("npu_all_gather_base_mm", (256, 512), True, False),
                ("npu_mm_reduce_scatter_base", (256, 256), True, None),
                ("npu_all_gather_base_mm", (256, 256), False, True),
                ("npu_mm_reduce_scatter_base", (512, 256), False, None),
            ], got["calls"]


@pytest.mark.timeout(300)
def test_second_backward_through_the_same_graph_is_a_clear_error(two_ranks):
    for res in two_ranks:
        assert "retain_graph=True is not supported" in res["twice"]


@pytest.mark.timeout(300)
def test_deep_copy_of_a_parallelized_module_computes_the_same(two_ranks):
    for res in two_ranks:
        assert res["deepcopy"] == [0.0, 0.0]
