"""hyper_parallel.context_parallel: Ulysses context parallelism for MLA and grouped-query
attention.

Collectives (``ulysses_seq_to_head`` ...), hybrid Ulysses × all-gather attention, the serial
DeepSeek MLA block, ``parallelize_mla`` (expanded or latent strategy, overlapped or blocking;
for this package's block and the stock Hugging Face ``DeepseekV3Attention`` and
``KimiLinearAttention``), ``parallelize_attention`` (the stock ``Qwen3NextAttention``,
``Qwen3Attention`` and ``LlamaAttention``, key/value heads fewer than ranks included) and an
event recorder with Chrome-trace export.
"""

from hyper_parallel.context_parallel._version import __version__
from hyper_parallel.context_parallel.collectives import (
    CollectiveHandle,
    launch_all_gather,
    launch_head_to_seq,
    launch_seq_to_head,
    pending_collectives,
    shard_sequence,
    ulysses_head_to_seq,
    ulysses_seq_to_head,
)
from hyper_parallel.context_parallel.families import SUPPORTED_MLA_CLASSES
from hyper_parallel.context_parallel.gqa import SUPPORTED_ATTENTION_CLASSES
from hyper_parallel.context_parallel.hybrid import hybrid_attention, hybrid_meshes
from hyper_parallel.context_parallel.mla import MLAConfig, MultiHeadLatentAttention
from hyper_parallel.context_parallel.parallel_attention import (
    attention_head_groups,
    parallelize_attention,
    unparallelize_attention,
)
from hyper_parallel.context_parallel.parallel_mla import (
    STRATEGIES,
    ContextParallelMLA,
    is_context_parallel,
    mla_head_groups,
    parallelize_mla,
    unparallelize_mla,
)
from hyper_parallel.context_parallel.recorder import (
    Event,
    EventRecorder,
    current_recorder,
    record_events,
)

__all__ = [
    "STRATEGIES",
    "SUPPORTED_ATTENTION_CLASSES",
    "SUPPORTED_MLA_CLASSES",
    "CollectiveHandle",
    "ContextParallelMLA",
    "Event",
    "EventRecorder",
    "MLAConfig",
    "MultiHeadLatentAttention",
    "__version__",
    "attention_head_groups",
    "current_recorder",
    "hybrid_attention",
    "hybrid_meshes",
    "is_context_parallel",
    "launch_all_gather",
    "launch_head_to_seq",
    "launch_seq_to_head",
    "mla_head_groups",
    "parallelize_attention",
    "parallelize_mla",
    "pending_collectives",
    "record_events",
    "shard_sequence",
    "ulysses_head_to_seq",
    "ulysses_seq_to_head",
    "unparallelize_attention",
    "unparallelize_mla",
]
