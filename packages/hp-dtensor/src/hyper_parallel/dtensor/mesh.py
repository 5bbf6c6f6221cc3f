"""Mesh construction that behaves the same on every torch version Ascend users run.

``init_device_mesh``, ``unflatten`` and ``flatten`` return torch's own ``DeviceMesh``; their
process groups come from :mod:`hyper_parallel.dtensor.groups`, so a rank set seen before is
never given a second communicator. Two ways of building the resulting mesh exist:

- *native* (torch >= 2.10, where ``DeviceMesh`` carries a ``_layout`` over its root's rank
  map): torch's own layout algebra composes the new layout and the mesh is attached to the
  root, so torch's slicing by name keeps working from the root;
- *fallback* (older torch, or forced with :func:`use_fallback`): the mesh is assembled with
  the public ``DeviceMesh.from_group`` from our pure :mod:`~hyper_parallel.dtensor.layout`,
  and the root is remembered by this module.

Both paths compute and validate everything first; process groups are created only once
every check has passed, identically on every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.dtensor import groups as _groups
from hyper_parallel.dtensor.cache import WorldCache
from hyper_parallel.dtensor.layout import Layout, LayoutError

__all__ = [
    "check_rank_order",
    "flatten",
    "init_device_mesh",
    "native_path_available",
    "rank_list",
    "root_mesh",
    "unflatten",
    "use_fallback",
]

_FORCE_FALLBACK = os.environ.get("HP_DTENSOR_FORCE_FALLBACK", "") not in ("", "0")
_INIT_CACHE: WorldCache[tuple[Any, ...], DeviceMesh] = WorldCache()  # a new world: new meshes


def native_path_available() -> bool:
    """True where torch's ``DeviceMesh`` is layout-based (torch >= 2.10)."""
    try:
        from torch.distributed._mesh_layout import _MeshLayout  # noqa: F401
    except ImportError:
        return False
    return hasattr(DeviceMesh, "_create_unflatten_mesh") or "_layout" in getattr(
        DeviceMesh, "__annotations__", {}
    )


def _use_native() -> bool:
    return not _FORCE_FALLBACK and native_path_available()


@contextlib.contextmanager
def use_fallback(enabled: bool = True) -> Iterator[None]:
    """Force (or forbid) the fallback construction path inside the ``with`` block.
    Also settable for a whole process with ``HP_DTENSOR_FORCE_FALLBACK=1``."""
    global _FORCE_FALLBACK
    old, _FORCE_FALLBACK = _FORCE_FALLBACK, enabled
    try:
        yield
    finally:
        _FORCE_FALLBACK = old


# ---- small public helpers --------------------------------------------------------------
def rank_list(mesh: DeviceMesh) -> tuple[int, ...]:
    """This process's global ranks of ``mesh``, in mesh (row-major) order."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself for a root)."""
    own = getattr(mesh, "_hp_root", None)
    if own is not None:
        return own
    if hasattr(mesh, "_get_root_mesh"):
        root = mesh._get_root_mesh()
    else:  # torch < 2.10 keeps the mapping in a global environment
        from torch.distributed.device_mesh import _mesh_resources

        root = _mesh_resources.get_root_mesh(mesh)
    # A slice of a mesh built by the fallback path has that mesh as torch's root.
    return getattr(root, "_hp_root", None) or root


def check_rank_order(mesh: DeviceMesh) -> None:
    """``ValueError`` unless ``mesh`` is 1-D and its rank order equals its process group's
    rank order (slot ``i`` of the mesh is group rank ``i``)."""
    if mesh.ndim != 1:
        raise ValueError(f"check_rank_order needs a 1-D mesh, got a {mesh.ndim}-D mesh {mesh}")
    group_ranks = tuple(dist.get_process_group_ranks(mesh.get_group(0)))
    if group_ranks != rank_list(mesh):
        raise ValueError(
            f"mesh rank order {rank_list(mesh)} differs from its process group's rank order "
            f"{group_ranks}; protocols that read group slots as chronological positions "
            "would be wrong on it"
        )


# ---- validation -------------------------------------------------------------------------
def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _resolve_dim(mesh: DeviceMesh, dim: int | str) -> int:
    names = mesh.mesh_dim_names
    if isinstance(dim, str):
        if not names or dim not in names:
            raise ValueError(f"unknown mesh dim name {dim!r}; the mesh's dims are {names}")
        return names.index(dim)
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < mesh.ndim:
        raise ValueError(f"dim {dim!r} out of range for a {mesh.ndim}-D mesh")
    return dim


def _layout_of(mesh: DeviceMesh) -> tuple[DeviceMesh, Layout]:
    root = root_mesh(mesh)
    try:
        layout = Layout.of_instance(rank_list(root), mesh.mesh.tolist())
    except LayoutError as exc:
        raise ValueError(f"mesh {mesh} is not a layout over its root {root}: {exc}") from exc
    return root, layout


