"""The (cp, tp) mesh hp-models works on, and the sequence block each rank holds.

A sequence of ``T`` tokens is cut into ``cp·tp`` equal contiguous blocks; the rank at mesh
coordinates ``(c, t)`` holds block ``b = c·tp + t``. The 1-D mesh ``flatten(mesh)`` (dim
``"cp_tp"``) lists the ranks in block order, so slot ``b`` of that mesh holds block ``b``, and
the ``tp`` ranks of one ``c`` together hold the contiguous chunk ``c`` of ``T/cp`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.dtensor import DeviceMesh, flatten

__all__ = ["SequenceMesh", "sequence_mesh"]

MESH_DIMS = ("cp", "tp")


@dataclass(frozen=True)
class SequenceMesh:
    """The meshes one parallelised model uses: ``mesh`` (cp, tp), ``tp`` = ``mesh["tp"]``,
    ``cp`` = ``mesh["cp"]``, ``flat`` = ``flatten(mesh)`` (block order), and this rank's
    ``block`` index in ``[0, cp·tp)``."""

    mesh: DeviceMesh
    cp: DeviceMesh
    tp: DeviceMesh
    flat: DeviceMesh
    block: int

    @property
    def size(self) -> int:
        return self.mesh.size()


def check_mesh(mesh: object) -> DeviceMesh:
    """``TypeError`` unless a DeviceMesh; ``ValueError`` unless 2-D with dims ("cp", "tp")."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"mesh must be 2-D with dims named {MESH_DIMS} (cp outer, tp inner; sizes may be "
            f"1), got a {mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}; build it with "
            "hyper_parallel.dtensor.unflatten(world_mesh, 'world', (cp, tp), ('cp', 'tp'))"
        )
    return mesh


def sequence_mesh(mesh: DeviceMesh) -> SequenceMesh:
    """Validate ``mesh`` (see :func:`check_mesh`) and build its sub-meshes. Collective-free
    except for the group creation of ``flatten`` (identical on every rank)."""
    check_mesh(mesh)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh")
    c, t = coord
    return SequenceMesh(
        mesh=mesh,
        cp=mesh["cp"],
        tp=mesh["tp"],
        flat=flatten(mesh),
        block=c * mesh.size(1) + t,
    )
