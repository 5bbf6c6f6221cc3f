"""Mixed precision: a stock Kimi-Linear or DeepSeek-V3 model parallelised by hp-models computes,
under ``torch.autocast`` (bf16, fp16), what the serial model computes under the same autocast;
with FSDP2's ``MixedPrecisionPolicy`` (``mp_policy``) and with pure bf16 weights, what the
serial model computes with bf16 weights. Loss, logits and every gradient.

The tolerance is set by the serial model itself: for every compared tensor ``t``,
``spread(t) = ‖t_serial(low precision) − t_serial(float32)‖`` is how far rounding to the low
precision moves it, and the parallel model must land within a small fraction of that spread of
the serial low-precision result: ``‖t_parallel − t_serial(low precision)‖ ≤ FRACTION ·
spread(t)``. (Summation orders differ across ranks, so an exact match cannot be asked of
bf16; an error in the parallel dtypes — a buffer in the wrong dtype, a float32 step done in
bf16 — shows up as a difference of the order of the spread itself.)
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _models_testutil import cp_tp_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from hyper_parallel.dtensor.testing import run_distributed, run_markdown_example
from hyper_parallel.models import (
    gather_sequence,
    is_model_parallelized,
    parallelize_model,
    shard_batch,
    sync_gradients,
)
from hyper_parallel.models.fsdp import fsdp_available
from hyper_parallel.models.testing import random_batch, tiny_model

SEQ = 16
# Fractions of the serial low-precision-vs-float32 spread (see the module docstring). With
# tp = 1 the forward rounds exactly where the serial one does (measured: logits equal), so its
# logits must land within 0.1 of the spread. With tp > 1 the MLP's down projection is a sum of
# per-rank bf16 partial products (reduce-scattered in bf16, as hp-mc2 carries what autocast
# computes): measured up to 0.8x. A gradient is summed over the ranks that computed a share,
# each share rounded to the low precision first where the serial backward rounds the whole sum
# once: rounding of the order of the spread itself (measured up to 1.0x in bf16, 1.6x in fp16
# on tensors whose spread is tiny), as for the scalar loss (one sample of rounding noise); they
# are held to 2x. The dtype of every module output is checked exactly.
LOGITS_FRACTION = {1: 0.1}  # by tp; otherwise 1.0
GRAD_FRACTION = 2.0
FP16 = torch.float16
BF16 = torch.bfloat16


def _gather(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    return gather_sequence(t, mesh)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()


def _dtype_hooks(model: Any) -> tuple[dict[str, str], list[Any]]:
    """Record the dtype of every module's (first tensor) output, by module path."""
    seen: dict[str, str] = {}

    def hook(name: str) -> Any:
        def record(_m: Any, _args: Any, out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(first, "logits"):
                first = first.logits
            if isinstance(first, torch.Tensor):
                seen[name] = str(first.dtype)

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    return seen, handles


def _results(out: Any, model: Any, whole: Any) -> dict[str, Any]:
    res: dict[str, Any] = {"loss": out.loss.detach().double().reshape(1)}
    res["logits"] = whole(out.logits.detach()).double()
    res["grad_dtypes"] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            res[f"grad:{name}"] = _whole(p.grad)
            res["grad_dtypes"][name] = str(p.grad.dtype)
    return res


def _forward_backward(model: Any, batch: dict, amp: torch.dtype | None, whole: Any) -> dict:
    seen, handles = _dtype_hooks(model)
    with torch.autocast("cpu", dtype=amp or BF16, enabled=amp is not None):
        out = model(**batch)
    for h in handles:
        h.remove()
    out.loss.backward()
    sync_gradients(model) if is_model_parallelized(model) else None
    res = _results(out, model, whole)
    res["dtypes"] = seen
    return res


@contextlib.contextmanager
def _fp32_kda_core() -> Iterator[None]:
    """transformers' torch fallback of ``chunk_kda`` (used where flash-linear-attention is not
    installed) casts its inputs to float32 but then runs its matmuls under the caller's
    autocast, in bf16, state included; FLA's kernel, which the stock model runs on a GPU, keeps
    the state in float32, and so does hp-kda-kernels. The reference runs the fallback with
    autocast off, i.e. with the kernel's dtypes (inputs and output are unchanged: float32 in,
    the input dtype out). Measured without this: the parallel model lands up to 24x the spread
    away from the fallback (MoE routing flips downstream of the bf16 state)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi

    original = kimi.chunk_kimi_delta_attention

    def fp32_core(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False):
            return original(*args, **kwargs)

    kimi.chunk_kimi_delta_attention = fp32_core
    try:
        yield
    finally:
        kimi.chunk_kimi_delta_attention = original


def _serial(kind: str, amp: torch.dtype | None, weights: torch.dtype) -> dict[str, Any]:
    """The serial model on the full batch: ``weights`` parameters, under autocast in ``amp``
    (None: none)."""
    model = tiny_model(kind, seed=0, dtype=weights)
    with _fp32_kda_core():
        return _forward_backward(model, random_batch(seq=SEQ), amp, lambda t: t)


def _parallel(kind: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run: ``cp, tp, amp`` (autocast dtype or None), ``weights`` (parameter dtype) and
    ``parallelize_model`` options; one spawn of ranks for all of them."""
    out_all = []
    for run in runs:
        mesh = cp_tp_mesh(run["cp"], run["tp"])
        model = tiny_model(kind, seed=0, dtype=run["weights"])
        if run.get("checkpointing"):  # the recompute runs under the forward's autocast too
            model.gradient_checkpointing_enable({"use_reentrant": False})
        parallelize_model(model, mesh, **run["options"])
        local = shard_batch(random_batch(seq=SEQ), mesh)
        res = _forward_backward(model, local, run["amp"], functools.partial(_gather, mesh=mesh))
        res["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        out_all.append(res if dist.get_rank() == 0 else {})
    return out_all


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b))


