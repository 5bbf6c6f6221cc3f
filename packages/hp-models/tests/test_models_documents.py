"""Packed documents through whole stock models: ``shard_batch`` of one packed row
(``position_ids`` restarting at 0 per document, optionally HF's ``cu_seq_lens_q``; labels
``-100`` at each document's first token, as ``DataCollatorWithFlattening`` writes them) gives
``model(**local)`` whose loss, logits and gradients equal the stock serial model run on each
document alone (Kimi-Linear: KDA + MLA + MoE; DeepSeek-V3: MLA with RoPE + MoE), float64, on 2
ranks ((cp, tp) = (2, 1), (1, 2)) and 4 ranks ((2, 2), (4, 1)). Documents start at a rank
boundary and inside blocks, span ranks, are shorter than the convolution window and of length
1; every layer's projections see only the rank's block. Bad packed batches raise
``ValueError`` on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _models_testutil import grads, shard_errors, shifted_loss

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import IGNORE_INDEX, parallelize_model, shard_batch, sync_gradients
from hyper_parallel.models.testing import tiny_model

SEQ = 16
OFFSETS = [0, 3, 4, 8, 9, 16]  # length 1, shorter than the conv window, at a boundary, spanning
KINDS = ("kimi", "deepseek")
SHAPES = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}


def _batch(with_table: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (1, SEQ), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(b - a) for a, b in zip(OFFSETS, OFFSETS[1:])])[None]
    labels[0, OFFSETS[:-1]] = IGNORE_INDEX  # the flattening collator's labels
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if with_table:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(OFFSETS, dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = 7  # type: ignore[assignment]
    return batch


def _serial(kind: str) -> dict[str, Any]:
    """The stock model on each document alone; the loss of the packed row (targets shifted on
    the full row: a document's last token targets the next one's first, which is -100)."""
    model = tiny_model(kind)
    batch = _batch()
    ids, labels = batch["input_ids"], batch["labels"]
    logits = torch.cat(
        [model(input_ids=ids[:, a:b]).logits for a, b in zip(OFFSETS, OFFSETS[1:])], dim=1
    )
    loss = shifted_loss(logits, labels)
    loss.backward()
    whole = tiny_model(kind)(input_ids=ids, labels=labels).loss.item()  # across documents
    return {"loss": loss.item(), "logits": logits.detach(), "grads": grads(model), "whole": whole}


def _bad(mesh: Any) -> dict[str, str]:
    good = _batch()
    two_rows = {k: v.expand(2, SEQ) for k, v in good.items()}
    cases = {
        "two_rows": two_rows,
        "table_start": {**good, "cu_seq_lens_q": torch.tensor([1, 3, 16])},
        "table_end": {**good, "cu_seq_lens_q": torch.tensor([0, 3, 15])},
        "table_order": {**good, "cu_seq_lens_q": torch.tensor([0, 5, 3, 16])},
        "table_vs_positions": {**good, "cu_seq_lens_q": torch.tensor([0, 5, 16])},
        "table_float": {**good, "cu_seq_lens_q": torch.tensor([0.0, 16.0])},
        "q_vs_k": {**good, "cu_seq_lens_q": torch.tensor(OFFSETS),
                   "cu_seq_lens_k": torch.tensor([0, 16])},
    }  # fmt: skip
    return shard_errors(cases, mesh)


def _record(seen: dict[str, tuple[int, ...]], name: str) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        seen.setdefault(name, tuple(args[0].shape))

    return hook


def _run(world_size: int) -> dict[str, Any]:
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    res: dict[str, Any] = {}
    for kind in KINDS:
        for cp, tp in SHAPES[world_size]:
            mesh = unflatten(world, "world", (cp, tp), ("cp", "tp"))
            # the first mesh shape also splits the MoE experts over every rank (hp-moe)
            ep = world_size if (cp, tp) == SHAPES[world_size][0] else 1
            model = parallelize_model(tiny_model(kind), mesh, grad_reduction="allreduce", ep=ep)
            seen: dict[str, tuple[int, ...]] = {}
            hooks = []
            for name, mod in model.named_modules():
                if name.endswith(("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")):
                    hooks.append(mod.register_forward_hook(_record(seen, name)))
            with_table = (cp, tp) in ((1, 2), (4, 1))
            local = shard_batch(_batch(with_table), mesh)
            out = model(**local)
            out.loss.backward()
            sync_gradients(model)
            for h in hooks:
                h.remove()
            res[(kind, cp, tp)] = {
                "loss": out.loss.item(),
                "logits": out.logits.detach(),
                "grads": grads(model),
                "seen": seen,
                "table": local["cu_seqlens"].tolist(),
            }
    res["bad"] = _bad(unflatten(world, "world", SHAPES[world_size][0], ("cp", "tp")))
    return res


BAD = {
    "two_rows": "need one row",
    "table_start": "shard_batch: cu_seq_lens_q must start at 0, got 1 ([1, 3, 16])",
    "table_end": "cu_seq_lens_q must end at the sequence length T=16, got 15",
    "table_order": "must be strictly increasing",
    "table_vs_positions": "differ",
    "table_float": "integer tensor",
    "q_vs_k": "cu_seq_lens_q and cu_seq_lens_k differ",
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents_give_the_serial_model_on_each_document_alone(world_size: int) -> None:
    results = run_distributed(_run, world_size, world_size, timeout=400)
    p = world_size
    for kind in KINDS:
        ref = _serial(kind)
        assert abs(ref["whole"] - ref["loss"]) > 1e-4  # the documents matter
        for cp, tp in SHAPES[world_size]:
            key = (kind, cp, tp)
            got = [r[key] for r in results]
            for r in got:
                assert r["loss"] == pytest.approx(ref["loss"], rel=2e-6), key
                assert r["table"] == OFFSETS, key
                assert r["seen"] and all(s == (1, SEQ // p, 32) for s in r["seen"].values()), (
                    key, r["seen"],
                )  # fmt: skip
            logits = torch.cat([r["logits"] for r in got], dim=1)
            torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-6)
            for name, want in ref["grads"].items():
                assert want.abs().max() > 0, (key, name)
                for r in got:
                    torch.testing.assert_close(
                        r["grads"][name], want, rtol=1e-5, atol=1e-6, msg=f"{key} {name}"
                    )
    for r in results:
        for name, fragment in BAD.items():
            assert fragment in r["bad"][name], (name, r["bad"][name])
