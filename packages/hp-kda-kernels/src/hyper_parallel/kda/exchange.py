"""State exchange across context-parallel ranks: p2p, allgather, grouped and auto.

Rank ``r`` of a 1-D mesh holds chunk ``r`` of the sequence and its summary ``(S_r, M_r)``.
``forward(S, M)`` returns the state entering rank ``r`` (the forward prefix fold);
``backward(G, M)`` takes ``G_r = ∂L_r/∂h_in(r)`` and returns the gradient arriving at rank
``r``'s outgoing state (the transposed suffix fold). Executors keep no tensors between calls, so
any number of exchanges may be in flight and their backwards may run in any order, as long as
every rank issues them in the same order.

``start_forward`` / ``start_backward`` launch an exchange and return a :class:`PendingExchange`
whose ``wait()`` gives the result, so a caller can compute between the two. What can be in
flight depends on the protocol: an all-gather is launched asynchronously and folded at
``wait()``; the p2p chain's first rank sends and its last rank posts its receive at the start
and waits at ``wait()``, while a middle rank must receive before it can send, so it receives,
folds and launches its send at the start and only completes the send at ``wait()`` (the chain
is never delayed by a rank's own compute); ``grouped`` launches its in-group all-gather and the
in-group broadcast at the start, and a group's last rank runs its link of the chain of group
leaders (gather, receive, scan, send) at the start too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import comm
from hyper_parallel.dtensor.consistency import checked_entry

from ._checks import check_summary_pair
from ._renamed import accepts_backend
from .cost import CostParams, ProtocolChoice, choose_protocol, grouped_widths
from .halo import OWNER
from .merge import KERNELS, affine_merge, affine_scan, choose_kernel

__all__ = ["PROTOCOLS", "PendingExchange", "StateExchange", "build_state_exchange"]

PROTOCOLS = ("p2p", "allgather", "grouped", "auto")

_TAG_FWD, _TAG_BWD = 7301, 7302


def _validate(S: torch.Tensor, M: torch.Tensor, device_type: str, kernel: str, what: str) -> None:
    *_, K, V = check_summary_pair(S, M, lead=0, what=what)
    if S.device.type != device_type:
        raise ValueError(f"{what}: tensors on {S.device} but the mesh is a {device_type!r} mesh")
    choose_kernel(S.device, K, V, kernel)


class PendingExchange:
    """One exchange in flight (from :meth:`StateExchange.start_forward` or
    :meth:`~StateExchange.start_backward`); :meth:`wait` completes it and returns the result."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish

    def wait(self) -> torch.Tensor:
        """Complete the exchange: the state ``[B, H, K, V]`` (call once)."""
        if self._finish is None:
            raise RuntimeError("PendingExchange.wait() was already called")
        finish, self._finish = self._finish, None
        with torch.no_grad():
            return finish()


