"""Pipeline parallelism for the stock models: :func:`pipeline_model` cuts a causal LM into
stages over a ``"pp"`` mesh dim (:mod:`.split` chooses the layers, :mod:`.stages` builds each
stage, :mod:`.schedules` names torch's schedules) and :class:`PipelinedModel` runs a step."""

from hyper_parallel.models.pipeline.model import PipelinedModel, pipeline_model, split_mesh
from hyper_parallel.models.pipeline.schedules import SCHEDULES

__all__ = ["SCHEDULES", "PipelinedModel", "pipeline_model", "split_mesh"]
