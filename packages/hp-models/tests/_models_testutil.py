"""Helpers shared by the hp-models tests: the (cp, tp) mesh from one world mesh, whole tensors
from DTensors, every parameter's whole gradient, one training step, the comparisons of a
parallel model's gradients and weights with the serial model's, the loss of packed rows and
the errors ``shard_batch`` raises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.models import IGNORE_INDEX, shard_batch, sync_gradients
from hyper_parallel.models.testing import random_batch


def cp_tp_mesh(cp: int, tp: int) -> Any:
    """The (cp, tp) mesh over ``cp·tp`` ranks, made with ``unflatten`` of one world mesh."""
    world = init_device_mesh("cpu", (cp * tp,), mesh_dim_names=("world",))
    return unflatten(world, "world", (cp, tp), ("cp", "tp"))


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (``full_tensor()`` of a DTensor). A copy: after a
    no_grad forward FSDP2 may leave parameters unsharded and free that storage later."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full64(t: torch.Tensor) -> torch.Tensor:
    """:func:`full` in float64."""
    return full(t).double()


def grads(model: torch.nn.Module, strip: str = "") -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name (``strip`` removed from the names), for the
    parameters that have one."""
    return {
        name.replace(strip, "") if strip else name: full(p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: Any, seed: int) -> float:
    """One training step on ``random_batch(seq=16, seed=seed)`` sharded over ``mesh``: forward,
    backward, ``sync_gradients``, ``opt.step()``, ``opt.zero_grad()``; the step's loss."""
    out = model(**shard_batch(random_batch(seq=16, seed=seed), mesh))
    out.loss.backward()
    sync_gradients(model)
    opt.step()
    opt.zero_grad()
    return out.loss.item()


def step_all(*opts: torch.optim.Optimizer) -> None:
    """``step()`` every optimizer, then ``zero_grad()`` every one (the parallel and the serial
    model's, in step)."""
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad()


def assert_grads_like_serial(
    model: torch.nn.Module,
    serial: torch.nn.Module,
    whole: Callable[[torch.Tensor], torch.Tensor] = full64,
    label: str = "",
    **tol: float,
) -> int:
    """Each serial parameter has a gradient exactly when the parallel model's has one, and
    ``whole`` of the parallel gradient equals it within ``tol`` (``label`` prefixes the
    parameter's name in the message); returns how many gradients were compared."""
    compared = 0
    for n, q in serial.named_parameters():
        g = model.get_parameter(n).grad
        assert (g is None) == (q.grad is None), n
        if g is not None:
            compared += 1
            torch.testing.assert_close(
                whole(g), q.grad, **tol, msg=lambda m, n=n: f"{label}{n}: {m}"
            )
    return compared


def assert_params_like_serial(model: torch.nn.Module, serial: torch.nn.Module) -> None:
    """Every parameter of the parallel model equals the serial model's (float64, rtol 1e-4,
    atol 1e-5: after the optimizer steps)."""
    ref_params = dict(serial.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            full64(p), ref_params[n].detach(), rtol=1e-4, atol=1e-5, msg=lambda m, n=n: n
        )


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss of ``logits [B, T, V]``: cross entropy (in float32) against
    ``labels`` shifted left by one (a row's last position targets nothing), averaged over the
    targets that are not ``IGNORE_INDEX``."""
    end = torch.full((labels.shape[0], 1), IGNORE_INDEX)
    targets = torch.cat([labels[:, 1:], end], dim=1)
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return ce / (targets != IGNORE_INDEX).sum()


def shard_errors(cases: dict[str, dict[str, Any]], mesh: Any) -> dict[str, str]:
    """``shard_batch`` of each named batch over ``mesh``: the message of the ``ValueError`` it
    raises, or ``"NO ERROR"``."""
    out = {}
    for name, batch in cases.items():
        try:
            shard_batch(batch, mesh)
            out[name] = "NO ERROR"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The MoE routers that carry DeepSeek-V3's ``e_score_correction_bias``, by name."""
    return {
        n: m
        for n, m in model.named_modules()
        if n.endswith("mlp.gate") and hasattr(m, "e_score_correction_bias")
    }


def serial_loads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per router: the (token, expert) counts (float64) of the serial model's routing of the
    whole ``batch`` (a no-grad forward)."""
    loads, hooks = {}, []
    for name, router in routers(model).items():

        def hook(mod: Any, args: Any, out: Any, name: str = name) -> None:
            n = mod.e_score_correction_bias.numel()
            loads[name] = torch.bincount(out[2].reshape(-1), minlength=n).double()

        hooks.append(router.register_forward_hook(hook))
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return loads
