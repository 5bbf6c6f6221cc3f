"""The causal short-convolution halo: the ``W − 1`` rows before a rank's block, from its peers.

A causal depthwise convolution of width ``W`` over the sequence reads, for token ``t``, the
pre-convolution rows ``t − W + 1 … t``. With the sequence split into contiguous blocks across
the ranks of a 1-D mesh (rank ``r`` holds block ``r``), the first ``W − 1`` outputs of a block
need the last ``W − 1`` rows of everything before it: the halo. On the first rank the halo is
zeros, exactly the serial convolution's zero padding.

Exchange (forward): every rank posts one receive from its predecessor and one send to its
successor, whatever the block lengths. The row block a rank sends is the last ``W − 1`` rows of
``[halo ; block]``: a block of at least ``W − 1`` rows sends its own tail at once (no
dependency, one hop in total); a shorter block (empty included) first waits for its own halo
and forwards the rows it passes on, so the halo spans as many ranks as it has to. Backward is
the mirror image: the gradient of a rank's halo goes to its predecessor, and the gradient of
the rows a rank sent comes back from its successor; a short block adds the part that belongs
to the rows it forwarded before sending its halo gradient on. Waits only ever point towards
the first rank (forward) or the last rank (backward), so the chain cannot deadlock.

:func:`start_causal_conv_halo` launches the exchange and returns a :class:`PendingHalo`;
``wait()`` returns the halo. Work placed between the two (e.g. a layer's gate projections)
overlaps the transfer, in the backward pass too: the gradient exchange is launched by the
``wait`` node's backward and completed by the launch node's backward. The two nodes are
hp-dtensor's overlapped-exchange node pair (:mod:`hyper_parallel.dtensor.overlap`) driving the
:class:`PendingHalo`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hyper_parallel.dtensor import comm, overlap
from hyper_parallel.dtensor.consistency import checked_entry

__all__ = ["PendingHalo", "causal_conv_halo", "start_causal_conv_halo"]

_TAG_FWD, _TAG_BWD = 7311, 7312
OWNER = "kda"  # the owner tag of this package's collectives (hp-dtensor's comm)


def _route(mesh_or_group: Any) -> tuple[comm.Group, int | None, int | None, str | None]:
    """``(group in block order, previous group rank or None, next group rank or None, mesh
    device type)``."""
    from hyper_parallel.dtensor import DeviceMesh, rank_list

    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(f"the halo mesh must be 1-D, got {mesh_or_group!r}")
        ranks = list(rank_list(mesh_or_group))
        group, device_type = mesh_or_group.get_group(0), str(mesh_or_group.device_type)
    elif isinstance(mesh_or_group, ProcessGroup):
        group, device_type = mesh_or_group, None
        ranks = [dist.get_global_rank(group, i) for i in range(group.size())]
    else:
        raise ValueError(
            "causal_conv_halo needs a 1-D DeviceMesh or a ProcessGroup (ranks in block order), "
            f"got {type(mesh_or_group).__name__}"
        )
    me = ranks.index(dist.get_rank())
    # By hand, not comm.resolve_group: a mesh's block order may differ from its group's rank
    # order here (resolve_group rejects such a mesh), and the errors name the halo.
    g = comm.Group(group, len(ranks), me, tuple(ranks), device_type)  # indices in block order
    return g, g.prev, g.next, device_type


def _check(x: Any, width: Any, seq_dim: Any) -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(
            f"width must be a positive int (the convolution's kernel size), got {width!r}"
        )
    if (
        not isinstance(seq_dim, int)
        or isinstance(seq_dim, bool)
        or not -x.dim() <= seq_dim < x.dim()
    ):
        raise ValueError(f"seq_dim {seq_dim!r} is not a dim of x with shape {tuple(x.shape)}")
    return seq_dim % x.dim()


class PendingHalo:
    """A halo exchange in flight; :meth:`wait` returns the halo (differentiable).

    Owns every piece of the exchange's state: the communication handles and buffers of both
    directions, written and read only by its own methods. ``start`` / ``finish`` /
    ``start_grad`` / ``finish_grad`` are what hp-dtensor's overlap node pair calls (the
    launch node in the constructor, the wait node in :meth:`wait`); callers use :meth:`wait`.
    """

    def __init__(
        self,
        x: torch.Tensor,
        width: int,
        seq_dim: int,
        group: comm.Group,
        prev: int | None,
        nxt: int | None,
    ) -> None:
        """Launch the exchange for ``x`` (validated by :func:`start_causal_conv_halo`)."""
        self._n = width - 1
        self._seq_dim = seq_dim
        self._m = 0  # rows of this rank's own block that enter the outgoing rows
        self._works: list[Any] = []
        self._keep: list[torch.Tensor] = []  # buffers of sends in flight
        self._recv_grad: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None  # the receive buffer, from start to finish
        self._waited = False
        self._token: torch.Tensor | None = None  # the launch node's token
        self._zeros: torch.Tensor | None = None  # the halo when nothing is exchanged
        T, n = x.shape[seq_dim], self._n
        if n == 0 or (prev is None and nxt is None):  # nothing to exchange
            self._group, self._prev, self._next = group, None, None
            shape = list(x.shape)
            shape[seq_dim] = n
            self._zeros = x.new_zeros(shape)
            return
        self._group, self._prev, self._next = group, prev, nxt
        tail = x.narrow(seq_dim, T - min(T, n), min(T, n)).movedim(seq_dim, 0)
        self._token = overlap.launch(self, tail)

    # ---- the exchange the overlap node pair drives ------------------------------------------
    def start(self, tail: torch.Tensor) -> None:
        """Forward launch (the launch node): ``tail`` is the block's last rows."""
        self._buf = self._launch(tail.detach())

    def finish(self) -> torch.Tensor:
        """Forward completion (the wait node): the received rows ``[W−1, *rest]``."""
        self._finish()
        buf, self._buf = self._buf, None
        assert buf is not None
        return buf

    def start_grad(self, grad: torch.Tensor) -> None:
        """Backward launch (the wait node's backward): ``grad`` is the halo's gradient."""
        self._launch_backward(grad)

    def finish_grad(self) -> torch.Tensor:
        """Backward completion (the launch node's backward): the gradient of ``tail``."""
        return self._finish_backward()

    # ---- forward ----------------------------------------------------------------------------
    def _launch(self, tail: torch.Tensor) -> torch.Tensor:
        """``tail``: the block's last ``m = min(T, W−1)`` rows, ``[m, *rest]``. Returns the
        receive buffer ``[W−1, *rest]`` (filled once the exchange completes)."""
        n, m = self._n, tail.shape[0]
        self._m = m
        buf = tail.new_zeros(n, *tail.shape[1:])
        recv = None
        if self._prev is not None:
            recv = comm.start_recv(
                buf, self._prev, self._group, "recv:halo", "forward", OWNER, tag=_TAG_FWD
            )
        if self._next is not None:
            if m < n and recv is not None:  # a short block forwards rows of its own halo
                recv.wait()
                recv = None
            out = tail if m == n else torch.cat([buf[m:], tail])
            out = out.contiguous()
            self._keep.append(out)
            self._works.append(
                comm.start_send(
                    out, self._next, self._group, "send:halo", "forward", OWNER, tag=_TAG_FWD
                )
            )
        if recv is not None:
            self._works.insert(0, recv)  # the receive is waited for first
        return buf

    def _finish(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._keep.clear()

    # ---- backward ---------------------------------------------------------------------------
    def _launch_backward(self, grad_halo: torch.Tensor) -> None:
        """``grad_halo [W−1, *rest]``: this rank's halo gradient; send it (plus, for a short
        block, the gradient of the forwarded rows) to the predecessor."""
        n, m = self._n, self._m
        grad_out = grad_halo.new_zeros(grad_halo.shape)  # gradient of the rows this rank sent
        recv = None
        if self._next is not None:
            recv = comm.start_recv(
                grad_out, self._next, self._group, "recv:dhalo", "backward", OWNER, tag=_TAG_BWD
            )
        self._recv_grad = grad_out
        if self._prev is not None:
            to_prev = grad_halo.contiguous()
            if m < n:
                if recv is not None:
                    recv.wait()
                    recv = None
                to_prev = to_prev.clone()
                to_prev[m:] += grad_out[: n - m]
            self._keep.append(to_prev)
            self._works.append(
                comm.start_send(
                    to_prev, self._prev, self._group, "send:dhalo", "backward", OWNER, tag=_TAG_BWD
                )
            )
        if recv is not None:
            self._works.insert(0, recv)

    def _finish_backward(self) -> torch.Tensor:
        """Gradient of the block's last ``m`` rows, ``[m, *rest]``."""
        self._finish()
        grad_out, self._recv_grad = self._recv_grad, None
        assert grad_out is not None
        return grad_out[self._n - self._m :]

    # ---- public -----------------------------------------------------------------------------
    def wait(self) -> torch.Tensor:
        """Complete the exchange; returns the halo: ``x``'s shape with ``W − 1`` rows along
        ``seq_dim`` (zeros on the first rank). Call once."""
        if self._waited:
            raise RuntimeError("PendingHalo.wait() was already called")
        self._waited = True
        if self._token is None:
            zeros, self._zeros = self._zeros, None
            assert zeros is not None
            return zeros
        token, self._token = self._token, None
        return overlap.wait(self, token).movedim(0, self._seq_dim)


def _seq_dim(args: Any) -> int:
    """The sequence dim itself (-2 and 1 of a 3-D ``x`` agree)."""
    return int(args.seq_dim % args.x.dim())


@checked_entry(
    "causal_conv_halo",
    compare=("width",),
    group="mesh",
    extra={
        "x_without_seq_dim": lambda args: tuple(
            n for d, n in enumerate(args.x.shape) if d != _seq_dim(args)
        ),
        "dtype": lambda args: str(args.x.dtype),
        "device": lambda args: args.x.device.type,
        "seq_dim": _seq_dim,
        "needs_grad": lambda args: torch.is_grad_enabled() and bool(args.x.requires_grad),
    },
)
def start_causal_conv_halo(
    x: torch.Tensor, width: int, mesh: Any, *, seq_dim: int = 1
) -> PendingHalo:
    """Launch the halo exchange for a causal convolution of kernel size ``width``.

    ``x``: this rank's block of pre-convolution rows (any shape; the sequence runs along
    ``seq_dim``, any length including 0; the other dims must match across ranks). ``mesh``: a
    1-D DeviceMesh (or a ProcessGroup) whose rank order is the block order. Returns a
    :class:`PendingHalo`; its ``wait()`` gives the ``width − 1`` rows preceding the block in the
    global sequence (zeros where the sequence has none). Differentiable: the halo's gradient
    returns to the ranks whose rows it holds. Every rank must call it (and, when gradients are
    needed, run backward through the halo) in the same order. Errors (``ValueError``) are
    raised before any communication.

    Consistency mode (hp-dtensor's README, "Ranks that disagree"): called on its own (not
    inside a ``parallelize_kda``-ed forward, whose signature covers it), the ranks first compare
    ``x``'s shape without its sequence dim (block lengths may differ), its dtype and device
    type, ``width``, ``seq_dim`` and whether gradients will flow; the halo's backward compares
    nothing.
    """
    seq_dim = _check(x, width, seq_dim)
    group, prev, nxt, device_type = _route(mesh)
    if device_type is not None and x.device.type != device_type:
        raise ValueError(f"x is on {x.device} but the mesh is a {device_type!r} mesh")
    return PendingHalo(x, width, seq_dim, group, prev, nxt)


def causal_conv_halo(x: torch.Tensor, width: int, mesh: Any, *, seq_dim: int = 1) -> torch.Tensor:
    """The ``width − 1`` pre-convolution rows before this rank's block (blocking form of
    :func:`start_causal_conv_halo`); ``torch.cat([halo, x], seq_dim)`` convolved without
    padding gives the serial causal convolution's outputs for the block."""
    return start_causal_conv_halo(x, width, mesh, seq_dim=seq_dim).wait()
