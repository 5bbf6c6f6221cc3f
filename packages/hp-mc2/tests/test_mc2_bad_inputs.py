"""Every rejected input, in one place. Each raises a clear error on every rank before any
communication (the collective helpers and the process group count no traffic), and the group
still works afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _mc2_testutil import group_still_works, max_err, rank_and_size, seeded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import hyper_parallel.mc2._block_style as block_style
import hyper_parallel.mc2.styles as styles
from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.recorder import record_events
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.mc2 import (
    MC2ColwiseParallel,
    MC2GatedMLPParallel,
    MC2Linear,
    MC2RowwiseParallel,
    all_gather_matmul,
    gated_mlp,
    matmul_reduce_scatter,
)

TIMEOUT = 90.0


def _mesh():
    return init_device_mesh("cpu", (rank_and_size()[1],))


def _row_module(seq_dim: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(nn.Linear(8, 6), _mesh(), MC2RowwiseParallel(seq_dim))


def _col_module(seq_dim: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(nn.Linear(6, 8), _mesh(), MC2ColwiseParallel(seq_dim))


class _GatedMLP(nn.Module):
    """Shaped like Hugging Face's LlamaMLP: down(act_fn(gate(x)) * up(x))."""

    def __init__(self, act: nn.Module | None = None, bias: bool = False, ffn: int = 8) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(6, ffn, bias=bias)
        self.up_proj = nn.Linear(6, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, 6, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _gated_module() -> nn.Module:
    torch.manual_seed(0)
    return parallelize_module(_GatedMLP(), _mesh(), MC2GatedMLPParallel())


def _without_up() -> nn.Module:
    m = _GatedMLP()
    del m.up_proj
    return m


def _meta_bias() -> nn.Module:
    m = _GatedMLP(bias=True)
    m.gate_proj.bias = nn.Parameter(torch.empty(8, device="meta"))
    return m


def _seq_dtensor(x: torch.Tensor) -> DTensor:
    return DTensor.from_local(x, _mesh(), [Shard(1)], run_check=False)


def _apply_gated(m: nn.Module, mesh=None, **style) -> nn.Module:
    return parallelize_module(m, mesh or _mesh(), MC2GatedMLPParallel(**style))


def _permuted_mesh() -> DeviceMesh:
    """A 1-D mesh listing the ranks backwards; its group's rank order is ascending."""
    return DeviceMesh("cpu", torch.arange(rank_and_size()[1]).flip(0))


f32, f64 = torch.float32, torch.float64
# name -> (builder of the module under test or None, the call that must fail, expected
# exception type, phrase of its message). Building a module communicates (distribute_tensor),
# so it runs before the traffic count of the failing call starts.
CASES: dict[str, tuple[Callable | None, Callable, str, str]] = {
    "non_linear_module": (
        None,
        lambda _: parallelize_module(nn.Conv1d(4, 4, 1), _mesh(), MC2ColwiseParallel()),
        "TypeError",
        "only applies to nn.Linear",
    ),
    "from_linear_non_linear": (
        None,
        lambda _: MC2Linear.from_linear(nn.Embedding(4, 4)),
        "TypeError",
        "needs an nn.Linear",
    ),
    "sequence_dim_not_int": (None, lambda _: MC2ColwiseParallel("1"), "TypeError", "sequence_dim"),
    "sequence_dim_out_of_range": (
        lambda: _col_module(3),
        lambda m: m(torch.ones(2, 3, 6)),
        "ValueError",
        "sequence_dim=3 is out of range for a 3-D input",
    ),
    "sequence_dim_is_feature_dim": (
        lambda: _col_module(2),
        lambda m: m(torch.ones(2, 3, 6)),
        "ValueError",
        "sequence_dim=2 is out of range for a 3-D input",
    ),
    "sequence_not_divisible_module": (
        _row_module,
        lambda m: m(torch.ones(2, 3, 8 // rank_and_size()[1])),
        "ValueError",
        "sequence length 3 (dim 1) is not divisible",
    ),
    "rows_not_divisible_functional": (
        None,
        lambda _: matmul_reduce_scatter(
            torch.ones(2 * rank_and_size()[1] + 1, 4), torch.ones(3, 4)
        ),
        "ValueError",
        "not divisible by the group size",
    ),
    "inner_dims_differ_functional": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 7)),
        "ValueError",
        "inner dims differ",
    ),
    "inner_dims_differ_module": (
        _col_module,
        lambda m: m(torch.ones(2, 3, 5)),
        "ValueError",
        "input has 5 features",
    ),
    "bias_wrong_size_column": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(12)),
        "ValueError",
        "bias must be the local shard [n_local] = (6,)",
    ),
    "bias_wrong_size_row": (
        None,
        lambda _: matmul_reduce_scatter(torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(3)),
        "ValueError",
        "bias must be the full, replicated [n] = (6,)",
    ),
    "dtype_mix_weight": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8, dtype=f64)),
        "TypeError",
        "x is fp32 but weight is fp64",
    ),
    "dtype_mix_bias": (
        None,
        lambda _: matmul_reduce_scatter(
            torch.ones(4, 8), torch.ones(6, 8), bias=torch.ones(6, dtype=torch.bfloat16)
        ),
        "TypeError",
        "x is fp32 but bias is bf16",
    ),
    "dtype_mix_module": (
        _col_module,
        lambda m: m(torch.ones(2, 3, 6, dtype=torch.bfloat16)),
        "TypeError",
        "input is bf16 but the weight/bias are fp32",
    ),
    "x_not_2d": (
        None,
        lambda _: all_gather_matmul(torch.ones(2, 4, 8), torch.ones(6, 8)),
        "ValueError",
        "x must be 2-D",
    ),
    "unknown_impl": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), impl="cuda"),
        "ValueError",
        "impl must be one of",
    ),
    "forced_npu_on_cpu": (
        None,
        lambda _: all_gather_matmul(torch.ones(4, 8), torch.ones(6, 8), impl="npu"),
        "ValueError",
        "impl='npu' cannot run all_gather_matmul: tensors are on cpu, not npu",
    ),
    "zero_chunks": (
        None,
        lambda _: matmul_reduce_scatter(torch.ones(4, 8), torch.ones(6, 8), chunks=0),
        "ValueError",
        "chunks must be a positive int",
    ),
    # --- the gated MLP style and its functional form ---------------------------------------
    "gated_dtensor_input": (
        _gated_module,
        lambda m: m(_seq_dtensor(torch.ones(2, 3, 6))),
        "TypeError",
        "must be this rank's sequence block as a local tensor [B, S/tp, D], got a DTensor",
    ),
    "functional_dtensor_input": (
        None,
        lambda _: all_gather_matmul(_seq_dtensor(torch.ones(4, 8)), torch.ones(6, 8)),
        "TypeError",
        "all_gather_matmul: x is a DTensor",
    ),
    "gated_missing_submodule": (
        None,
        lambda _: _apply_gated(_without_up()),
        "ValueError",
        "_GatedMLP has no up submodule 'up_proj'",
    ),
    "gated_renamed_submodule": (
        None,
        lambda _: _apply_gated(_GatedMLP(), gate="w1"),
        "ValueError",
        "has no gate submodule 'w1'",
    ),
    "gated_bias_on_other_device": (
        None,
        lambda _: _apply_gated(_meta_bias()),
        "ValueError",
        "_GatedMLP.gate_proj.bias is on meta but gate_proj.weight is on cpu",
    ),
    "gated_functional_bias_on_other_device": (
        None,
        lambda _: gated_mlp(
            torch.ones(4, 6),
            torch.ones(8, 6),
            torch.ones(8, 6),
            torch.ones(6, 8),
            act_fn=torch.nn.functional.silu,
            up_bias=torch.ones(8, device="meta"),
        ),
        "ValueError",
        "bias is on meta but weight is on cpu",
    ),
    "gated_softmax_activation": (
        None,
        lambda _: _apply_gated(_GatedMLP(nn.Softmax(dim=-1))),
        "ValueError",
        "act_fn Softmax(dim=-1) is not known to be per-element",
    ),
    "gated_glu_activation": (
        None,
        lambda _: _apply_gated(_GatedMLP(nn.GLU())),
        "ValueError",
        "is not known to be per-element",
    ),
    "gated_activation_with_parameters": (
        None,
        lambda _: _apply_gated(_GatedMLP(nn.PReLU())),
        "ValueError",
        "has parameters",
    ),
    "gated_inplace_activation": (
        None,
        lambda _: _apply_gated(_GatedMLP(nn.ReLU(inplace=True))),
        "ValueError",
        "is in-place",
    ),
    "gated_functional_user_activation": (
        None,
        lambda _: gated_mlp(
            torch.ones(4, 6),
            torch.ones(8, 6),
            torch.ones(8, 6),
            torch.ones(6, 8),
            act_fn=lambda t: t.softmax(-1),
        ),
        "ValueError",
        "is not known to be per-element",
    ),
    "gated_ffn_not_divisible": (
        None,
        lambda _: _apply_gated(_GatedMLP(ffn=4 * rank_and_size()[1] + 1)),
        "ValueError",
        "is not divisible by the tp size",
    ),
    "gated_2d_mesh": (
        None,
        lambda _: parallelize_module(
            _GatedMLP(),
            init_device_mesh("cpu", (rank_and_size()[1], 1), mesh_dim_names=("cp", "tp")),
            MC2GatedMLPParallel(),
        ),
        "ValueError",
        "needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got a 2-D mesh",
    ),
    "gated_permuted_mesh": (
        _permuted_mesh,
        lambda mesh: _apply_gated(_GatedMLP(), mesh),
        "ValueError",
        "differs from its process group's rank order",
    ),
    "colwise_permuted_mesh": (
        _permuted_mesh,
        lambda mesh: parallelize_module(nn.Linear(6, 8), mesh, MC2ColwiseParallel()),
        "ValueError",
        "differs from its process group's rank order",
    ),
    "gated_twice": (
        _gated_module,
        lambda m: _apply_gated(m),
        "RuntimeError",
        "this _GatedMLP is already parallelized",
    ),
    "gated_features_differ": (
        _gated_module,
        lambda m: m(torch.ones(2, 3, 5)),
        "ValueError",
        "input has 5 features but the module's hidden size is 6",
    ),
    "gated_dtype_mix": (
        _gated_module,
        lambda m: m(torch.ones(2, 3, 6, dtype=f64)),
        "TypeError",
        "input is fp64 but the weights are fp32",
    ),
    "gated_sequence_dim_is_feature_dim": (
        lambda: _apply_gated(_GatedMLP(), sequence_dim=2),
        lambda m: m(torch.ones(2, 3, 6)),
        "ValueError",
        "sequence_dim=2 is out of range for a 3-D input",
    ),
    "gated_bad_impl": (
        None,
        lambda _: MC2GatedMLPParallel(impl="cuda"),
        "ValueError",
        "impl must be one of",
    ),
}


