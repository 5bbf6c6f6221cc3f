"""Shared helpers for the hp-context-parallel tests (rank functions live at module level)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.context_parallel import (
    MLAConfig,
    MultiHeadLatentAttention,
    parallelize_mla,
    shard_sequence,
)
from hyper_parallel.dtensor import init_device_mesh

TIMEOUT = 120.0
BATCH, SEQ = 2, 16


def config(q_lora: bool) -> MLAConfig:
    return MLAConfig(
        hidden_size=24,
        num_heads=8,
        q_lora_rank=12 if q_lora else None,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
    )


def build(q_lora: bool, seed: int = 0, bias: bool = True) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(config(q_lora), bias=bias).double()
    with torch.no_grad():  # non-trivial norm weights so their gradients are tested too
        for name, p in m.named_parameters():
            if "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def inputs(seed: int = 1, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, 24, dtype=torch.float64, generator=g)
    dy = torch.randn(BATCH, seq, 24, dtype=torch.float64, generator=g)
    return x, dy


def serial_reference(q_lora: bool) -> dict[str, Any]:
    m = build(q_lora)
    x, dy = inputs()
    x.requires_grad_(True)
    out = m(x)
    out.backward(dy)
    return {
        "out": out.detach(),
        "dx": x.grad,
        "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
    }


def cp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


def rank_parallel_mla(combos: list[tuple[str, bool, bool]]) -> dict[tuple, dict[str, Any]]:
    """On every rank: for each (strategy, overlap, q_lora), run the parallel block fwd+bwd."""
    mesh = cp_mesh()
    results = {}
    for strategy, overlap, q_lora in combos:
        m = build(q_lora)
        parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
        x, dy = inputs()
        x_local = shard_sequence(x, mesh).clone().requires_grad_(True)
        out = m(x_local)
        out.backward(shard_sequence(dy, mesh))
        results[(strategy, overlap, q_lora)] = {
            "out": out.detach(),
            "dx": x_local.grad,
            "grads": {n: p.grad.clone() for n, p in m.named_parameters()},
        }
    return results


def rank_record_schedule(strategy: str, overlap: bool, q_lora: bool = True) -> dict[str, Any]:
    """Record one fwd+bwd of the parallel block: (kind, name, phase, nbytes) tuples and the
    Chrome trace."""
    from hyper_parallel.context_parallel import record_events

    mesh = cp_mesh()
    m = build(q_lora)
    parallelize_mla(m, mesh, strategy=strategy, overlap=overlap)
    x, dy = inputs()
    x_local = shard_sequence(x, mesh).clone().requires_grad_(True)
    with record_events() as rec:
        out = m(x_local)
        out.backward(shard_sequence(dy, mesh))
    return {
        "events": [(e.kind, e.name, e.phase, e.nbytes) for e in rec.events],
        "trace": rec.to_chrome_trace(pid=dist.get_rank()),
    }


def full_tensor(shape: tuple[int, ...], seed: int | None = None) -> torch.Tensor:
    """Exact float64 data: integers (seeded random or arange) so every path is bit-exact."""
    if seed is None:
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).double()


def rank_ulysses(shape: tuple[int, ...], seq_dim: int, head_dim: int) -> dict[str, Any]:
    from hyper_parallel.context_parallel import (
        launch_seq_to_head,
        ulysses_head_to_seq,
        ulysses_seq_to_head,
    )

    mesh = cp_mesh()
    p, r = mesh.size(), dist.get_rank()
    x_full = full_tensor(shape)
    w_full = full_tensor(shape, seed=7)  # loss weights for the head-sharded output
    x = x_full.chunk(p, seq_dim)[r].clone().requires_grad_(True)
    out = ulysses_seq_to_head(x, seq_dim, head_dim, mesh)
    (out * w_full.chunk(p, head_dim)[r]).sum().backward()
    back = ulysses_head_to_seq(out.detach(), seq_dim, head_dim, mesh)

    xa = x.detach().clone().requires_grad_(True)
    handle = launch_seq_to_head(xa, seq_dim, head_dim, mesh)
    out_async = handle.wait()
    try:
        handle.wait()
        second_wait = "no error"
    except RuntimeError as e:
        second_wait = str(e)
    (out_async * w_full.chunk(p, head_dim)[r]).sum().backward()

    # gradient of head_to_seq is seq_to_head of the gradient
    y = out.detach().clone().requires_grad_(True)
    ulysses_head_to_seq(y, seq_dim, head_dim, mesh).mul(
        w_full.chunk(p, seq_dim)[r]
    ).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "round_trip_exact": torch.equal(back, x.detach()),
        "out_async": out_async.detach(),
        "dx_async": xa.grad,
        "second_wait": second_wait,
        "dy_h2s": y.grad,
    }


def rank_all_gather(dim: int) -> dict[str, Any]:
    from hyper_parallel.context_parallel import collectives as C
    from hyper_parallel.context_parallel import launch_all_gather

    mesh = cp_mesh()
    p, r = mesh.size(), dist.get_rank()
    x = full_tensor((2, 3, 4), seed=100 + r).requires_grad_(True)
    handle = launch_all_gather(x, dim, mesh)
    out = handle.wait()
    (out * full_tensor(out.shape, seed=200 + r)).sum().backward()

    from hyper_parallel.context_parallel import transport as T

    g = T.resolve_group(mesh)
    big = full_tensor((2, 3 * p, 4), seed=300 + r)
    rs = T.start_reduce_scatter(big, 1, g, "t", "backward", "user").wait()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "rs": rs,
        "pending": C.pending_collectives(),
    }


def rank_pending_detection() -> dict[str, Any]:
    from hyper_parallel.context_parallel import launch_seq_to_head, pending_collectives

    mesh = cp_mesh()
    m = build(False)
    parallelize_mla(m, mesh, strategy="expanded")
    x, dy = inputs()
    xl = shard_sequence(x, mesh)
    report: dict[str, Any] = {}

    # a user's own handle may be in flight across the block: not an error, but listed
    mine = launch_seq_to_head(xl.view(*xl.shape[:2], 4, 6), 1, 2, mesh, name="mine")
    report["pending_user"] = pending_collectives()
    report["forward_with_user_handle"] = tuple(m(xl).shape)
    mine.wait()

    # an exception between launch and wait inside the block leaks its K/V all-to-alls
    def failing_q_proj(*args: Any) -> torch.Tensor:
        raise RuntimeError("boom in the Q projection")

    m.q_proj.forward = failing_q_proj  # type: ignore[method-assign]
    try:
        m(xl)
    except RuntimeError as e:
        report["first_failure"] = str(e)
    del m.q_proj.forward
    report["pending_after_failure"] = pending_collectives()
    try:
        m(xl)
        report["forward_after_failure"] = "no error"
    except RuntimeError as e:
        report["forward_after_failure"] = str(e)

    # a partial autograd.grad (only o_proj.weight) prunes the node that waits dO
    out = m(xl.clone().requires_grad_(True))
    torch.autograd.grad((out * shard_sequence(dy, mesh)).sum(), [m.o_proj.weight])
    report["pending_after_partial_grad"] = pending_collectives()
    try:
        m(xl)
        report["forward_after_partial_grad"] = "no error"
    except RuntimeError as e:
        report["forward_after_partial_grad"] = str(e)
    out = m(xl)  # reported and forgotten: the block works again
    report["works_after"] = bool(torch.isfinite(out).all())
    report["pending_at_end"] = pending_collectives()
    return report


def rank_hybrid_groups(degree: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from hyper_parallel.context_parallel import hybrid_meshes

    umesh, gmesh = hybrid_meshes(cp_mesh(), degree)
    return (
        tuple(dist.get_process_group_ranks(umesh.get_group())),
        tuple(dist.get_process_group_ranks(gmesh.get_group())),
    )


def rank_hybrid_attention(degree: int, shape: tuple[int, ...]) -> dict[str, Any]:
    import torch.nn.functional as F

    from hyper_parallel.context_parallel import hybrid_attention

    mesh = cp_mesh()
    q, k, v, dy = (full_tensor(shape, seed=s) / 50 for s in (1, 2, 3, 4))
    q, k, v = (shard_sequence(t, mesh).clone().requires_grad_(True) for t in (q, k, v))
    out = hybrid_attention(F.scaled_dot_product_attention, q, k, v, mesh, degree)
    out.backward(shard_sequence(dy, mesh))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _module_snapshot(m: torch.nn.Module) -> tuple:
    return (
        type(m),
        sorted(m.__dict__),
        {k: v.clone() for k, v in m.state_dict().items()},
        [id(p) for p in m.parameters()],
    )


def _same(a: tuple, b: tuple) -> bool:
    return (
        a[0] is b[0]
        and a[1] == b[1]
        and a[2].keys() == b[2].keys()
        and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
        and a[3] == b[3]
    )


def rank_errors() -> dict[str, Any]:
    """Every rejected input on every rank: (exception type, message), no collective launched,
    module untouched; then the group and the block still work."""
    import torch.nn as nn

    from hyper_parallel.context_parallel import (
        hybrid_meshes,
        is_context_parallel,
        record_events,
        ulysses_head_to_seq,
        ulysses_seq_to_head,
    )
    from hyper_parallel.context_parallel import parallel_mla as PM

    mesh = cp_mesh()
    p = mesh.size()
    m = build(True)
    odd_heads = MultiHeadLatentAttention(MLAConfig(24, p + 1, None, 10, 6, 4, 5)).double()
    t = torch.zeros(2, 4 * p, 4 * p, 3, dtype=torch.float64)
    cases: dict[str, Any] = {
        "not_mla": lambda: parallelize_mla(nn.Linear(2, 2), mesh),
        "heads_not_divisible": lambda: parallelize_mla(odd_heads, mesh),
        "bad_strategy": lambda: parallelize_mla(m, mesh, strategy="ring"),
        "overlap_not_bool": lambda: parallelize_mla(m, mesh, overlap="yes"),
        "mesh_not_a_mesh": lambda: parallelize_mla(m, dist.group.WORLD),
        "seq_not_divisible": lambda: shard_sequence(torch.zeros(1, 4 * p + 1, 24), mesh),
        "a2a_heads_not_divisible": lambda: ulysses_seq_to_head(t[:, :, :1], 1, 2, mesh),
        "a2a_seq_not_divisible": lambda: ulysses_head_to_seq(t[:, :1], 1, 2, mesh),
        "a2a_same_dims": lambda: ulysses_seq_to_head(t, 2, 2, mesh),
        "a2a_dim_out_of_range": lambda: ulysses_seq_to_head(t, 1, 4, mesh),
        "degree_float": lambda: hybrid_meshes(mesh, 2.0),
        "degree_bool": lambda: hybrid_meshes(mesh, True),
        "degree_one": lambda: hybrid_meshes(mesh, 1),
        "degree_equals_p": lambda: hybrid_meshes(mesh, p),
        "degree_not_dividing": lambda: hybrid_meshes(mesh, 3),
    }
    if p == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        cases["mesh_2d"] = lambda: parallelize_mla(m, mesh2d)
    report: dict[str, Any] = {}
    before = _module_snapshot(m)
    with record_events() as rec:
        for name, fn in cases.items():
            try:
                fn()
                report[name] = ("no error", "")
            except Exception as e:
                report[name] = (type(e).__name__, str(e))
        report["module_untouched"] = _same(before, _module_snapshot(m)) and not is_context_parallel(
            m
        )

        # a failure inside the rewrite (hp-dtensor's install, whose own rollback its tests
        # check) leaves the module as it was
        real_install = PM.install_forward

        def failing_install(*args, **kwargs):
            raise RuntimeError("injected failure")

        PM.install_forward = failing_install
        try:
            parallelize_mla(m, mesh)
            report["rollback"] = ("no error", "")
        except RuntimeError as e:
            report["rollback"] = ("RuntimeError", str(e))
        finally:
            PM.install_forward = real_install
        report["rolled_back"] = _same(before, _module_snapshot(m)) and not is_context_parallel(m)

        parallelize_mla(m, mesh, strategy="latent")
        try:
            parallelize_mla(m, mesh)
            report["double"] = ("no error", "")
        except RuntimeError as e:
            report["double"] = ("RuntimeError", str(e))
        try:
            m(torch.zeros(2, 4, 7, dtype=torch.float64))
            report["bad_hidden"] = ("no error", "")
        except ValueError as e:
            report["bad_hidden"] = ("ValueError", str(e))
        report["launches_during_errors"] = [e.name for e in rec.events if e.kind == "launch"]

    # the group still works and the block (applied once) still matches its shards
    one = torch.ones(1)
    dist.all_reduce(one)
    report["all_reduce_after"] = one.item()
    x, _ = inputs()
    out = m(shard_sequence(x, mesh))
    report["block_works_after"] = tuple(out.shape)
    return report


def rank_parallel_style() -> dict[str, Any]:
    """parallelize_module with ContextParallelMLA on a submodule; then undo it."""
    from torch import nn
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_parallel.context_parallel import (
        ContextParallelMLA,
        is_context_parallel,
        unparallelize_mla,
    )

    mesh = cp_mesh()
    model = nn.Sequential(build(False))
    parallelize_module(model, mesh, {"0": ContextParallelMLA("latent", overlap=True)})
    x, _ = inputs()
    out = model(shard_sequence(x, mesh))
    was_cp = is_context_parallel(model[0])
    unparallelize_mla(model[0])
    return {
        "out": out.detach(),
        "was_cp": was_cp,
        "undone": not is_context_parallel(model[0]) and type(model[0]) is MultiHeadLatentAttention,
        "serial_after_undo": model(x).detach(),
    }


def rank_deepcopy_parallel() -> bool:
    """A deep copy of a rewritten block is rewritten on the same mesh and computes the same."""
    import copy

    mesh = cp_mesh()
    m = parallelize_mla(build(True), mesh, strategy="latent")
    twin = copy.deepcopy(m)
    x, _ = inputs()
    xl = shard_sequence(x, mesh)
    return type(twin) is type(m) and torch.equal(twin(xl), m(xl))
