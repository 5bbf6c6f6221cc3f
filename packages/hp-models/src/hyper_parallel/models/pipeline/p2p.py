"""torch 2.7's pipelining waits on one of several point-to-point works on gloo: the fix,
applied while a step runs.

``torch.distributed.pipelining.schedules._batch_p2p`` keeps only the last of the works that
``batch_isend_irecv`` returns, up to torch 2.7. NCCL and HCCL
coalesce a batch into one work, but gloo returns one work an op, so a schedule that batches a
send with a receive (1F1B's steady state) waits on one of them and the ranks deadlock
(pytorch/pytorch#132644, fixed in torch 2.8 by waiting on every work). :func:`every_work`
swaps in, for the duration of a step, a ``_batch_p2p`` that starts each op through
hp-dtensor's runtime and whose result waits on every work of the batch; on a torch whose
``_batch_p2p`` does not pop it does nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from hyper_parallel.dtensor import comm
from hyper_parallel.models.state import OWNER

__all__ = ["every_work", "needs_fix"]


class _Works:
    """The works of one batch, waited on together."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, *args: Any) -> bool:
        for w in self.works:
            w.wait()
        return True


def _batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> _Works | None:
    """Each op of the batch started through hp-dtensor's runtime (recorded and profiled as
    ``send:pipeline`` / ``recv:pipeline``), in order, every work kept."""
    if len(p2p_ops) == 0:
        return None
    works = []
    for op in p2p_ops:
        pg: Any = op.group if op.group is not None else dist.group.WORLD
        g = comm.resolve_group(pg, "the pipeline's point-to-point")
        peer = dist.get_group_rank(pg, op.peer)
        if op.op in (dist.isend, dist.send):
            w = comm.start_send(op.tensor, peer, g, "send:pipeline", "pipeline", OWNER, tag=op.tag)
        else:
            w = comm.start_recv(op.tensor, peer, g, "recv:pipeline", "pipeline", OWNER, tag=op.tag)
        works.append(w)
    return _Works(works)


def needs_fix() -> bool:
    """Whether this torch's ``_batch_p2p`` keeps one work of a batch (torch <= 2.7)."""
    from torch.distributed.pipelining import schedules

    fn = getattr(schedules, "_batch_p2p", None)
    if fn is None:
        return False
    try:
        return ".pop()" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


@contextlib.contextmanager
def every_work() -> Iterator[None]:
    """While in the block, torch's schedules wait on every work of each point-to-point batch
    (see the module docstring); restored on exit."""
    if not needs_fix():
        yield
        return
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p
    schedules._batch_p2p = _batch_p2p  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = original
