"""hyper_parallel.mc2: tensor + sequence parallel linear layers whose all-gather /
reduce-scatter is fused with (Ascend MC2 kernels) or overlapped with (chunked async
collectives) the matmul, in forward and backward; and the gated MLP block
(``down(act(gate(x)) * up(x))``) with one all-gather shared by gate and up, and the plain MLP
block (``down(act(up(x)))``), each one pipeline over row chunks.

The matmul+collective runs in one of several implementations (``impl=``: ``torch``, ``npu``,
``auto``), classes behind one interface in a registry (:mod:`hyper_parallel.mc2.impls`)."""

from hyper_parallel.mc2._chunked import default_chunks
from hyper_parallel.mc2._npu_impl import npu_constraint_failure
from hyper_parallel.mc2._version import __version__
from hyper_parallel.mc2.blocking import (
    all_gather_matmul_reference,
    gated_mlp_reference,
    matmul_reduce_scatter_reference,
    mlp_block_reference,
)
from hyper_parallel.mc2.functional import all_gather_matmul, matmul_reduce_scatter
from hyper_parallel.mc2.gated import gated_mlp
from hyper_parallel.mc2.gated_style import MC2GatedMLPParallel
from hyper_parallel.mc2.impls import select_backend
from hyper_parallel.mc2.linear import MC2Linear, MC2Parallel
from hyper_parallel.mc2.mlp import mlp_block
from hyper_parallel.mc2.mlp_style import MC2MLPParallel
from hyper_parallel.mc2.npu_ops import (
    NpuOps,
    TorchNpuOps,
    current_npu_ops,
    hccl_comm_name,
    use_npu_ops,
)
from hyper_parallel.mc2.parallelized import is_mc2_parallel, unparallelize_mc2
from hyper_parallel.mc2.styles import MC2ColwiseParallel, MC2RowwiseParallel

__all__ = [
    "MC2ColwiseParallel",
    "MC2GatedMLPParallel",
    "MC2Linear",
    "MC2MLPParallel",
    "MC2Parallel",
    "MC2RowwiseParallel",
    "NpuOps",
    "TorchNpuOps",
    "__version__",
    "all_gather_matmul",
    "all_gather_matmul_reference",
    "current_npu_ops",
    "default_chunks",
    "gated_mlp",
    "gated_mlp_reference",
    "hccl_comm_name",
    "is_mc2_parallel",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_reference",
    "mlp_block",
    "mlp_block_reference",
    "npu_constraint_failure",
    "select_backend",
    "unparallelize_mc2",
    "use_npu_ops",
]