def _check(label: str, par: dict, low: dict, f32: dict, tp: int) -> list[str]:
    """Every tensor of ``par`` against ``low`` within a fraction of the ``low``/``f32``
    spread; the dtype of every module output seen by both; returns the failures."""
    tensors = [k for k in low if k == "loss" or k == "logits" or k.startswith("grad:")]
    assert set(tensors) == {k for k in par if k in tensors or k.startswith("grad:")}
    bad = []
    for key in tensors:
        ref = low[key]
        spread = _distance(ref, f32[key])
        diff = _distance(par[key], ref)
        fraction = LOGITS_FRACTION.get(tp, 1.0) if key == "logits" else GRAD_FRACTION
        # a tensor rounding does not move (spread 0) must match to float32 noise
        limit = fraction * spread + 1e-6 * float(torch.linalg.vector_norm(ref))
        if not diff <= limit:
            bad.append(f"{label} {key}: |par - serial| = {diff:.3g}, spread {spread:.3g}")
    shared = set(par["dtypes"]) & set(low["dtypes"])
    assert len(shared) > 20, sorted(shared)
    for name in sorted(shared):
        if par["dtypes"][name] != low["dtypes"][name]:
            bad.append(
                f"{label} {name}: output {par['dtypes'][name]}, serial {low['dtypes'][name]}"
            )
    return bad


FSDP = {"grad_reduction": "fsdp"}
ALLREDUCE = {"grad_reduction": "allreduce"}
# (cp, tp) = (2, 2) and a second shape per family
SHAPES = {"kimi": (4, 1), "deepseek": (4, 1)}


