"""hyper_parallel.dtensor: torch DeviceMesh/DTensor made dependable across torch versions.

``DeviceMesh``, ``DTensor`` and the placements are torch's own objects. This package adds
mesh unflatten/flatten that keep the root and sibling groups, a process-group cache, rank
order checks, the autocast boundary of fused functions (:mod:`hyper_parallel.dtensor.amp`),
pure layout algebra (:mod:`hyper_parallel.dtensor.layout`), the sequence context every
context-parallel token mixer shares (:mod:`hyper_parallel.dtensor.sequence`) and the multi-rank
test harness (:mod:`hyper_parallel.dtensor.testing`).
"""

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from hyper_parallel.dtensor._version import __version__
from hyper_parallel.dtensor.collectives import all_gather_single, reduce_scatter_single
from hyper_parallel.dtensor.consistency import (
    InconsistentRanksError,
    check_consistent,
    checked_entry,
    consistency_checks,
)
from hyper_parallel.dtensor.fingerprint import SequenceMismatchError
from hyper_parallel.dtensor.mesh import (
    check_rank_order,
    flatten,
    init_device_mesh,
    rank_list,
    root_mesh,
    unflatten,
)
from hyper_parallel.dtensor.sequence import (
    SequenceContext,
    check_documents,
    gather_sequence_context,
    sequence_context,
)

__all__ = [
    "DTensor",
    "InconsistentRanksError",
    "DeviceMesh",
    "Partial",
    "Replicate",
    "SequenceContext",
    "SequenceMismatchError",
    "Shard",
    "__version__",
    "all_gather_single",
    "check_consistent",
    "check_documents",
    "check_rank_order",
    "checked_entry",
    "consistency_checks",
    "distribute_tensor",
    "flatten",
    "gather_sequence_context",
    "init_device_mesh",
    "rank_list",
    "reduce_scatter_single",
    "root_mesh",
    "sequence_context",
    "unflatten",
]