def _register_existing(mesh: DeviceMesh, layout: Layout) -> list[Any]:
    """Record ``mesh``'s groups in the cache (symmetric: all sibling rank sets) and return
    them by dim."""
    own = mesh.get_all_groups()
    for d, group in enumerate(own):
        _groups.register_groups(layout.dim_groups(d), group)
    return own


# ---- construction -----------------------------------------------------------------------
def _from_groups(
    device_type: str, ranks: Any, groups: Sequence[Any], names: tuple[str, ...]
) -> DeviceMesh:
    return DeviceMesh.from_group(
        list(groups), device_type, mesh=torch.tensor(ranks, dtype=torch.int), mesh_dim_names=names
    )


def _row_major_layout(sizes: tuple[int, ...]) -> Any:
    """torch's layout of a row-major block of ``sizes`` (the inner layout of an unflatten)."""
    from torch.distributed._mesh_layout import _MeshLayout

    if hasattr(_MeshLayout, "from_sizes_strides"):  # torch >= 2.12: a tuple of flat axes
        return _MeshLayout.from_sizes_strides(sizes)
    # torch 2.10-2.11: one CuTe layout (shape, stride), as their own _create_unflatten_mesh
    strides = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))
    cute_layout: Any = _MeshLayout  # typed against the installed torch's own signature
    return cute_layout(tuple(sizes), strides)


def _flattened_layout(layout: Any) -> Any:
    """torch's 1-D layout over every rank of ``layout``, as its own ``_flatten`` builds it."""
    from torch.distributed._mesh_layout import _MeshLayout

    if hasattr(layout, "collapse"):  # torch >= 2.12
        return _MeshLayout([layout.collapse()])
    flat = layout.coalesce()  # torch 2.10-2.11
    return flat.nest() if len(flat) > 1 else flat


def _attach_native(
    parent: DeviceMesh, torch_layout: Any, names: tuple[str, ...], groups: Sequence[Any]
) -> DeviceMesh:
    troot = parent._get_root_mesh()
    res = DeviceMesh(
        parent.device_type,
        _layout=torch_layout,
        _rank_map=troot._rank_map,
        mesh_dim_names=names,
        _root_mesh=troot,
        _init_backend=False,
    )
    res._dim_group_names = [g.group_name for g in groups]
    registry = getattr(troot, "_pg_registry", None)  # torch >= 2.12; older torch resolves
    if registry is not None:  # a group name through c10d's global registry
        for g in groups:
            registry[g.group_name] = g
    return res


