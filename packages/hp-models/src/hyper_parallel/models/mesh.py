"""The (cp, tp) mesh hp-models works on, and the sequence block each rank holds.

A sequence of ``T`` tokens is cut into ``cp·tp`` equal contiguous blocks; the rank at mesh
coordinates ``(c, t)`` holds block ``b = c·tp + t``. The 1-D mesh ``flatten(mesh)`` (dim
``"cp_tp"``) lists the ranks in block order, so slot ``b`` of that mesh holds block ``b``, and
the ``tp`` ranks of one ``c`` together hold the contiguous chunk ``c`` of ``T/cp`` tokens.

A 3-D mesh ``("dp", "cp", "tp")`` adds data parallelism: the ``cp·tp`` ranks of one ``dp``
coordinate ``d`` are one such (cp, tp) mesh and hold rows ``[d·B/dp, (d+1)·B/dp)`` of the
global batch; ``whole`` = ``flatten(mesh)`` (dim ``"dp_cp_tp"``) is every rank of the job.
The ``dp·cp`` ranks that share a ``tp`` coordinate hold the same tp shard of every dense MLP
weight; ``dp_cp`` is the 1-D mesh over them, FSDP2's mesh for those weights (see
:attr:`SequenceMesh.fsdp_mlp_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hyper_parallel.dtensor import DeviceMesh, comm, flatten, unflatten

__all__ = ["SequenceMesh", "cp_tp", "sequence_mesh"]

MESH_DIMS = ("cp", "tp")
DP_MESH_DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True)
class SequenceMesh:
    """The meshes one parallelised model uses: ``mesh`` (cp, tp) or (dp, cp, tp), ``tp`` =
    ``mesh["tp"]`` (with a dp dim: its ranks and group, see below), ``cp`` = ``mesh["cp"]``,
    ``flat`` = the (cp, tp) ranks flattened (block order), this rank's ``block`` index in
    ``[0, cp·tp)``; with a ``dp`` dim, ``dp`` = ``mesh["dp"]``, ``whole`` = ``flatten(mesh)``,
    and ``whole`` unflattened to the 2-D mesh ``(dp·cp, tp)`` with dims ``("dp_cp", "tp")``
    gives ``dp_cp`` (1-D: the ``dp·cp`` ranks of this rank's tp coordinate, rank ``(d, c, t)``
    at slot ``d·cp + c``) and ``tp`` (the same ranks and process group as ``mesh["tp"]``, but a
    slice of that 2-D mesh, so that FSDP2 on every torch finds ``dp_cp`` and ``tp`` on one
    root: see :attr:`fsdp_mlp_mesh`)."""

    mesh: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    flat: DeviceMesh
    block: int
    dp: DeviceMesh | None = None
    dp_cp: DeviceMesh | None = None
    whole: DeviceMesh | None = None

    @property
    def size(self) -> int:
        """``cp·tp``: the ranks that share one sequence."""
        return self.flat.size()

    @cached_property
    def flat_group(self) -> comm.Group:
        """``flat`` resolved once (hp-dtensor's ``comm.Group``, block ``b`` on group rank
        ``b``): the group of the forward's sequence context."""
        return comm.resolve_group(self.flat, "the sequence mesh")

    @property
    def batch(self) -> DeviceMesh:
        """The 1-D mesh of every rank holding a share of one global batch (dp·cp·tp ranks):
        the loss's token count and sum run over it."""
        return self.whole if self.whole is not None else self.flat

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.size()

    @property
    def fsdp_mlp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for a dense MLP, whose weights are hp-mc2's DTensor shards over ``tp``:
        the 1-D mesh of the ranks holding the same tp shard, ``cp`` (a 2-D mesh) or ``dp_cp``
        (a 3-D one: ``dp·cp`` ranks). Each weight is then split over all ``dp·cp·tp`` ranks,
        no rank holding an element another holds: a ``[I, H]`` column-parallel weight is
        ``[I/(dp·cp·tp), H]`` a rank (FSDP2's chunks, padded), on the 2-D mesh
        ``(dp_cp, tp)`` with placements ``(_StridedShard(0, sf=tp), Shard(0))``.

        ``dp_cp`` is a slice of a ``(dp·cp, tp)`` mesh, not ``flatten(mesh["dp", "cp"])``:
        torch 2.7–2.9's FSDP2 builds its 2-D mesh as ``root[dp_names + tp_names]`` of the
        root torch records for both meshes (``_mesh_resources.get_root_mesh``), and refuses
        meshes of different roots; hp-dtensor's fallback ``flatten`` (torch < 2.10) gives a
        1-D mesh that torch takes for a root of its own. Slices of one mesh share its root
        on every torch (torch >= 2.10's FSDP2 concatenates the two meshes' layouts)."""
        return self.cp if self.dp_cp is None else self.dp_cp

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for the whole-on-every-rank parameters: every rank (``batch``)."""
        return self.batch

    def fsdp_mesh_for(self, scope: str) -> DeviceMesh:
        """FSDP2's mesh for a block whose gradients are summed over ``scope`` (its role's
        :attr:`~hyper_parallel.models.roles.Role.scope`: ``"cp"`` or ``"world"``): the one rule
        both gradient paths follow (FSDP2's meshes and ``sync_gradients``' all-reduces)."""
        return self.fsdp_mlp_mesh if scope == "cp" else self.fsdp_mesh


def check_mesh(mesh: object) -> DeviceMesh:
    """``TypeError`` unless a DeviceMesh; ``ValueError`` unless its dims are ("cp", "tp") or
    ("dp", "cp", "tp")."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if tuple(mesh.mesh_dim_names or ()) not in (MESH_DIMS, DP_MESH_DIMS):
        raise ValueError(
            f"mesh must be 2-D with dims named {MESH_DIMS} (cp outer, tp inner; sizes may be "
            f"1) or 3-D with dims {DP_MESH_DIMS} (data parallel outermost), got a "
            f"{mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}; build it with "
            "hyper_parallel.dtensor.unflatten(world_mesh, 'world', (cp, tp), ('cp', 'tp'))"
        )
    return mesh


def cp_tp(mesh: DeviceMesh) -> tuple[int, int]:
    """``(cp, tp)`` sizes of a checked mesh (2-D or 3-D)."""
    names = tuple(mesh.mesh_dim_names or ())
    return mesh.size(names.index("cp")), mesh.size(names.index("tp"))


def sequence_mesh(mesh: DeviceMesh) -> SequenceMesh:
    """Validate ``mesh`` (see :func:`check_mesh`) and build its sub-meshes. Collective-free
    except for the group creation of ``flatten`` and ``unflatten`` (identical on every
    rank)."""
    check_mesh(mesh)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh")
    if mesh.ndim == 3:  # (dp, cp, tp): the (cp, tp) mesh of this dp coordinate
        c, t = coord[1:]
        dp, cp, tp = (mesh.size(d) for d in range(3))
        whole = flatten(mesh)
        # (dp·cp, tp): tp and the ranks holding the same tp shard, slices of one mesh
        shards = unflatten(whole, "dp_cp_tp", (dp * cp, tp), ("dp_cp", "tp"))
        return SequenceMesh(
            mesh=mesh,
            cp=mesh["cp"],
            tp=shards["tp"],
            flat=flatten(mesh["cp", "tp"]),
            block=c * tp + t,
            dp=mesh["dp"],
            dp_cp=shards["dp_cp"],
            whole=whole,
        )
    c, t = coord
    return SequenceMesh(
        mesh=mesh,
        cp=mesh["cp"],
        tp=mesh["tp"],
        flat=flatten(mesh),
        block=c * mesh.size(1) + t,
    )
