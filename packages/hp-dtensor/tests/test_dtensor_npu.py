"""The torch_npu seam (``hyper_parallel.dtensor.npu``) and the base of its test doubles
(``hyper_parallel.dtensor.npu_double``): the default provider never imports a missing
torch_npu and names the ops an installed one lacks; ``use_npu_ops`` nests and restores; a
double names the ops it does not define; HCCL communicator names on both torch_npu
generations; a double's communicator names map back to real gloo groups."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.dtensor import npu
from hyper_parallel.dtensor.npu import (
    TorchNpu,
    current_npu_ops,
    hccl_comm_name,
    use_npu_ops,
)
from hyper_parallel.dtensor.npu_double import NpuDouble
from hyper_parallel.dtensor.testing import run_distributed

TIMEOUT = 90.0
NO_TORCH_NPU = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)


class AddDouble(NpuDouble):
    def npu_add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


# --- the default provider -------------------------------------------------------------------


@NO_TORCH_NPU
def test_provider_without_torch_npu_says_so_and_never_imports_it():
    assert isinstance(current_npu_ops(), TorchNpu)
    provider = TorchNpu()
    assert provider.device_type == "npu"
    assert provider.available() == "torch_npu is not installed"
    assert provider.available(ops=("npu_grouped_matmul",)) == "torch_npu is not installed"
    assert provider.soc_name() is None
    assert not hasattr(provider, "npu_grouped_matmul")
    with pytest.raises(AttributeError, match="npu_grouped_matmul: torch_npu is not installed"):
        _ = provider.npu_grouped_matmul
    with pytest.raises(AttributeError, match="no attribute 'grouped_matmul'"):
        _ = provider.grouped_matmul  # only npu_* names are ops
    assert "torch_npu" not in sys.modules


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """A stand-in ``torch_npu`` package on ``sys.path`` (torch_npu itself is never installed on
    a machine without CANN: importing it there breaks torch)."""

    def write(body: str) -> None:
        (tmp_path / "torch_npu").mkdir()
        (tmp_path / "torch_npu" / "__init__.py").write_text(textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))

    yield write
    sys.modules.pop("torch_npu", None)


@NO_TORCH_NPU
def test_provider_imports_torch_npu_on_first_use_and_names_missing_ops(fake_torch_npu):
    fake_torch_npu(
        """
        __version__ = "2.6.0"

        def npu_grouped_matmul(x, weight, *, group_list=None):
            return ["gmm", x, weight, group_list]

        class npu:
            @staticmethod
            def get_device_name():
                return "Ascend910_9382"
        """
    )
    provider = TorchNpu()
    assert "torch_npu" not in sys.modules  # not at construction
    assert provider.available(ops=("npu_grouped_matmul",)) is None
    assert "torch_npu" in sys.modules
    why = provider.available(ops=("npu_grouped_matmul", "npu_alltoallv_gmm", "npu_x"))
    assert why == "torch_npu 2.6.0 has no npu_alltoallv_gmm, npu_x"
    assert provider.npu_grouped_matmul(1, 2, group_list=3) == ["gmm", 1, 2, 3]
    assert provider.soc_name() == "Ascend910_9382"
    with pytest.raises(AttributeError, match=r"torch_npu 2\.6\.0 has no npu_alltoallv_gmm"):
        _ = provider.npu_alltoallv_gmm


@NO_TORCH_NPU
def test_provider_reports_a_torch_npu_that_fails_to_import(fake_torch_npu):
    fake_torch_npu('raise RuntimeError("libhccl.so: cannot open shared object file")\n')
    provider = TorchNpu()
    why = provider.available(ops=("npu_grouped_matmul",))
    assert why == (
        "torch_npu is not importable (RuntimeError: libhccl.so: cannot open shared object file)"
    )
    assert provider.available() == why and provider.soc_name() is None


# --- one process-wide provider ----------------------------------------------------------------


def test_use_npu_ops_nests_and_restores_even_on_error():
    default = current_npu_ops()
    outer, inner = AddDouble(), AddDouble()
    with use_npu_ops(outer) as got:
        assert got is outer and current_npu_ops() is outer
        with use_npu_ops(inner):
            assert current_npu_ops() is inner
        assert current_npu_ops() is outer
        with pytest.raises(ValueError, match="boom"), use_npu_ops(inner):
            raise ValueError("boom")
        assert current_npu_ops() is outer
    assert current_npu_ops() is default
    assert npu.current_npu_ops is current_npu_ops


def test_the_provider_is_process_wide_not_thread_local():
    import threading

    double, seen = AddDouble(), []
    with use_npu_ops(double):
        t = threading.Thread(target=lambda: seen.append(current_npu_ops()))
        t.start()
        t.join()
    assert seen == [double]


# --- the doubles' base ------------------------------------------------------------------------


def test_a_double_names_the_ops_it_does_not_define():
    double = AddDouble()
    assert double.device_type == "cpu"
    assert double.available() is None
    assert double.available(ops=("npu_add",)) is None
    why = double.available(ops=("npu_add", "npu_mul", "npu_x"))
    assert why == "AddDouble has no npu_mul, npu_x"
    with use_npu_ops(double):
        assert current_npu_ops().npu_add(torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
    assert not hasattr(double, "npu_mul")
    with pytest.raises(AttributeError, match="AddDouble has no npu_mul"):
        _ = double.npu_mul
    with pytest.raises(KeyError, match="unknown hcom 'hcom-x'"):
        double.group_of("hcom-x")


def test_the_doubles_base_runs_its_docstring_example():
    import hyper_parallel.dtensor.npu_double as module

    assert module.__doc__ is not None
    example = module.__doc__.split("Example::\n", 1)[1]
    exec(textwrap.dedent(example), {"__name__": "example"})


# --- HCCL communicator names ------------------------------------------------------------------


class _NewBackend:
    def __init__(self, log):
        self.log = log

    def get_hccl_comm_name(self, rank):
        self.log.append(("backend", rank))
        return f"hcom-new-{rank}"


class _NewGroup:  # torch > 2.0.1: the HCCL backend behind group._get_backend(npu)
    def __init__(self):
        self.log = []

    def _get_backend(self, device):
        self.log.append(("device", device.type))
        return _NewBackend(self.log)


class _OldGroup:  # torch_npu for torch <= 2.0.1: get_hccl_comm_name on the group
    def __init__(self):
        self.log = []

    def get_hccl_comm_name(self, rank):
        self.log.append(("group", rank))
        return f"hcom-old-{rank}"


def _comm_names() -> list:
    # torch.device("npu") needs a registered "npu" device type; name PrivateUse1 so in this
    # throwaway rank process only, as torch_npu does when imported.
    torch.utils.rename_privateuse1_backend("npu")
    out = []
    for version in ("2.1.0", "2.7.1", "2.12.0"):
        g = _NewGroup()
        out.append((hccl_comm_name(g, 3, torch_version=version), g.log))
    g = _OldGroup()
    out.append((hccl_comm_name(g, 5, torch_version="2.0.1"), g.log))
    out.append((hccl_comm_name(g, 1, torch_version="1.11.0"), g.log))
    try:
        hccl_comm_name(object(), 0, torch_version="2.7.1")
        out.append(None)
    except TypeError as exc:
        out.append(str(exc))
    return out


def test_hccl_comm_name_on_both_torch_npu_generations():
    (res,) = run_distributed(_comm_names, 1, timeout=TIMEOUT)
    assert res[:3] == [("hcom-new-3", [("device", "npu"), ("backend", 3)])] * 3
    assert res[3][0] == "hcom-old-5" and res[4][0] == "hcom-old-1"
    assert res[4][1] == [("group", 5), ("group", 1)]
    assert res[5] is not None and "cannot get an HCCL communicator name" in res[5]


def _round_trip() -> dict:
    rank = dist.get_rank()
    double = AddDouble()
    with use_npu_ops(double):
        provider = current_npu_ops()
        world = provider.comm_name(None)
        sub = dist.new_group([0, 1])
        sub_name = provider.comm_name(sub)
        again = provider.comm_name(sub)
        group = double.group_of(sub_name)
        # real gloo communication on the group the name maps back to
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
    return {
        "world_is_default": double.group_of(world) is dist.group.WORLD,
        "sub_is_sub": group is sub,
        "names": (world, sub_name, again),
        "sum": t.item(),
    }


def test_a_doubles_comm_name_maps_back_to_a_real_gloo_group():
    for res in run_distributed(_round_trip, 2, timeout=TIMEOUT):
        world, sub, again = res["names"]
        assert res["world_is_default"] and res["sub_is_sub"]
        assert world != sub and sub == again
        assert res["sum"] == 3.0
