"""Every documented error (README, "Errors") is raised on every rank before any process group is
created, and the mesh keeps working afterwards.

Rejected inputs:
- unflatten: dim index out of range, unknown dim name, len(sizes) != len(names), product of
  sizes != dim size, non-positive size, bool size, a new name colliding with an existing dim
  name, duplicate new names, a mesh without dim names;
- flatten: a mesh without dim names, a flatten name reused for a different layout, a name of
  a root dim with a different layout;
- init_device_mesh: names not matching the shape, duplicate names, wrong rank count.
"""

import pytest
import torch
import torch.distributed as dist
from _new_world import new_world

from hyper_parallel.dtensor import flatten, init_device_mesh, unflatten
from hyper_parallel.dtensor import groups as hp_groups
from hyper_parallel.dtensor.mesh import use_fallback
from hyper_parallel.dtensor.testing import run_distributed

BAD_CALLS = {
    "dim_out_of_range": (lambda m: unflatten(m, 2, (2, 2), ("x", "y")), "out of range"),
    "negative_dim": (lambda m: unflatten(m, -1, (2, 2), ("x", "y")), "out of range"),
    "unknown_name": (lambda m: unflatten(m, "tp", (2, 2), ("x", "y")), "unknown mesh dim name"),
    "len_mismatch": (lambda m: unflatten(m, "cp", (2, 2), ("x",)), "differs from len"),
    "bad_product": (lambda m: unflatten(m, "cp", (2, 3), ("x", "y")), "multiply to 6"),
    "zero_size": (lambda m: unflatten(m, "cp", (0, 4), ("x", "y")), "positive int"),
    "bool_size": (lambda m: unflatten(m, "cp", (True, 4), ("x", "y")), "positive int"),
    "name_collision": (lambda m: unflatten(m, "cp", (2, 2), ("dp", "y")), "collide"),
    "duplicate_names": (lambda m: unflatten(m, "cp", (2, 2), ("x", "x")), "collide"),
    "unnamed_unflatten": (
        lambda m: unflatten(init_device_mesh("cpu", (8,)), 0, (2, 4), ("x", "y")),
        "needs a mesh with dim names",
    ),
    "unnamed_flatten": (lambda m: flatten(init_device_mesh("cpu", (8,))), "dim names"),
    "flatten_name_reused": (
        lambda m: (flatten(m["cp"], "z"), flatten(m["dp"], "z")),
        "already used for a different layout",
    ),
    "flatten_to_root_dim_name": (lambda m: flatten(m, "cp"), "dim of the root mesh"),
    "init_names_mismatch": (
        lambda m: init_device_mesh("cpu", (4, 2), mesh_dim_names=("a",)),
        "one name per dim",
    ),
    "init_duplicate_names": (
        lambda m: init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "a")),
        "distinct",
    ),
    "init_wrong_world": (lambda m: init_device_mesh("cpu", (2, 2)), "world size is 8"),
}


def _raise_then_work(fallback):
    """Run every bad call in turn on all ranks; after each, prove the mesh still works."""
    out = {}
    with use_fallback(fallback):
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "dp"))
        for name, (call, _) in BAD_CALLS.items():
            if name == "flatten_name_reused":
                flatten(mesh["cp"], "z")  # the first use is valid
            before = hp_groups.groups_created()
            try:
                call(mesh)
            except ValueError as exc:
                error = str(exc)
            else:
                error = None
            created = hp_groups.groups_created() - before
            sums = []
            for g in mesh.get_all_groups():
                t = torch.ones(1)
                dist.all_reduce(t, group=g)
                sums.append(int(t.item()))
            out[name] = (error, created, sums)
        ok = unflatten(mesh["cp"], "cp", (2, 2), ("x", "y"))
        t = torch.ones(1)
        dist.all_reduce(t, group=ok.get_group("y"))
    return out, int(t.item())


def _both_paths():
    """The native and the fallback path, one spawn (a new world for the second: fresh caches)."""
    first = _raise_then_work(False)
    new_world()
    return {False: first, True: _raise_then_work(True)}


@pytest.fixture(scope="module")
def both_paths():
    return run_distributed(_both_paths, 8, timeout=240)


@pytest.mark.parametrize("fallback", [False, True])
def test_bad_input_raises_on_every_rank_before_any_group(fallback, both_paths):
    for per_case, after in (r[fallback] for r in both_paths):
        assert after == 2  # a valid unflatten still works after all the failures
        for name, (_, message) in BAD_CALLS.items():
            error, created, sums = per_case[name]
            assert error is not None and message in error, (name, error)
            assert created == 0, name
            assert sums == [4, 2], name