def _runs(kind: str) -> list[dict[str, Any]]:
    cp, tp = SHAPES[kind]
    fp32 = torch.float32
    red = FSDP if fsdp_available() else ALLREDUCE
    runs = [
        {"cp": 2, "tp": 2, "amp": BF16, "weights": fp32, "options": red},
        {"cp": cp, "tp": tp, "amp": BF16, "weights": fp32, "options": ALLREDUCE},
        {"cp": 2, "tp": 2, "amp": FP16, "weights": fp32, "options": ALLREDUCE},
        {"cp": cp, "tp": tp, "amp": None, "weights": BF16, "options": red},  # pure bf16
    ]
    # run 0 again with Hugging Face's activation checkpointing: the same numbers, bitwise
    runs.append({**runs[0], "checkpointing": True})
    if fsdp_available():  # FSDP2 mixed precision: float32 master weights, bf16 compute
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=fp32)
        runs.append(
            {
                "cp": 2,
                "tp": 2,
                "amp": None,
                "weights": fp32,
                "options": {**FSDP, "mp_policy": policy},
            }
        )
    return runs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["kimi", "deepseek"])
def test_mixed_precision_matches_the_serial_model(kind):
    """Autocast bf16 at (2, 2) and a second shape, fp16 at (2, 2), pure bf16 weights, FSDP2's
    MixedPrecisionPolicy: each against the serial model in the same precision."""
    runs = _runs(kind)
    par = run_distributed(_parallel, 4, kind, runs, timeout=380)[0]
    fp32 = torch.float32
    f32 = _serial(kind, None, fp32)
    refs = {
        ("amp", BF16): _serial(kind, BF16, fp32),
        ("amp", FP16): _serial(kind, FP16, fp32),
        ("weights", BF16): _serial(kind, None, BF16),  # bf16 weights, and FSDP2's bf16 compute
    }
    bad = []
    for run, res in zip(runs, par):
        key = ("amp", run["amp"]) if run["amp"] is not None else ("weights", BF16)
        label = f"{kind} cp={run['cp']} tp={run['tp']} amp={run['amp']} {run['weights']}"
        label += f" {run['options']}"
        bad += _check(label, res, refs[key], f32, run["tp"])
        assert res["logits"].shape == (2, SEQ, 48)
        # master weights and their gradients keep the parameters' dtype
        assert res["param_dtypes"] == [str(run["weights"])], res["param_dtypes"]
        assert set(res["grad_dtypes"].values()) == {str(run["weights"])}, label
    assert not bad, "\n".join(bad)
    recomputed = [res for run, res in zip(runs, par) if run.get("checkpointing")]
    for res in recomputed:
        tensors = [k for k in res if k in ("loss", "logits") or k.startswith("grad:")]
        assert all(torch.equal(res[k], par[0][k]) for k in tensors), "checkpointing changed a value"


def _refused() -> dict[str, Any]:
    mesh = cp_tp_mesh(1, 2)
    out = {}
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for case, kwargs in {
        "type": {"mp_policy": "bf16"},
        "allreduce": {"mp_policy": policy, "grad_reduction": "allreduce"},
    }.items():
        model = tiny_model("deepseek")
        try:
            parallelize_model(model, mesh, **kwargs)
            out[case] = None
        except (TypeError, ValueError) as exc:
            untouched = not is_model_parallelized(model)
            out[case] = (type(exc).__name__, str(exc), untouched)
    return out


@pytest.mark.timeout(240)
def test_mp_policy_without_fsdp_or_of_another_type_raises_on_every_rank():
    for r in run_distributed(_refused, 2, timeout=200):
        name, msg, untouched = r["type"]
        assert name == "TypeError" and "MixedPrecisionPolicy" in msg and untouched
        name, msg, untouched = r["allreduce"]
        assert name == "ValueError" and "grad_reduction='fsdp'" in msg and untouched
        assert "torch.autocast" in msg


README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.timeout(480)
def test_readme_mixed_precision_example_runs():
    if not fsdp_available():
        pytest.skip(f"FSDP2 cannot sum gradients on torch {torch.__version__} (no mp_policy)")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    index = next(i for i, b in enumerate(blocks) if "MixedPrecisionPolicy" in b)
    out = run_markdown_example(README, index=index, timeout=450).splitlines()
    assert out == ["autocast ['torch.float32'] True", "fsdp ['torch.float32'] True"]