def _waiting(works: list[Any], result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A finisher: wait for ``works`` (in order), then ``result()``."""

    def finish() -> torch.Tensor:
        for work in works:
            work.wait()
        return result()

    return finish


def _exchange_fields(states: str) -> dict[str, Callable[[Any], Any]]:
    """The consistency fields of a blocking exchange (:meth:`StateExchange.forward` /
    ``backward``; ``states``: the argument holding them), over the executor's group. The
    launches ``start_forward`` / ``start_backward`` compare nothing: inside
    ``kda_context_parallel`` (and a ``parallelize_kda``-ed forward) the entry point's signature
    fixes their shapes and protocol, forward and backward."""
    return {
        "states": lambda args: getattr(args, states), "maps": lambda args: args.M,
        "protocol": lambda args: args.self.protocol,
        "group_size": lambda args: args.self.group_size,
        "kernel": lambda args: args.self.kernel, "world_size": lambda args: args.self.world_size,
    }  # fmt: skip


def _executor_group(args: Any) -> Any:
    return args.self.group


class StateExchange:
    """Base executor: validation, the rank's position and the protocol's two directions."""

    protocol: str = ""

    @accepts_backend("StateExchange")
    def __init__(self, mesh: Any, ranks: tuple[int, ...], group: Any, kernel: str) -> None:
        self.mesh = mesh
        self.ranks = ranks
        self.group = group
        self.world_size = len(ranks)
        self.position = ranks.index(dist.get_rank())
        self.kernel = kernel  # the merge/scan fold kernel ("auto", "torch", "triton")
        self.group_size: int | None = None
        # the group for hp-dtensor's comm (the mesh's rank order is its group's, checked by
        # build_state_exchange: group ranks = positions here)
        self.comm_group = comm.resolve_group(mesh, "the KDA state exchange")

    @checked_entry("StateExchange.forward", group=_executor_group, extra=_exchange_fields("S"))
    def forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """``S: [B, H, K, V]``, ``M: [B, H, K, K]`` fp32 (this rank's summary) → ``h_in(r)``
        ``[B, H, K, V]`` (zeros on the first rank). Consistency mode (hp-dtensor's README,
        "Ranks that disagree"): the ranks first compare ``S``, ``M``, the protocol, the group
        size, the fold kernel and the world size."""
        return self.exchange_forward(S, M)

    @checked_entry("StateExchange.backward", group=_executor_group, extra=_exchange_fields("G"))
    def backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """``G: [B, H, K, V]`` (``∂L_r/∂h_in(r)``), ``M`` this rank's map → the gradient at
        this rank's outgoing state (zeros on the last rank). Consistency mode as
        :meth:`forward`."""
        return self.exchange_backward(G, M)

    def exchange_forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the consistency check (the caller made it)."""
        return self.start_forward(S, M).wait()

    def exchange_backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """:meth:`backward` without the consistency check (the caller made it)."""
        return self.start_backward(G, M).wait()

    def start_forward(self, S: torch.Tensor, M: torch.Tensor) -> PendingExchange:
        """Launch :meth:`exchange_forward`; ``wait()`` on the result gives ``h_in(r)``. Compute
        placed between the two overlaps the transfers in flight (see the module docstring)."""
        _validate(S, M, self._device_type(), self.kernel, f"{self.protocol} forward")
        with torch.no_grad():
            return PendingExchange(self._start_forward(S.detach(), M.detach()))

    def start_backward(self, G: torch.Tensor, M: torch.Tensor) -> PendingExchange:
        """Launch :meth:`exchange_backward`; ``wait()`` gives the gradient at this rank's
        outgoing state."""
        _validate(G, M, self._device_type(), self.kernel, f"{self.protocol} backward")
        with torch.no_grad():
            return PendingExchange(self._start_backward(G.detach(), M.detach()))

    @property
    def backend(self) -> str:
        """Deprecated name of :attr:`kernel` (warns)."""
        warnings.warn(
            "StateExchange.backend is deprecated, read StateExchange.kernel",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.kernel

    def _device_type(self) -> str:
        return str(getattr(self.mesh, "device_type", "cpu"))

    def _start_forward(self, S: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Launch the forward exchange; returns its finisher (completes it, returns h_in)."""
        raise NotImplementedError

    def _start_backward(self, G: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        width = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"{type(self).__name__}(protocol={self.protocol!r}{width}, "
            f"position={self.position}/{self.world_size})"
        )


def _step(
    S: torch.Tensor, M: torch.Tensor, x: torch.Tensor, forward: bool, kernel: str
) -> torch.Tensor:
    out = affine_scan(
        (S.unsqueeze(0), M.unsqueeze(0)), x, range(0, 1), forward=forward, kernel=kernel
    )
    assert isinstance(out, torch.Tensor)
    return out


class _P2P(StateExchange):
    protocol = "p2p"

    def _chain(self, S: torch.Tensor, M: torch.Tensor, forward: bool) -> Callable[[], torch.Tensor]:
        P, r = self.world_size, self.position
        prev, nxt = (r - 1, r + 1) if forward else (r + 1, r - 1)
        tag = _TAG_FWD if forward else _TAG_BWD
        phase, g = ("forward", "state") if forward else ("backward", "dstate"), self.comm_group
        acc = torch.zeros_like(S, memory_format=torch.contiguous_format)
        works: list[Any] = []
        if 0 <= prev < P:
            recv = comm.start_recv(acc, prev, g, f"recv:{phase[1]}", phase[0], OWNER, tag=tag)
            if 0 <= nxt < P:  # a middle rank sends what it received, folded: receive now
                recv.wait()
            else:  # the chain's end: the receive stays in flight until wait()
                works.append(recv)
        if 0 <= nxt < P:
            out = _step(S, M, acc, forward, self.kernel)
            works.append(comm.start_send(out, nxt, g, f"send:{phase[1]}", phase[0], OWNER, tag=tag))
        return _waiting(works, lambda: acc)  # the finisher keeps the send buffer alive

    def _start_forward(self, S: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._chain(S, M, True)

    def _start_backward(self, G: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._chain(G, M, False)


def _start_gather(
    S: torch.Tensor, M: torch.Tensor, width: int, group: comm.Group | None, forward: bool
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Launch the all-gather of ``[S | M]`` over ``group`` (asynchronously; ``None`` for a
    width of 1); the returned function waits for it and returns views ``(states [w, ...],
    matrices [w, ...])`` of the one packed buffer."""
    V = S.shape[-1]
    packed = torch.cat([S, M], dim=-1)
    work = None
    if width == 1 or group is None:
        gathered = packed.unsqueeze(0)
    else:
        # Concatenated along dim 0 (the form every backend accepts), then viewed per slot.
        name, phase = (
            ("all_gather:state", "forward") if forward else ("all_gather:dstate", "backward")
        )
        work = comm.start_all_gather(packed, 0, group, name, phase, OWNER)
        gathered = None

    def done() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal gathered, work
        if work is not None:
            gathered, work = work.wait().view(width, *packed.shape), None
        assert gathered is not None
        return gathered[..., :V], gathered[..., V:]

    return done


class _AllGather(StateExchange):
    protocol = "allgather"

    def _start(self, S: torch.Tensor, M: torch.Tensor, forward: bool) -> Callable[[], torch.Tensor]:
        gathered = _start_gather(S, M, self.world_size, self.comm_group, forward)

        def finish() -> torch.Tensor:
            states, maps = gathered()
            return affine_merge(states, maps, self.position, forward=forward, kernel=self.kernel)

        return finish

    def _start_forward(self, S: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._start(S, M, True)

    def _start_backward(self, G: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._start(G, M, False)


class _Grouped(StateExchange):
    protocol = "grouped"

    def __init__(
        self, mesh: Any, ranks: tuple[int, ...], group: Any, kernel: str, width: int
    ) -> None:
        super().__init__(mesh, ranks, group, kernel)
        self.group_size = width
        P = self.world_size
        if width in (1, P):
            self.member_group = group if width == P else None
        else:
            from hyper_parallel.dtensor import unflatten

            names = mesh.mesh_dim_names
            if not names:
                raise ValueError("grouped exchange needs a mesh with a dim name (for unflatten)")
            base = names[0]
            sub = unflatten(
                mesh,
                0,
                (P // width, width),
                (f"{base}_kda_groups{width}", f"{base}_kda_member{width}"),
            )
            self.member_group = sub.get_group(1)
        self.member_comm = (
            None if self.member_group is None else comm.resolve_group(self.member_group)
        )

    def _start(self, S: torch.Tensor, M: torch.Tensor, forward: bool) -> Callable[[], torch.Tensor]:
        """Forward: groups of ``w`` consecutive ranks, each group's last rank a link of the
        chain of group leaders (to the next group's last rank), then broadcasting the incoming
        state in its group. Backward mirrors it: the first rank of each group leads, the chain
        runs towards rank 0, the scans are transposed and run from the group's end."""
        w, r = self.group_size or 1, self.position
        n_groups, gi, i = self.world_size // w, r // w, r % w
        lead_i = w - 1 if forward else 0  # the group's leader
        has_prev = gi > 0 if forward else gi < n_groups - 1  # a group the chain comes from
        has_next = gi < n_groups - 1 if forward else gi > 0
        step = w if forward else -w  # to the next group's leader, in the chain's direction
        tag = _TAG_FWD if forward else _TAG_BWD
        gathered = _start_gather(S, M, w, self.member_comm, forward)
        phase, what = ("forward", "state") if forward else ("backward", "dstate")
        g = self.comm_group
        incoming: torch.Tensor | None = None
        own: torch.Tensor | None = None
        works: list[Any] = []
        if i == lead_i:  # this rank's link of the leaders' chain runs now: it never waits
            maps = gathered()
            if has_prev:
                incoming = torch.empty_like(S, memory_format=torch.contiguous_format)
                comm.start_recv(incoming, r - step, g, f"recv:{what}", phase, OWNER, tag=tag).wait()
            order = range(0, w) if forward else range(w - 1, -1, -1)
            own, out = affine_scan(
                maps, incoming, order, forward=forward, prefix_count=w - 1, kernel=self.kernel
            )
            if has_next:
                works.append(
                    comm.start_send(out, r + step, g, f"send:{what}", phase, OWNER, tag=tag)
                )
        if has_prev and w > 1:
            if incoming is None:
                incoming = torch.empty_like(S, memory_format=torch.contiguous_format)
            member = self.member_comm
            assert member is not None
            src = member.ranks.index(self.ranks[gi * w + lead_i])  # the leader, in its group
            works.append(
                comm.start_broadcast(incoming, src, member, f"broadcast:{what}", phase, OWNER)
            )

        def finish() -> torch.Tensor:
            for work in works:
                work.wait()
            if own is not None:
                return own
            order = range(0, i) if forward else range(w - 1, i, -1)
            result = affine_scan(gathered(), incoming, order, forward=forward, kernel=self.kernel)
            assert isinstance(result, torch.Tensor)
            return result

        return finish

    def _start_forward(self, S: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._start(S, M, True)

    def _start_backward(self, G: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._start(G, M, False)


class _Auto(StateExchange):
    """Resolves the protocol per call from the summary shape with :func:`choose_protocol`.

    Every candidate executor (and the grouped sub-meshes) is built up front, so a call never
    creates process groups."""

    protocol = "auto"

    def __init__(
        self,
        mesh: Any,
        ranks: tuple[int, ...],
        group: Any,
        kernel: str,
        params: CostParams | None,
    ) -> None:
        super().__init__(mesh, ranks, group, kernel)
        self.params = params
        self.candidates: dict[tuple[str, int | None], StateExchange] = {
            ("p2p", None): _P2P(mesh, ranks, group, kernel),
            ("allgather", None): _AllGather(mesh, ranks, group, kernel),
        }
        for w in grouped_widths(self.world_size):
            self.candidates[("grouped", w)] = _Grouped(mesh, ranks, group, kernel, w)

    def choice(self, S: torch.Tensor) -> ProtocolChoice:
        """The decision (with its explanation) for summaries shaped like ``S``."""
        B, H, K, V = S.shape
        return choose_protocol(
            self.world_size, B, H, K, V, device_type=self._device_type(), params=self.params
        )

    def _pick(self, S: torch.Tensor) -> StateExchange:
        c = self.choice(S)
        return self.candidates[(c.protocol, c.group_size)]

    def _start_forward(self, S: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._pick(S)._start_forward(S, M)

    def _start_backward(self, G: torch.Tensor, M: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._pick(G)._start_backward(G, M)


def _check_group_size(protocol: str, group_size: object, P: int) -> int | None:
    if group_size is None:
        return None
    if protocol != "grouped":
        raise ValueError(f"group_size is only valid for protocol 'grouped', not {protocol!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if P % group_size:
        raise ValueError(f"group_size {group_size} does not divide the mesh size {P}")
    return group_size


def default_width(P: int) -> int:
    """The largest divisor of ``P`` not above ``√P`` (balances gather width and chain length)."""
    return max(w for w in range(1, P + 1) if P % w == 0 and w * w <= P)


# compared for every protocol (not only those that create sub-meshes): ranks that disagree on
# the protocol would otherwise disagree on whether to compare at all
@accepts_backend("build_state_exchange")
@checked_entry(
    "build_state_exchange",
    compare=("protocol", "group_size", "kernel", "cost_params"),
    group="mesh",
    extra={"mesh_size": lambda args: args.mesh.size()},
)
def build_state_exchange(
    mesh: Any,
    protocol: str = "auto",
    group_size: int | None = None,
    *,
    kernel: str = "auto",
    cost_params: CostParams | None = None,
) -> StateExchange:
    """Build the executor for a 1-D, chronologically ordered context-parallel ``mesh``.

    ``protocol`` is ``"p2p"``, ``"allgather"``, ``"grouped"`` (``group_size`` w divides P;
    default: the largest divisor ≤ √P; w == P behaves as allgather, w == 1 as p2p) or
    ``"auto"`` (per call, :func:`choose_protocol` with ``cost_params``). ``kernel`` selects the
    merge/scan fold kernel (``"auto"``, ``"torch"``, ``"triton"``; ``backend=``, its earlier
    name, still works with a ``DeprecationWarning``). Collective over the mesh only when
    the grouped sub-mesh must be created (``grouped`` / ``auto`` with P ≥ 4); every check runs
    first and raises ``ValueError`` on every rank. Consistency mode (hp-dtensor's README,
    "Ranks that disagree"): first the ranks compare ``protocol``, ``group_size``, ``kernel``,
    ``cost_params`` and the mesh size (inside ``kda_context_parallel`` or ``parallelize_kda``,
    whose signatures hold these, nothing more is compared).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected 'auto', 'torch' or 'triton'")
    ndim = getattr(mesh, "ndim", None)
    if ndim != 1:
        raise ValueError(f"the context-parallel mesh must be 1-D, got {mesh!r}")
    from hyper_parallel.dtensor import check_rank_order, rank_list

    check_rank_order(mesh)
    ranks = rank_list(mesh)
    width = _check_group_size(protocol, group_size, len(ranks))
    group = mesh.get_group(0)
    if protocol == "p2p":
        return _P2P(mesh, ranks, group, kernel)
    if protocol == "allgather":
        return _AllGather(mesh, ranks, group, kernel)
    if protocol == "grouped":
        return _Grouped(mesh, ranks, group, kernel, width or default_width(len(ranks)))
    return _Auto(mesh, ranks, group, kernel, cost_params)
