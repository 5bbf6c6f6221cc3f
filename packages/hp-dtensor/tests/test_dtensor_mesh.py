"""Meshes on real gloo ranks: unflatten keeps root and sibling groups, the group cache, flatten,
rank order, and agreement of the native path, the fallback path and torch's own _unflatten.

Starting ranks dominates the run time, so the checks share one spawn per world size (8, 4 and 2
ranks, module-scoped fixtures) and each check runs in a new world of those ranks (a fresh
rendezvous: hp-dtensor's group and mesh caches start empty, as in a newly started process).
Each test asserts on its own check's results.
"""

import pytest
import torch
import torch.distributed as dist
from _new_world import new_world

from hyper_parallel.dtensor import (
    check_rank_order,
    flatten,
    init_device_mesh,
    rank_list,
    root_mesh,
    unflatten,
)
from hyper_parallel.dtensor import groups as hp_groups
from hyper_parallel.dtensor.mesh import native_path_available, use_fallback
from hyper_parallel.dtensor.testing import run_distributed

TIMEOUT = 60
SPAWN_TIMEOUT = 300  # one spawn runs every check of its world size


def _each_in_a_new_world(jobs):
    """``{key: fn(*args)}`` for each ``(key, fn, args)``, every one in a new world."""
    out = {}
    for key, fn, args in jobs:
        new_world()
        out[key] = fn(*args)
    return out


def _group_ranks(mesh):
    return [tuple(dist.get_process_group_ranks(g)) for g in mesh.get_all_groups()]


def _sum_over(group):
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())


# (root shape, root names, dim to unflatten after slicing, sizes, names); all over 8 ranks
CASES = {
    "cp4_dp2": ((4, 2), ("cp", "dp"), "cp", (2, 2), ("cpo", "cpi")),
    "dp2_cp4": ((2, 4), ("dp", "cp"), "cp", (2, 2), ("cpo", "cpi")),
    "world8_3d": ((8,), ("world",), "world", (2, 2, 2), ("a", "b", "c")),
    "pp2_dp2_tp2_dp": ((2, 2, 2), ("pp", "dp", "tp"), "dp", (2, 1), ("dpo", "dpi")),
    "cp8_to_4x2": ((8,), ("cp",), "cp", (4, 2), ("outer", "inner")),
}


def _unflatten_cases(fallback, cases):
    out = {}
    with use_fallback(fallback):
        for case in cases:
            shape, names, dim, sizes, new_names = cases[case]
            root = init_device_mesh("cpu", shape, mesh_dim_names=names)
            sub = root[dim] if len(shape) > 1 else root
            mesh = unflatten(sub, dim, sizes, new_names)
            out[case] = {
                "ranks": mesh.mesh.tolist(),
                "groups": _group_ranks(mesh),
                "root_is_root": root_mesh(mesh) is root,
                "sums": [_sum_over(g) for g in mesh.get_all_groups()],
            }
    return out


def _torch_unflatten_cases(cases):
    """torch's own answer: ``DeviceMesh._unflatten`` of the slice (torch >= 2.10); on older
    torch, which has no ``_unflatten``, the same dims sliced from a root that torch built with
    the unflattened shape (the mesh ``_unflatten`` is defined to equal)."""
    out = {}
    init = torch.distributed.device_mesh.init_device_mesh
    for case in cases:
        shape, names, dim, sizes, new_names = cases[case]
        if hasattr(torch.distributed.DeviceMesh, "_unflatten"):
            root = init("cpu", shape, mesh_dim_names=names)
            sub = root[dim] if len(shape) > 1 else root
            mesh = sub._unflatten(0, sizes, new_names)
        else:
            d = names.index(dim)
            full = init(
                "cpu",
                (*shape[:d], *sizes, *shape[d + 1 :]),
                mesh_dim_names=(*names[:d], *new_names, *names[d + 1 :]),
            )
            mesh = full[new_names] if len(shape) > 1 else full
        out[case] = {"ranks": mesh.mesh.tolist(), "groups": _group_ranks(mesh)}
    return out


def test_native_and_fallback_agree_with_torch_unflatten(eight_ranks):
    reference = [r["torch_unflatten"] for r in eight_ranks]
    paths = {"fallback": [r["unflatten", True] for r in eight_ranks]}
    if native_path_available():
        paths["native"] = [r["unflatten", False] for r in eight_ranks]
    assert native_path_available() == hasattr(torch.distributed.DeviceMesh, "_unflatten")
    for path, results in paths.items():
        for rank, (ours, ref) in enumerate(zip(results, reference)):
            for case in CASES:
                got, want = ours[case], ref[case]
                assert got["ranks"] == want["ranks"], (path, case, rank)
                assert got["groups"] == want["groups"], (path, case, rank)
                assert got["root_is_root"], (path, case, rank)
                assert got["sums"] == [len(g) for g in got["groups"]], (path, case, rank)


