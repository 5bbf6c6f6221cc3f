"""Bad inputs raise the same clear error on every rank, before any communication."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import parallelize_model, shard_batch
from hyper_parallel.models.testing import random_batch, tiny_model


def _error(fn):
    try:
        fn()
    except Exception as exc:  # the test compares type and message
        return type(exc).__name__, str(exc)
    return None


def _bad_inputs():
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    mesh = unflatten(world, "world", (1, 2), ("cp", "tp"))
    wrong_names = unflatten(world, "world", (1, 2), ("dp", "tp"))
    errors = {}
    errors["unsupported"] = _error(lambda: parallelize_model(torch.nn.Linear(4, 4), mesh))
    errors["1d_mesh"] = _error(lambda: parallelize_model(tiny_model("kimi"), world))
    errors["dim_names"] = _error(lambda: parallelize_model(tiny_model("kimi"), wrong_names))
    errors["heads"] = _error(
        lambda: parallelize_model(
            tiny_model("deepseek", num_attention_heads=3, num_key_value_heads=3), mesh
        )
    )
    errors["strategy"] = _error(
        lambda: parallelize_model(tiny_model("kimi"), mesh, mla_strategy="x")
    )
    errors["grad_reduction"] = _error(
        lambda: parallelize_model(tiny_model("kimi"), mesh, grad_reduction="ddp")
    )
    dp_mesh = unflatten(world, "world", (2, 1, 1), ("dp", "cp", "tp"))
    errors["dp_rows"] = _error(lambda: shard_batch(random_batch(bsz=3, seq=16), dp_mesh))
    bad_3d = unflatten(world, "world", (1, 2, 1), ("cp", "dp", "tp"))
    errors["3d_names"] = _error(lambda: parallelize_model(tiny_model("kimi"), bad_3d))
    batch = random_batch(seq=16)
    errors["seq"] = _error(lambda: shard_batch(random_batch(seq=15), mesh))
    padded = {**batch, "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    padded["attention_mask"][0, -3:] = 0
    errors["padding"] = _error(lambda: shard_batch(padded, mesh))
    model = parallelize_model(tiny_model("kimi"), mesh)
    local = shard_batch(batch, mesh)
    errors["twice"] = _error(lambda: parallelize_model(model, mesh))
    errors["save_state_dict"] = _error(lambda: model.save_pretrained("unused", state_dict={}))
    errors["save_to_hub"] = _error(lambda: model.save_pretrained("unused", push_to_hub=True))
    errors["use_cache"] = _error(lambda: model(**local, use_cache=True))
    errors["mask"] = _error(lambda: model(**local, attention_mask=torch.ones(2, 8)))
    unshifted = {k: v for k, v in local.items() if k != "shift_labels"}
    errors["labels"] = _error(lambda: model(**unshifted))
    # the full batch, not this rank's block: no positions from shard_batch
    errors["no_shard_batch"] = _error(lambda: model(**batch))
    wrong_pos = {**local, "position_ids": torch.arange(16).expand(2, 16)}
    errors["positions"] = _error(lambda: model(**wrong_pos))
    errors["cache_position"] = _error(lambda: model(**local, cache_position=torch.arange(8)))
    errors["generate"] = _error(lambda: model.generate(batch["input_ids"], use_cache=False))
    # still usable after every rejected call: the ranks never entered a collective
    errors["after"] = model(**local).loss.item()
    return errors


EXPECTED = {
    "unsupported": ("TypeError", "KimiLinearForCausalLM, KimiLinearModel, DeepseekV3ForCausalLM"),
    "1d_mesh": ("ValueError", "2-D with dims named ('cp', 'tp')"),
    "dim_names": ("ValueError", "dims ('dp', 'tp')"),
    "heads": ("ValueError", "3 attention heads are not divisible by cp·tp = 1·2 = 2"),
    "strategy": ("ValueError", "mla_strategy must be one of"),
    "grad_reduction": ("ValueError", "grad_reduction must be one of"),
    "seq": ("ValueError", "T=15 is not divisible by cp·tp"),
    "dp_rows": ("ValueError", "batch size B=3 is not divisible by dp = 2"),
    "3d_names": ("ValueError", "or 3-D with dims ('dp', 'cp', 'tp')"),
    "padding": ("ValueError", "padding is not supported under context parallelism"),
    "twice": ("RuntimeError", "already applied"),
    "save_state_dict": ("ValueError", "save_pretrained(state_dict=...) is not supported"),
    "save_to_hub": ("ValueError", "save_pretrained(push_to_hub=...) is not supported"),
    "use_cache": ("ValueError", "use_cache=True is not supported"),
    "mask": ("ValueError", "attention_mask is not supported"),
    "labels": ("ValueError", "labels need shift_labels"),
    "no_shard_batch": ("ValueError", "call model(**shard_batch(batch, mesh))"),
    "positions": ("ValueError", "position_ids (2, 16) do not match the block's (2, 8)"),
    "cache_position": ("ValueError", "incremental decoding is not split across ranks"),
    "generate": ("NotImplementedError", "generate() is not supported on a parallelised model"),
}


@pytest.mark.timeout(180)
def test_bad_inputs_raise_on_every_rank_before_communicating():
    results = run_distributed(_bad_inputs, 2, timeout=150)
    for rank, errors in enumerate(results):
        for case, (kind, words) in EXPECTED.items():
            assert errors[case] is not None, f"rank {rank}: {case} was accepted"
            assert errors[case][0] == kind, (rank, case, errors[case])
            assert words in errors[case][1], (rank, case, errors[case])
        assert errors["after"] == results[0]["after"]
