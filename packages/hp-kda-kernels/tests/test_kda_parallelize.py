"""parallelize_kda on the stock Hugging Face KimiLinearDeltaAttention: the parallel layer on 2
and 4 gloo ranks equals the serial stock layer on the whole sequence (float64 inputs and
weights): output, input gradient and every parameter gradient (conv weight included), for every
protocol, with blocks longer than, shorter than the convolution window, and empty. Also inside
a stock KimiLinearModel, with what the model passes to the layer when there is no padding."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _kda_hf import kda_layer, kimi, tiny_config
from _kda_testutil import max_rel_err
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.dtensor import flatten, init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.kda import (
    ContextParallelKDA,
    PendingHalo,
    parallelize_kda,
    unparallelize_kda,
)

B, D = 2, 32
# (T, protocol, group_size, block cuts or None for even blocks). Conv kernel 4: a block of
# fewer than 3 rows makes the halo span several ranks; T=3 on 4 ranks leaves rank 0 empty.
CASES: dict[int, list[tuple[int, str, int | None, Any]]] = {
    2: [(13, "p2p", None, None), (13, "allgather", None, None), (13, "grouped", None, None),
        (13, "auto", None, None), (5, "p2p", None, [0, 2, 5])],
    4: [(13, "p2p", None, None), (13, "allgather", None, None), (13, "grouped", 2, None),
        (13, "auto", None, None), (6, "p2p", None, None), (6, "grouped", 2, None),
        (7, "allgather", None, [0, 3, 3, 5, 7]), (3, "auto", None, None),
        # on the flattened ("cp", "tp") mesh hp-models passes
        (13, "grouped", 2, "flat"), (6, "auto", None, "flat")],
}  # fmt: skip


def _cuts(T: int, P: int, cuts: Any) -> list[int]:
    return cuts if isinstance(cuts, list) else [T * i // P for i in range(P + 1)]


def _input(T: int) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(T), dtype=torch.float64)


def _weights(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in module.named_parameters()
    }


def _layer_rank(P: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("cp",))
    flat = flatten(init_device_mesh("cpu", (2, P // 2), mesh_dim_names=("cp", "tp")))
    r = dist.get_rank()
    results = []
    for T, protocol, width, cuts in CASES[P]:
        layer = kda_layer()
        params = {n: id(p) for n, p in layer.named_parameters()}
        signature = inspect.signature(layer.forward)
        parallelize_kda(
            layer, flat if cuts == "flat" else mesh, protocol=protocol, group_size=width
        )
        assert {n: id(p) for n, p in layer.named_parameters()} == params
        assert inspect.signature(layer.forward) == signature
        lo, hi = _cuts(T, P, cuts)[r : r + 2]
        x = _input(T)[:, lo:hi].clone().requires_grad_()
        out = layer(x)
        (out * _weights(out.shape, seed=r)).sum().backward()
        results.append((out.detach(), x.grad, _grads(layer)))
        unparallelize_kda(layer)
        assert type(layer).__name__ == "KimiLinearDeltaAttention"
    if P == 4:
        return {"layers": results}
    return {"layers": results, "model": _model_rank(mesh, r), "order": _overlap_order(mesh)}


def _overlap_order(mesh: Any) -> list[str]:
    """The order of halo and gate events in one forward and backward on this rank."""
    layer = parallelize_kda(kda_layer(), mesh, protocol="p2p")
    events: list[str] = []
    saved = {n: getattr(PendingHalo, n) for n in ("_launch", "_finish", "_launch_backward")}

    def logged(name: str) -> Any:
        def run(self: Any, *args: Any) -> Any:
            events.append(name)
            return saved[name](self, *args)

        return run

    for name in saved:
        setattr(PendingHalo, name, logged(name))
    hooks = [
        layer.forget_gate.register_forward_hook(lambda *_: events.append("gate forward")),
        layer.forget_gate.f_a_proj.register_full_backward_hook(
            lambda *_: events.append("gate backward")
        ),
    ]
    try:
        layer(_input(8)[:, :4].clone().requires_grad_()).sum().backward()
    finally:
        for name, fn in saved.items():
            setattr(PendingHalo, name, fn)
        for hook in hooks:
            hook.remove()
    return events


def _model(seed: int = 0) -> torch.nn.Module:
    config = tiny_config(
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        mlp_layer_types=["dense"] * 2,
    )
    torch.manual_seed(seed)
    return kimi().KimiLinearModel(config).double()


MODEL_T = 10


def _model_rank(mesh: Any, r: int) -> tuple[Any, ...]:
    """Each KDA layer of a stock KimiLinearModel parallelized, as hp-models does; the model
    runs on this rank's block with an all-ones attention mask (what a tokenizer gives for an
    unpadded batch), which KimiLinearModel turns into None; a generation cache (what the model
    passes with ``use_cache=True``, the config's default) is rejected."""
    model = _model()
    parallelize_kda(model.layers[0].self_attn, mesh, protocol="p2p")
    # the ParallelStyle form, through torch's parallelize_module
    parallelize_module(model, mesh, {"layers.1.self_attn": ContextParallelKDA("allgather")})
    assert all(
        type(layer.self_attn).__name__.startswith("ContextParallel") for layer in model.layers
    )
    P = mesh.size()
    lo, hi = MODEL_T * r // P, MODEL_T * (r + 1) // P
    x = _input(MODEL_T)[:, lo:hi].clone().requires_grad_()
    from transformers import DynamicCache

    try:  # what the decoder layer passes when the model runs with use_cache=True
        model.layers[0].self_attn(x, cache_params=DynamicCache(config=model.config))
        cache_error = "NO ERROR"
    except ValueError as exc:
        cache_error = str(exc)
    out = model(
        inputs_embeds=x, attention_mask=torch.ones(B, hi - lo, dtype=torch.long), use_cache=False
    ).last_hidden_state
    (out * _weights(out.shape, seed=r)).sum().backward()
    return out.detach(), x.grad, _grads(model), cache_error


def _reference(
    module: torch.nn.Module, x: torch.Tensor, cuts: list[int], call: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = call(module, x)
    loss = sum(
        (out[:, cuts[r] : cuts[r + 1]] * _weights(out[:, cuts[r] : cuts[r + 1]].shape, r)).sum()
        for r in range(len(cuts) - 1)
    )
    loss.backward()  # type: ignore[union-attr]
    return out.detach(), x.grad, _grads(module)  # type: ignore[return-value]


def _compare(results: list[Any], ref: tuple[Any, ...], tag: Any, tol: float = 1e-5) -> None:
    out, x_grad, grads = ref
    assert max_rel_err(torch.cat([res[0] for res in results], dim=1), out) < tol, tag
    assert max_rel_err(torch.cat([res[1] for res in results], dim=1), x_grad) < tol, tag
    for name, want in grads.items():
        # every parameter takes part (the model's embedding is skipped: inputs_embeds)
        assert want.abs().max() > 0 or name == "embed_tokens.weight", (tag, name)
        got = sum(res[2][name] for res in results)
        assert max_rel_err(got, want) < tol, (tag, name)


@pytest.mark.parametrize("P", [2, 4])
def test_parallel_stock_kda_layer_equals_serial_layer_output_and_every_gradient(P: int) -> None:
    """On 2 ranks also: the layers of a stock KimiLinearModel (one through torch's
    parallelize_module), and the halo in flight while the gate projections run."""
    ranks = run_distributed(_layer_rank, P, P, timeout=300)
    for i, (T, protocol, width, cuts) in enumerate(CASES[P]):
        cut = _cuts(T, P, cuts)
        ref = _reference(kda_layer(), _input(T), cut, lambda m, x: m(x))
        _compare([res["layers"][i] for res in ranks], ref, (P, T, protocol, width, cut))
    if P == 2:
        cut = [MODEL_T * i // P for i in range(P + 1)]

        def run(m: Any, x: torch.Tensor) -> torch.Tensor:
            return m(inputs_embeds=x, use_cache=False).last_hidden_state

        ref = _reference(_model(), _input(MODEL_T), cut, run)
        _compare([res["model"][:3] for res in ranks], ref, "model")
        for res in ranks:
            assert "run the model with use_cache=False" in res["model"][3]
            _check_overlap(res["order"])


def _check_overlap(events: list[str]) -> None:
    """The halo is in flight while the gate projections run, forward and backward."""
    first = events.index
    assert first("_launch") < first("gate forward") < first("_finish"), events
    backward = events[first("_launch_backward") :]
    assert "gate backward" in backward, events
    assert backward.index("gate backward") < backward.index("_finish"), events
