"""hp-kda-kernels: context parallelism for the gated delta-rule family: KDA (Kimi Delta
Attention) and Gated DeltaNet.

Each context-parallel rank holds a contiguous chunk of the sequence; only the recurrent state
crosses ranks, as affine summaries ``h_out = M h_in + S``. See ``kda_context_parallel``;
``parallelize_kda`` wires a stock Hugging Face Kimi-Linear KDA layer (short-convolution halo
via ``causal_conv_halo``, gates and norms local, the recurrence through the state exchange);
``gated_deltanet_context_parallel`` and ``parallelize_gated_deltanet`` do the same for Gated
DeltaNet (Qwen3-Next, Qwen3.5): KDA with its per-head gate broadcast along the key channels.
"""

from ._version import __version__
from .chunk import chunk_kda, state_summary
from .cost import DEFAULT_COST_PARAMS, CostParams, ProtocolChoice, choose_protocol
from .exchange import PROTOCOLS, PendingExchange, StateExchange, build_state_exchange
from .gated_deltanet import (
    SUPPORTED_GDN_CLASSES,
    ContextParallelGatedDeltaNet,
    gated_deltanet_context_parallel,
    is_gated_deltanet_parallel,
    parallelize_gated_deltanet,
    unparallelize_gated_deltanet,
)
from .halo import PendingHalo, causal_conv_halo, start_causal_conv_halo
from .layer import kda_context_parallel
from .merge import KERNELS, affine_merge, affine_scan, choose_backend, choose_kernel
from .naive import naive_recurrent_kda, naive_state_summary
from .packing import PackedBlock, packed_block
from .parallelize import (
    SUPPORTED_KDA_CLASSES,
    ContextParallelKDA,
    is_kda_parallel,
    parallelize_kda,
    unparallelize_kda,
)
from .stock import (
    LOCAL_KERNELS,
    StockKernel,
    resolve_local_kernel,
    run_stock_with_executor,
    stock_kernel,
)

__all__ = [
    "DEFAULT_COST_PARAMS",
    "KERNELS",
    "LOCAL_KERNELS",
    "PROTOCOLS",
    "SUPPORTED_GDN_CLASSES",
    "SUPPORTED_KDA_CLASSES",
    "is_kda_parallel",
    "ContextParallelGatedDeltaNet",
    "ContextParallelKDA",
    "PackedBlock",
    "PendingExchange",
    "PendingHalo",
    "CostParams",
    "ProtocolChoice",
    "StateExchange",
    "StockKernel",
    "__version__",
    "affine_merge",
    "affine_scan",
    "build_state_exchange",
    "causal_conv_halo",
    "choose_backend",
    "choose_kernel",
    "choose_protocol",
    "chunk_kda",
    "gated_deltanet_context_parallel",
    "is_gated_deltanet_parallel",
    "kda_context_parallel",
    "naive_recurrent_kda",
    "naive_state_summary",
    "packed_block",
    "parallelize_gated_deltanet",
    "parallelize_kda",
    "resolve_local_kernel",
    "run_stock_with_executor",
    "start_causal_conv_halo",
    "state_summary",
    "stock_kernel",
    "unparallelize_gated_deltanet",
    "unparallelize_kda",
]
