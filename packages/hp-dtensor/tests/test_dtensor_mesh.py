"""Meshes on real gloo ranks: unflatten keeps root and sibling groups, the group cache, flatten,
rank order, and agreement of the native path, the fallback path and torch's own _unflatten."""

import pytest
import torch
import torch.distributed as dist

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
from hyper_parallel.dtensor.testing import free_port, run_distributed

TIMEOUT = 60


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
    out = {}
    for case in cases:
        shape, names, dim, sizes, new_names = cases[case]
        root = torch.distributed.device_mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        sub = root[dim] if len(shape) > 1 else root
        mesh = sub._unflatten(0, sizes, new_names)
        out[case] = {"ranks": mesh.mesh.tolist(), "groups": _group_ranks(mesh)}
    return out


def test_native_and_fallback_agree_with_torch_unflatten():
    reference = run_distributed(_torch_unflatten_cases, 8, CASES, timeout=TIMEOUT)
    paths = {"fallback": run_distributed(_unflatten_cases, 8, True, CASES, timeout=TIMEOUT)}
    if native_path_available():
        paths["native"] = run_distributed(_unflatten_cases, 8, False, CASES, timeout=TIMEOUT)
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


@pytest.mark.parametrize("world, cases", [(2, SMALL), (4, FOUR)])
def test_unflatten_on_two_and_four_ranks_matches_torch(world, cases):
    ours = run_distributed(_unflatten_cases, world, True, cases, timeout=TIMEOUT)
    ref = run_distributed(_torch_unflatten_cases, world, cases, timeout=TIMEOUT)
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
def test_unflatten_creates_sibling_replica_groups(fallback):
    results = run_distributed(_sibling_replicas, 8, fallback, timeout=TIMEOUT)
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
def test_repeated_unflatten_reuses_cached_groups(fallback):
    for r in run_distributed(_cache_reuse, 8, fallback, timeout=TIMEOUT):
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
def test_unflatten_keeps_root_and_untouched_groups(fallback):
    for r in run_distributed(_keeps_untouched_dims, 8, fallback, timeout=TIMEOUT):
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
def test_flatten_noncontiguous_submesh(fallback):
    results = run_distributed(_flatten_behaviour, 8, fallback, timeout=TIMEOUT)
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


def test_check_rank_order_rejects_permuted_and_multi_dim_meshes():
    for ranks, errors in run_distributed(_rank_order_cases, 4, timeout=TIMEOUT):
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
def test_dtensor_works_on_unflattened_mesh(fallback):
    for same, shape in run_distributed(_dtensor_on_unflattened, 4, fallback, timeout=TIMEOUT):
        assert same and shape == (2, 2)


def _reinit_world():
    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    old_group = unflatten(first, "a", (2,), ("a2",)).get_group("b")
    rank, world = dist.get_rank(), dist.get_world_size()
    port = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(port, src=0)  # a fresh rendezvous for the second world
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{int(port.item())}", rank=rank, world_size=world
    )
    second = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    new_group = second.get_group("b")
    return second is not first, new_group is not old_group, _sum_over(new_group)


def test_meshes_and_groups_are_rebuilt_after_a_new_world():
    for r in run_distributed(_reinit_world, 4, timeout=TIMEOUT):
        assert r == (True, True, 2)