def _attach_fallback(root: DeviceMesh, mesh: DeviceMesh) -> DeviceMesh:
    """Remember ``root`` for :func:`root_mesh`. torch itself keeps seeing ``mesh`` as a root:
    torch < 2.10 refuses to slice a mesh it has recorded as a child ("Cannot create a submesh
    from a submesh"), so recording it in torch's global root mapping would break
    ``mesh["tp"]``; slices of ``mesh`` reuse its groups and have ``mesh`` as torch's root."""
    mesh._hp_root = root  # type: ignore[attr-defined]
    return mesh


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Like torch's ``init_device_mesh`` over all ``world_size`` ranks (row-major), with its
    groups from the cache; the same arguments return the same mesh object.

    ``device_type``: ``"cpu"``, ``"cuda"`` or ``"npu"`` (set the current device first on
    accelerators, as torchrun scripts do)."""
    if not dist.is_initialized():
        raise RuntimeError("init_device_mesh needs torch.distributed to be initialised")
    shape = tuple(_positive_int(s, "mesh_shape entries") for s in mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None:
        if len(names) != len(shape):
            raise ValueError(f"mesh_dim_names {names} must have one name per dim of {shape}")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"mesh_dim_names must be distinct non-empty strings, got {names}")
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"mesh shape {shape} has {math.prod(shape)} ranks, world size is {world}")
    key = (device_type, shape, names)
    if key in _INIT_CACHE:
        return _INIT_CACHE[key]
    layout = Layout.root(shape)
    groups = [_groups.group_for(layout.dim_groups(d)) for d in range(layout.ndim)]
    dim_names = names if names is not None else tuple(f"dim_{d}" for d in range(len(shape)))
    mesh = _from_groups(device_type, layout.instance_ranks(dist.get_rank()), groups, dim_names)
    if names is None:
        mesh._mesh_dim_names = None
    _INIT_CACHE[key] = mesh
    return mesh


def unflatten(
    mesh: DeviceMesh, dim: int | str, sizes: Sequence[int], names: Sequence[str]
) -> DeviceMesh:
    """Replace dim ``dim`` of ``mesh`` by ``len(sizes)`` dims of those sizes and names.

    Row-major: the last new dim varies fastest. Every other dim keeps its ranks and its
    existing process group; the new dims' groups (for every sibling partition across the
    root) are created once, in the same order on every rank, and reused on later calls. The
    result's root is ``root_mesh(mesh)``.

    Example: root ``(cp=4, dp=2)`` over ranks 0..7; ``unflatten(root["cp"], "cp", (2, 2),
    ("cpo", "cpi"))`` on rank 0 is the mesh ``[[0, 2], [4, 6]]``; its ``cpi`` groups are
    {0,2},{4,6} and, for the other dp replica, {1,3},{5,7}.
    """
    if not mesh.mesh_dim_names:
        raise ValueError("unflatten needs a mesh with dim names")
    d = _resolve_dim(mesh, dim)
    sizes = tuple(sizes)
    names = tuple(names)
    if len(sizes) != len(names):
        raise ValueError(f"len(sizes)={len(sizes)} differs from len(names)={len(names)}")
    for s in sizes:
        _positive_int(s, "unflatten sizes")
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"names must be non-empty strings, got {names}")
    if math.prod(sizes) != mesh.size(d):
        raise ValueError(
            f"sizes {sizes} multiply to {math.prod(sizes)}, but dim "
            f"{mesh.mesh_dim_names[d]!r} has size {mesh.size(d)}"
        )
    kept = [n for i, n in enumerate(mesh.mesh_dim_names) if i != d]
    clash = sorted(set(names) & set(kept)) or sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"new dim name(s) {clash} collide with existing dim names {kept}")
    new_names = mesh.mesh_dim_names[:d] + names + mesh.mesh_dim_names[d + 1 :]

    root, layout = _layout_of(mesh)
    try:
        new_layout = layout.unflatten(d, sizes)
    except LayoutError as exc:
        raise ValueError(str(exc)) from exc

    # every check has passed: from here on, groups may be created (identically on all ranks)
    existing = _register_existing(mesh, layout)
    new_groups = [_groups.group_for(new_layout.dim_groups(j)) for j in range(d, d + len(sizes))]
    all_groups = existing[:d] + new_groups + existing[d + 1 :]
    if _use_native():
        partial = mesh._layout[d].composition(_row_major_layout(sizes))
        result = _attach_native(mesh, mesh._layout.splice(d, d + 1, partial), new_names, all_groups)
    else:
        ranks = new_layout.instance_ranks(dist.get_rank())
        result = _attach_fallback(
            root, _from_groups(mesh.device_type, ranks, all_groups, new_names)
        )
    return result


def flatten(mesh: DeviceMesh, name: str | None = None) -> DeviceMesh:
    """A 1-D mesh over all of ``mesh``'s ranks (row-major), named ``name`` (default: the dim
    names joined with ``_``). A 1-D mesh flattened to its own name is itself. Flattening the
    same layout to the same name again returns the same mesh object; reusing a name for a
    different layout is a ``ValueError``."""
    if not mesh.mesh_dim_names:
        raise ValueError("flatten needs a mesh with dim names")
    if name is None:
        name = "_".join(mesh.mesh_dim_names)
    if not isinstance(name, str) or not name:
        raise ValueError(f"flatten name must be a non-empty string, got {name!r}")
    if mesh.ndim == 1 and name == mesh.mesh_dim_names[0]:
        return mesh
    root, layout = _layout_of(mesh)
    flat = layout.flatten()
    registry: dict[str, tuple[Layout, dict[int, DeviceMesh]]] = root.__dict__.setdefault(
        "_hp_flattened", {}
    )
    root_names = root.mesh_dim_names or ()
    if name in root_names:
        root_dim = Layout.root(root.mesh.shape, rank_list(root)).slice([root_names.index(name)])
        if root_dim != flat:
            raise ValueError(
                f"flatten name {name!r} is a dim of the root mesh with a different layout"
            )
    if name in registry and registry[name][0] != flat:
        raise ValueError(
            f"flatten name {name!r} was already used for a different layout "
            f"(dims {registry[name][0].offsets} vs {flat.offsets}); choose another name"
        )
    base = flat.base_of(dist.get_rank())
    if name in registry and base in registry[name][1]:
        return registry[name][1][base]

    _register_existing(mesh, layout)
    group = _groups.group_for(flat.dim_groups(0))
    if _use_native():
        result = _attach_native(mesh, _flattened_layout(mesh._layout), (name,), [group])
        mesh._get_root_mesh()._flatten_mapping[name] = result
    else:
        ranks = flat.instance_ranks(dist.get_rank())
        result = _attach_fallback(root, _from_groups(mesh.device_type, ranks, [group], (name,)))
    registry.setdefault(name, (flat, {}))[1][base] = result
    return result
