"""State exchange across context-parallel ranks: p2p, allgather, grouped and auto.

Rank ``r`` of a 1-D mesh holds chunk ``r`` of the sequence and its summary ``(S_r, M_r)``.
``forward(S, M)`` returns the state entering rank ``r`` (the forward prefix fold);
``backward(G, M)`` takes ``G_r = ∂L_r/∂h_in(r)`` and returns the gradient arriving at rank
``r``'s outgoing state (the transposed suffix fold). Executors keep no tensors between calls, so
any number of exchanges may be in flight and their backwards may run in any order, as long as
every rank issues them in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.dtensor import all_gather_single, check_consistent
from hyper_parallel.dtensor.consistency import consistency_enabled

from ._checks import check_summary_pair
from .cost import CostParams, ProtocolChoice, choose_protocol, grouped_widths
from .merge import affine_merge, affine_scan, choose_backend

__all__ = ["PROTOCOLS", "StateExchange", "build_state_exchange"]

PROTOCOLS = ("p2p", "allgather", "grouped", "auto")

_TAG_FWD, _TAG_BWD = 7301, 7302


def _validate(S: torch.Tensor, M: torch.Tensor, device_type: str, backend: str, what: str) -> None:
    *_, K, V = check_summary_pair(S, M, lead=0, what=what)
    if S.device.type != device_type:
        raise ValueError(f"{what}: tensors on {S.device} but the mesh is a {device_type!r} mesh")
    choose_backend(S.device, K, V, backend)


class StateExchange:
    """Base executor: validation, the rank's position and the protocol's two directions."""

    protocol: str = ""

    def __init__(self, mesh: Any, ranks: tuple[int, ...], group: Any, backend: str) -> None:
        self.mesh = mesh
        self.ranks = ranks
        self.group = group
        self.world_size = len(ranks)
        self.position = ranks.index(dist.get_rank())
        self.backend = backend
        self.group_size: int | None = None

    def forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """``S: [B, H, K, V]``, ``M: [B, H, K, K]`` fp32 (this rank's summary) → ``h_in(r)``
        ``[B, H, K, V]`` (zeros on the first rank). Consistency mode: the ranks first compare
        ``S``, ``M`` (shape, dtype), the protocol and the group size."""
        _validate(S, M, self._device_type(), self.backend, f"{self.protocol} forward")
        self._check_consistent("forward", S, M)
        return self.exchange_forward(S, M)

    def backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """``G: [B, H, K, V]`` (``∂L_r/∂h_in(r)``), ``M`` this rank's map → the gradient at
        this rank's outgoing state (zeros on the last rank). Consistency mode as
        :meth:`forward`."""
        _validate(G, M, self._device_type(), self.backend, f"{self.protocol} backward")
        self._check_consistent("backward", G, M)
        return self.exchange_backward(G, M)

    def exchange_forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the consistency check (the caller made it)."""
        _validate(S, M, self._device_type(), self.backend, f"{self.protocol} forward")
        with torch.no_grad():
            return self._forward(S.detach(), M.detach())

    def exchange_backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """:meth:`backward` without the consistency check (the caller made it)."""
        _validate(G, M, self._device_type(), self.backend, f"{self.protocol} backward")
        with torch.no_grad():
            return self._backward(G.detach(), M.detach())

    def _check_consistent(self, direction: str, S: torch.Tensor, M: torch.Tensor) -> None:
        if consistency_enabled():
            check_consistent(
                self.group, f"StateExchange.{direction}", states=S, maps=M,
                protocol=self.protocol, group_size=self.group_size, backend=self.backend,
                world_size=self.world_size,
            )  # fmt: skip

    def _device_type(self) -> str:
        return str(getattr(self.mesh, "device_type", "cpu"))

    def _forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        width = f", group_size={self.group_size}" if self.group_size else ""
        return (
            f"{type(self).__name__}(protocol={self.protocol!r}{width}, "
            f"position={self.position}/{self.world_size})"
        )


def _step(
    S: torch.Tensor, M: torch.Tensor, x: torch.Tensor, forward: bool, backend: str
) -> torch.Tensor:
    out = affine_scan(
        (S.unsqueeze(0), M.unsqueeze(0)), x, range(0, 1), forward=forward, backend=backend
    )
    assert isinstance(out, torch.Tensor)
    return out


class _P2P(StateExchange):
    protocol = "p2p"

    def _chain(self, S: torch.Tensor, M: torch.Tensor, forward: bool) -> torch.Tensor:
        P, r = self.world_size, self.position
        prev, nxt = (r - 1, r + 1) if forward else (r + 1, r - 1)
        tag = _TAG_FWD if forward else _TAG_BWD
        acc = torch.zeros_like(S, memory_format=torch.contiguous_format)
        if 0 <= prev < P:
            dist.recv(acc, src=self.ranks[prev], group=self.group, tag=tag)
        if 0 <= nxt < P:
            dist.send(
                _step(S, M, acc, forward, self.backend),
                dst=self.ranks[nxt],
                group=self.group,
                tag=tag,
            )
        return acc

    def _forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        return self._chain(S, M, True)

    def _backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        return self._chain(G, M, False)


def _gather_packed(
    S: torch.Tensor, M: torch.Tensor, width: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather ``[S | M]`` over ``group``; return views ``(states [w, ...], matrices [w, ...])``
    of the one packed buffer."""
    V = S.shape[-1]
    packed = torch.cat([S, M], dim=-1)
    if width == 1:
        gathered = packed.unsqueeze(0)
    else:
        # Concatenated along dim 0 (the form every backend accepts), then viewed per slot.
        flat = packed.new_empty(width * packed.shape[0], *packed.shape[1:])
        all_gather_single(flat, packed, group=group)
        gathered = flat.view(width, *packed.shape)
    return gathered[..., :V], gathered[..., V:]


class _AllGather(StateExchange):
    protocol = "allgather"

    def _forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        states, maps = _gather_packed(S, M, self.world_size, self.group)
        return affine_merge(states, maps, self.position, forward=True, backend=self.backend)

    def _backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        states, maps = _gather_packed(G, M, self.world_size, self.group)
        return affine_merge(states, maps, self.position, forward=False, backend=self.backend)


class _Grouped(StateExchange):
    protocol = "grouped"

    def __init__(
        self, mesh: Any, ranks: tuple[int, ...], group: Any, backend: str, width: int
    ) -> None:
        super().__init__(mesh, ranks, group, backend)
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

    def _forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        w, r = self.group_size or 1, self.position
        n_groups, gi, i = self.world_size // w, r // w, r % w
        maps = _gather_packed(S, M, w, self.member_group)
        incoming = None
        if i == w - 1:
            if gi > 0:
                incoming = torch.empty_like(S, memory_format=torch.contiguous_format)
                dist.recv(incoming, src=self.ranks[r - w], group=self.group, tag=_TAG_FWD)
            own, out = affine_scan(
                maps, incoming, range(0, w), prefix_count=w - 1, backend=self.backend
            )
            if gi < n_groups - 1:
                dist.send(out, dst=self.ranks[r + w], group=self.group, tag=_TAG_FWD)
        if gi > 0 and w > 1:
            if incoming is None:
                incoming = torch.empty_like(S, memory_format=torch.contiguous_format)
            dist.broadcast(incoming, src=self.ranks[gi * w + w - 1], group=self.member_group)
        if i == w - 1:
            return own
        result = affine_scan(maps, incoming, range(0, i), backend=self.backend)
        assert isinstance(result, torch.Tensor)
        return result

    def _backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        w, r = self.group_size or 1, self.position
        n_groups, gi, i = self.world_size // w, r // w, r % w
        maps = _gather_packed(G, M, w, self.member_group)
        incoming = None
        if i == 0:
            if gi < n_groups - 1:
                incoming = torch.empty_like(G, memory_format=torch.contiguous_format)
                dist.recv(incoming, src=self.ranks[r + w], group=self.group, tag=_TAG_BWD)
            own, out = affine_scan(
                maps, incoming, range(w - 1, -1, -1), forward=False, prefix_count=w - 1,
                backend=self.backend,
            )  # fmt: skip
            if gi > 0:
                dist.send(out, dst=self.ranks[r - w], group=self.group, tag=_TAG_BWD)
        if gi < n_groups - 1 and w > 1:
            if incoming is None:
                incoming = torch.empty_like(G, memory_format=torch.contiguous_format)
            dist.broadcast(incoming, src=self.ranks[gi * w], group=self.member_group)
        if i == 0:
            return own
        result = affine_scan(
            maps, incoming, range(w - 1, i, -1), forward=False, backend=self.backend
        )
        assert isinstance(result, torch.Tensor)
        return result


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
        backend: str,
        params: CostParams | None,
    ) -> None:
        super().__init__(mesh, ranks, group, backend)
        self.params = params
        self.candidates: dict[tuple[str, int | None], StateExchange] = {
            ("p2p", None): _P2P(mesh, ranks, group, backend),
            ("allgather", None): _AllGather(mesh, ranks, group, backend),
        }
        for w in grouped_widths(self.world_size):
            self.candidates[("grouped", w)] = _Grouped(mesh, ranks, group, backend, w)

    def choice(self, S: torch.Tensor) -> ProtocolChoice:
        """The decision (with its explanation) for summaries shaped like ``S``."""
        B, H, K, V = S.shape
        return choose_protocol(
            self.world_size, B, H, K, V, device_type=self._device_type(), params=self.params
        )

    def _pick(self, S: torch.Tensor) -> StateExchange:
        c = self.choice(S)
        return self.candidates[(c.protocol, c.group_size)]

    def _forward(self, S: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        return self._pick(S)._forward(S, M)

    def _backward(self, G: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        return self._pick(G)._backward(G, M)


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


def build_state_exchange(
    mesh: Any,
    protocol: str = "auto",
    group_size: int | None = None,
    *,
    backend: str = "auto",
    cost_params: CostParams | None = None,
) -> StateExchange:
    """Build the executor for a 1-D, chronologically ordered context-parallel ``mesh``.

    ``protocol`` is ``"p2p"``, ``"allgather"``, ``"grouped"`` (``group_size`` w divides P;
    default: the largest divisor ≤ √P; w == P behaves as allgather, w == 1 as p2p) or
    ``"auto"`` (per call, :func:`choose_protocol` with ``cost_params``). ``backend`` selects the
    fold backend (``"auto"``, ``"torch"``, ``"triton"``). Collective over the mesh only when
    the grouped sub-mesh must be created (``grouped`` / ``auto`` with P ≥ 4); every check runs
    first and raises ``ValueError`` on every rank. Consistency mode (``HP_CHECK_CONSISTENCY=1``
    or ``consistency_checks()``): before that collective the ranks compare ``protocol``,
    ``group_size``, ``backend``, ``cost_params`` and the mesh size.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
    ndim = getattr(mesh, "ndim", None)
    if ndim != 1:
        raise ValueError(f"the context-parallel mesh must be 1-D, got {mesh!r}")
    from hyper_parallel.dtensor import check_rank_order, rank_list

    check_rank_order(mesh)
    ranks = rank_list(mesh)
    width = _check_group_size(protocol, group_size, len(ranks))
    group = mesh.get_group(0)
    if consistency_enabled() and protocol in ("grouped", "auto"):  # may create sub-meshes
        check_consistent(
            group, "build_state_exchange", protocol=protocol, group_size=group_size,
            backend=backend, cost_params=cost_params, mesh_size=len(ranks),
        )  # fmt: skip
    if protocol == "p2p":
        return _P2P(mesh, ranks, group, backend)
    if protocol == "allgather":
        return _AllGather(mesh, ranks, group, backend)
    if protocol == "grouped":
        return _Grouped(mesh, ranks, group, backend, width or default_width(len(ranks)))
    return _Auto(mesh, ranks, group, backend, cost_params)