SMALL = {
    "two_ranks": ((2,), ("world",), "world", (2, 1), ("dp", "tp")),
}
FOUR = {
    "tp2_cp2_of4": ((4,), ("world",), "world", (2, 2), ("tp", "cp")),
    "dp2_tp2_tp": ((2, 2), ("dp", "tp"), "tp", (1, 2), ("x", "y")),
}


def _two_rank_checks():
    return {"ours": _unflatten_cases(True, SMALL), "torch": _torch_unflatten_cases(SMALL)}


@pytest.mark.parametrize("world, cases", [(2, SMALL), (4, FOUR)])
def test_unflatten_on_two_and_four_ranks_matches_torch(world, cases, four_ranks):
    if world == 2:
        both = run_distributed(_two_rank_checks, 2, timeout=TIMEOUT)
        ours, ref = [b["ours"] for b in both], [b["torch"] for b in both]
    else:
        ours = [r["unflatten", True] for r in four_ranks]
        ref = [r["torch_unflatten"] for r in four_ranks]
    for o, r in zip(ours, ref):
        for case in cases:
            assert o[case]["ranks"] == r[case]["ranks"]
            assert o[case]["groups"] == r[case]["groups"]
    if world == 4:
        assert [o["tp2_cp2_of4"]["groups"] for o in ours] == [
            [(0, 2), (0, 1)],
            [(1, 3), (0, 1)],
            [(0, 2), (2, 3)],
            [(1, 3), (2, 3)],
        ]


def _sibling_replicas(fallback):
    with use_fallback(fallback):
        root = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "dp"))
        cp = root["cp"]
        before = hp_groups.groups_created()
        out = unflatten(cp, "cp", (2, 2), ("cpo", "cpi"))
        return {
            "cp": rank_list(cp),
            "inner": tuple(dist.get_process_group_ranks(out.get_group("cpi"))),
            "outer": tuple(dist.get_process_group_ranks(out.get_group("cpo"))),
            "created": hp_groups.groups_created() - before,
        }


@pytest.mark.parametrize("fallback", [False, True])
def test_unflatten_creates_sibling_replica_groups(fallback, eight_ranks):
    results = [r["siblings", fallback] for r in eight_ranks]
    inner = {r["inner"] for r in results}
    assert inner == {(0, 2), (4, 6), (1, 3), (5, 7)}
    assert {r["outer"] for r in results} == {(0, 4), (2, 6), (1, 5), (3, 7)}
    assert results[0]["cp"] == (0, 2, 4, 6) and results[1]["cp"] == (1, 3, 5, 7)
    # every rank took part in creating all 8 new groups, siblings included
    assert all(r["created"] == 8 for r in results)


def _cache_reuse(fallback):
    with use_fallback(fallback):
        root = init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "dp"))
        first = unflatten(root["cp"], "cp", (2, 2), ("cpo", "cpi"))
        created = hp_groups.groups_created()
        again = [unflatten(root["cp"], "cp", (2, 2), ("cpo", "cpi")) for _ in range(3)]
        renamed = unflatten(root["cp"], 0, (2, 2), ("x", "y"))
        flat_twice = flatten(first, "cp_again"), flatten(first, "cp_again")
        return {
            "same_groups": all(
                m.get_group("cpi") is first.get_group("cpi")
                and m.get_group("cpo") is first.get_group("cpo")
                for m in again
            ),
            "renamed_same": renamed.get_group("y") is first.get_group("cpi"),
            "growth": hp_groups.groups_created() - created,
            "same_init": init_device_mesh("cpu", (4, 2), mesh_dim_names=("cp", "dp")) is root,
            "flat_same_object": flat_twice[0] is flat_twice[1],
            "flat_reuses_cp_group": flat_twice[0].get_group() is root.get_group("cp"),
        }


@pytest.mark.parametrize("fallback", [False, True])
def test_repeated_unflatten_reuses_cached_groups(fallback, eight_ranks):
    for r in (rank["cache", fallback] for rank in eight_ranks):
        assert r == {
            "same_groups": True,
            "renamed_same": True,
            "growth": 0,
            "same_init": True,
            "flat_same_object": True,
            "flat_reuses_cp_group": True,
        }


def _keeps_untouched_dims(fallback):
    with use_fallback(fallback):
        root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        out = unflatten(root, "dp", (2, 1), ("dpo", "dpi"))
        return (
            out.get_group("pp") is root.get_group("pp"),
            out.get_group("tp") is root.get_group("tp"),
            root_mesh(out) is root,
            out.mesh_dim_names,
        )


@pytest.mark.parametrize("fallback", [False, True])
def test_unflatten_keeps_root_and_untouched_groups(fallback, eight_ranks):
    for r in (rank["untouched", fallback] for rank in eight_ranks):
        assert r == (True, True, True, ("pp", "dpo", "dpi", "tp"))


def _flatten_behaviour(fallback):
    with use_fallback(fallback):
        root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        ac = flatten(root["a", "c"])
        default_name = ac.mesh_dim_names
        check_rank_order(ac)
        one_d = root["b"]
        return {
            "ac": rank_list(ac),
            "name": default_name,
            "root": root_mesh(ac) is root,
            "self": flatten(one_d, "b") is one_d,
            "all": rank_list(flatten(root)),
            "sum": _sum_over(ac.get_group()),
        }


