"""The ``npu`` backend's provider is hp-dtensor's one torch_npu seam: a double installed with
``hyper_parallel.dtensor.npu.use_npu_ops`` is what ``NpuExperts`` calls, and its availability
is asked for the three ops by name."""

from __future__ import annotations

import pytest
import torch
from _moe_npu_double import NpuMoeOpsDouble
from _moe_testutil import E, H

import hyper_parallel.dtensor.npu as seam
import hyper_parallel.moe as moe
from hyper_parallel.moe import ExpertsShape, NpuExperts, select_impl
from hyper_parallel.moe.npu_ops import MOE_OPS

SHAPE = ExpertsShape(E, H, 8)


class _NoGroupedMatmul(NpuMoeOpsDouble):
    npu_grouped_matmul = None  # a torch_npu without the grouped matmul


def test_the_layers_seam_is_hp_dtensors():
    assert moe.current_npu_ops is seam.current_npu_ops
    assert moe.use_npu_ops is seam.use_npu_ops
    assert moe.TorchNpuOps is seam.TorchNpu
    assert MOE_OPS == ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul")


def test_a_double_installed_through_hp_dtensor_is_what_the_backend_calls():
    double = NpuMoeOpsDouble()
    hidden = torch.randn(3, H)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    with seam.use_npu_ops(double):
        assert moe.current_npu_ops() is double
        assert select_impl("npu", "cpu", torch.float32, SHAPE)[0].name == "npu"
        NpuExperts().permute(hidden, idx)
    assert double.ops() == ["npu_moe_token_permute"]
    assert not isinstance(moe.current_npu_ops(), NpuMoeOpsDouble)  # restored


def test_availability_names_the_op_the_provider_lacks():
    with seam.use_npu_ops(_NoGroupedMatmul()):
        with pytest.raises(ValueError, match="_NoGroupedMatmul has no npu_grouped_matmul"):
            select_impl("npu", "cpu", torch.float32, SHAPE)
    with seam.use_npu_ops(_NoGroupedMatmul(device_type="npu")):  # as on an NPU machine
        backend, why = select_impl("auto", "npu", torch.bfloat16, SHAPE)
    assert backend.name == "torch" and "_NoGroupedMatmul has no npu_grouped_matmul" in why
