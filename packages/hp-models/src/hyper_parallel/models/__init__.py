"""hyper_parallel.models: stock Hugging Face models parallelised in one call.

``parallelize_model`` applies the four layers to a ``KimiLinearForCausalLM`` /
``DeepseekV3ForCausalLM`` (or their base models) over a ``("cp", "tp")`` mesh: token mixers
context-parallel over the flattened mesh (hp-context-parallel, hp-kda-kernels), dense MLPs
tensor + sequence parallel over ``tp`` (hp-mc2). ``shard_batch`` cuts a batch into this rank's
sequence block, ``gather_sequence`` puts a block-sharded tensor back together and
``sync_gradients`` sums the gradients so they equal the serial model's. ``from_pretrained``
loads a downloaded Hugging Face folder straight into a parallelised model, each rank reading
only its own slices; the parallelised model's ``save_pretrained`` writes one back from every
rank, without gathering it.
"""

from hyper_parallel.models._version import __version__
from hyper_parallel.models.batch import IGNORE_INDEX, gather_sequence, shard_batch
from hyper_parallel.models.clip import clip_grad_norm_
from hyper_parallel.models.experts import balance_experts
from hyper_parallel.models.families import supported_classes
from hyper_parallel.models.grads import sync_gradients
from hyper_parallel.models.loss import global_mean_loss
from hyper_parallel.models.mesh import SequenceMesh, sequence_mesh
from hyper_parallel.models.parallelize import parallelize_model
from hyper_parallel.models.pipeline import PipelinedModel, pipeline_model
from hyper_parallel.models.plan import MemoryPlan, plan_memory
from hyper_parallel.models.pretrained import LoadReport, from_pretrained, load_report
from hyper_parallel.models.state import ParallelPlan, is_model_parallelized

__all__ = [
    "IGNORE_INDEX",
    "LoadReport",
    "MemoryPlan",
    "ParallelPlan",
    "PipelinedModel",
    "SequenceMesh",
    "__version__",
    "balance_experts",
    "clip_grad_norm_",
    "from_pretrained",
    "gather_sequence",
    "global_mean_loss",
    "is_model_parallelized",
    "load_report",
    "parallelize_model",
    "pipeline_model",
    "plan_memory",
    "sequence_mesh",
    "shard_batch",
    "supported_classes",
    "sync_gradients",
]