@pytest.mark.parametrize("fallback", [False, True])
def test_flatten_noncontiguous_submesh(fallback, eight_ranks):
    results = [r["flatten", fallback] for r in eight_ranks]
    assert results[0]["ac"] == (0, 1, 4, 5) and results[2]["ac"] == (2, 3, 6, 7)
    for r in results:
        assert r["name"] == ("a_c",) and r["root"] and r["self"]
        assert r["all"] == tuple(range(8)) and r["sum"] == 4


def _rank_order_cases():
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    # a 1-D mesh listing ranks out of order: its group's rank order is sorted (0, 1, 2, 3)
    swapped = torch.distributed.device_mesh.DeviceMesh(
        "cpu", torch.tensor([0, 2, 1, 3]), mesh_dim_names=("swapped",)
    )
    check_rank_order(root["a"])
    errors = []
    for mesh in (swapped, root):
        try:
            check_rank_order(mesh)
        except ValueError as exc:
            errors.append(str(exc))
    return rank_list(swapped), errors


def test_check_rank_order_rejects_permuted_and_multi_dim_meshes(four_ranks):
    for ranks, errors in (r["rank_order"] for r in four_ranks):
        assert ranks == (0, 2, 1, 3)
        assert len(errors) == 2
        assert "differs from its process group's rank order" in errors[0]
        assert "needs a 1-D mesh" in errors[1]


def _dtensor_on_unflattened(fallback):
    from torch.distributed.tensor import Shard, distribute_tensor

    with use_fallback(fallback):
        root = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        mesh = unflatten(root, "world", (2, 2), ("dp", "tp"))
        full = torch.arange(16.0).reshape(4, 4)
        dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        return torch.equal(dt.full_tensor(), full), tuple(dt.to_local().shape)


@pytest.mark.parametrize("fallback", [False, True])
def test_dtensor_works_on_unflattened_mesh(fallback, four_ranks):
    for same, shape in (r["dtensor", fallback] for r in four_ranks):
        assert same and shape == (2, 2)


def _reinit_world():
    from hyper_parallel.dtensor.cache import WorldCache

    cache: WorldCache[str, int] = WorldCache()
    made = [cache.get_or_create("k", lambda: 1), cache.get_or_create("k", lambda: 2)]
    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    old_group = unflatten(first, "a", (2,), ("a2",)).get_group("b")
    new_world()  # a fresh rendezvous for the second world
    second = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    new_group = second.get_group("b")
    # a world-scoped cache forgets what the old world put in it
    assert made == [1, 1] and "k" not in cache and len(cache) == 0
    assert cache.get_or_create("k", lambda: 3) == 3
    return second is not first, new_group is not old_group, _sum_over(new_group)


def test_meshes_and_groups_are_rebuilt_after_a_new_world(four_ranks):
    for r in (rank["reinit"] for rank in four_ranks):
        assert r == (True, True, 2)


# ---- one spawn per world size ---------------------------------------------------------------
FALLBACKS = (False, True)
EIGHT_RANK_JOBS = [("torch_unflatten", _torch_unflatten_cases, (CASES,))]
for _fb in FALLBACKS:
    EIGHT_RANK_JOBS += [
        (("unflatten", _fb), _unflatten_cases, (_fb, CASES)),
        (("siblings", _fb), _sibling_replicas, (_fb,)),
        (("cache", _fb), _cache_reuse, (_fb,)),
        (("untouched", _fb), _keeps_untouched_dims, (_fb,)),
        (("flatten", _fb), _flatten_behaviour, (_fb,)),
    ]
FOUR_RANK_JOBS = [
    ("torch_unflatten", _torch_unflatten_cases, (FOUR,)),
    (("unflatten", True), _unflatten_cases, (True, FOUR)),
    ("rank_order", _rank_order_cases, ()),
    *[(("dtensor", _fb), _dtensor_on_unflattened, (_fb,)) for _fb in FALLBACKS],
    ("reinit", _reinit_world, ()),
]


@pytest.fixture(scope="module")
def eight_ranks():
    """Every 8-rank check's results, by rank: ``[{key: result}]``."""
    return run_distributed(_each_in_a_new_world, 8, EIGHT_RANK_JOBS, timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_each_in_a_new_world, 4, FOUR_RANK_JOBS, timeout=SPAWN_TIMEOUT)


def test_shared_spawns_ran_every_check_on_every_rank(eight_ranks, four_ranks):
    """Every job ran on every rank. That each ran with empty caches is what the cache and
    sibling tests show (the unflatten cases before them create the same groups)."""
    for results, jobs in ((eight_ranks, EIGHT_RANK_JOBS), (four_ranks, FOUR_RANK_JOBS)):
        assert all(list(r) == [key for key, _, _ in jobs] for r in results)