def _reject_all(names: list[str]) -> dict:
    traffic = {"n": 0}

    def counting(fn):
        def wrapped(*args, **kwargs):
            traffic["n"] += 1
            return fn(*args, **kwargs)

        return wrapped

    # every hp-mc2 collective starts through hp-dtensor's comm: the recorder sees each launch;
    # parameters are sharded (a broadcast/scatter) only after every check has passed
    block_style.distribute_tensor = counting(block_style.distribute_tensor)  # both MLP styles
    styles.distribute_tensor = counting(styles.distribute_tensor)
    outcome = {}
    for name in names:
        build, call, _, _ = CASES[name]
        module = build() if build is not None else None
        before = traffic["n"]
        with record_events() as rec:
            try:
                call(module)
                outcome[name] = ("no error", "", 0)
            except Exception as exc:
                launched = sum(e.kind == "launch" for e in rec.events)
                outcome[name] = (type(exc).__name__, str(exc), traffic["n"] - before + launched)
    # the group still works: a collective and a real overlapped call
    r, ws = rank_and_size()
    X, W = seeded(1, 4 * ws, 8), seeded(2, 6 * ws, 8)
    y = all_gather_matmul(X[4 * r : 4 * r + 4], W[6 * r : 6 * r + 6], None, chunks=2)
    ok = group_still_works() and max_err(y, X.double() @ W[6 * r : 6 * r + 6].double().t()) < 1e-5
    return {"outcome": outcome, "group_ok": ok, "traffic_total": traffic["n"]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_bad_input_raises_on_every_rank_before_communicating(world_size):
    names = list(CASES)
    results = run_distributed(_reject_all, world_size, names, timeout=TIMEOUT)
    for rank, res in enumerate(results):
        for name in names:
            _, _, want_type, phrase = CASES[name]
            got_type, msg, traffic = res["outcome"][name]
            assert got_type == want_type, (rank, name, got_type, msg)
            assert phrase in msg, (rank, name, msg)
            assert traffic == 0, (rank, name, "communicated before raising")
        assert res["group_ok"], rank
        # the successful call afterwards did communicate through the counted helpers
        assert res["traffic_total"] > 0
    assert all(r["outcome"] == results[0]["outcome"] for r in results)
