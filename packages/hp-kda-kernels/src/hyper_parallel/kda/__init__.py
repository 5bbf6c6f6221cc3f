"""hp-kda-kernels: context parallelism for KDA (Kimi Delta Attention).

Each context-parallel rank holds a contiguous chunk of the sequence; only the recurrent state
crosses ranks, as affine summaries ``h_out = M h_in + S``. See ``kda_context_parallel``;
``parallelize_kda`` wires a stock Hugging Face Kimi-Linear KDA layer (short-convolution halo
via ``causal_conv_halo``, gates and norms local, the recurrence through the state exchange).
"""

from ._version import __version__
from .chunk import chunk_kda, state_summary
from .cost import DEFAULT_COST_PARAMS, CostParams, ProtocolChoice, choose_protocol
from .exchange import PROTOCOLS, PendingExchange, StateExchange, build_state_exchange
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

__all__ = [
    "DEFAULT_COST_PARAMS",
    "KERNELS",
    "PROTOCOLS",
    "SUPPORTED_KDA_CLASSES",
    "is_kda_parallel",
    "ContextParallelKDA",
    "PackedBlock",
    "PendingExchange",
    "PendingHalo",
    "CostParams",
    "ProtocolChoice",
    "StateExchange",
    "__version__",
    "affine_merge",
    "affine_scan",
    "build_state_exchange",
    "causal_conv_halo",
    "choose_backend",
    "choose_kernel",
    "choose_protocol",
    "chunk_kda",
    "kda_context_parallel",
    "naive_recurrent_kda",
    "naive_state_summary",
    "packed_block",
    "parallelize_kda",
    "start_causal_conv_halo",
    "state_summary",
    "unparallelize_kda",
]
