"""hyper_parallel.moe: expert parallelism for the stock Hugging Face MoE experts.

:func:`parallelize_experts` splits the experts of a ``DeepseekV3Experts``-form module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) over a 1-D ep mesh; each rank then calls
the module on its own tokens and gets what the stock module with every expert gives, forward and
every gradient. :func:`moe_block_forward` runs a whole stock MoE block (router, split experts,
shared experts, gated or not, under the first dispatch; :mod:`hyper_parallel.moe.block`).
Dispatch and combine are the steps of a dispatcher (:mod:`hyper_parallel.moe.dispatch`: by
default all-to-alls with split sizes through hp-dtensor's ``comm``; the torch_npu ones in
:mod:`hyper_parallel.moe.npu_dispatch`), chunked so that they run under the expert GEMMs
(:mod:`hyper_parallel.moe.schedule`); the local expert work is one backend class per device
(:mod:`hyper_parallel.moe.local`).
"""

from hyper_parallel.moe._version import __version__
from hyper_parallel.moe.block import moe_block_forward, shared_work
from hyper_parallel.moe.dispatch import (
    DISPATCHERS,
    AllToAllDispatcher,
    Capabilities,
    Dispatcher,
    DispatchHandle,
    register_dispatcher,
    resolve_dispatcher,
    static_refusal,
)
from hyper_parallel.moe.form import FORM, ExpertsShape, experts_shape
from hyper_parallel.moe.local import IMPLS, LocalExperts, select_impl
from hyper_parallel.moe.npu_dispatch import (  # importing it registers the NPU dispatchers
    NpuDistributeDispatcher,
    NpuFusedGmmDispatcher,
    NpuPermuteDispatcher,
)
from hyper_parallel.moe.npu_ops import (  # importing it registers the "npu" backend
    NpuExperts,
    NpuMoeOps,
    TorchNpuOps,
    current_npu_ops,
    use_npu_ops,
)
from hyper_parallel.moe.parallelize import (
    expert_counts,
    experts_info,
    is_experts_parallel,
    parallelize_experts,
    run_experts,
    unparallelize_experts,
)
from hyper_parallel.moe.schedule import (
    AUTO_MAX_CHUNKS,
    ForwardStats,
    choose_chunks,
    experts_parallel_blocking,
    experts_parallel_forward,
)

__all__ = [
    "AUTO_MAX_CHUNKS",
    "DISPATCHERS",
    "FORM",
    "IMPLS",
    "AllToAllDispatcher",
    "Capabilities",
    "DispatchHandle",
    "Dispatcher",
    "ExpertsShape",
    "ForwardStats",
    "LocalExperts",
    "NpuDistributeDispatcher",
    "NpuExperts",
    "NpuFusedGmmDispatcher",
    "NpuMoeOps",
    "NpuPermuteDispatcher",
    "TorchNpuOps",
    "__version__",
    "choose_chunks",
    "current_npu_ops",
    "expert_counts",
    "experts_info",
    "experts_parallel_blocking",
    "experts_parallel_forward",
    "experts_shape",
    "is_experts_parallel",
    "moe_block_forward",
    "parallelize_experts",
    "register_dispatcher",
    "resolve_dispatcher",
    "run_experts",
    "select_impl",
    "shared_work",
    "static_refusal",
    "unparallelize_experts",
    "use_npu_ops",
]
