"""``from_pretrained`` and the sharded ``save_pretrained``, against stock transformers:

- a folder written by stock ``save_pretrained`` (hub layout, several shards) loaded by
  ``from_pretrained`` at ``(cp, tp) = (2, 2)`` with ep 4 under FSDP2, and at
  ``(dp, cp, tp) = (2, 2, 1)`` with ep 2 under the all-reduce, equals stock ``from_pretrained``:
  every parameter, the loss and every gradient, the three families; the ranks' reads partition the
  folder (every byte read once) under FSDP2;
- after a step, the parallel ``save_pretrained`` folder equals stock ``save_pretrained`` of the
  same weights key for key and value for value; saved at ep 4, it loads at ep 2;
- an FP8 folder made the way DeepSeek-V3's is (``float8_e4m3fn`` blocks with float32
  ``weight_scale_inv``, edge blocks partial, an MTP layer the model has no place for) loads as
  the dequantised weights;
- bad folders raise one clear error on every rank.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from _models_testutil import assert_grads_like_serial, cp_tp_mesh, full, full64
from safetensors.torch import load_file, save_file

from hyper_parallel.dtensor import init_device_mesh, unflatten
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.models import from_pretrained, load_report, shard_batch, sync_gradients
from hyper_parallel.models.hub import model_tensors
from hyper_parallel.models.testing import import_transformers, random_batch, tiny_model

LOAD = {"dtype": torch.float64, "experts_implementation": "eager"}
TOL = {"rtol": 2e-5, "atol": 2e-6}  # Kimi-Linear's KDA computes in float32
MOE = {
    "kimi": {"num_experts": 8},
    "deepseek": {"n_routed_experts": 8},
    "qwen3-next": {"num_experts": 8},
}
BLOCK = 8  # the FP8 block edge here (DeepSeek-V3: 128): the tiny weights end in partial blocks


def _read_folder(folder):
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        return load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        weight_map = json.load(fh)["weight_map"]
    out = {}
    for name in sorted(set(weight_map.values())):
        out.update(load_file(os.path.join(folder, name)))
    assert set(out) == set(weight_map)
    return out


def _mesh(dims):
    if len(dims) == 2:
        return cp_tp_mesh(*dims)
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    return unflatten(world, "world", dims, ("dp", "cp", "tp"))


def _check_against_stock(folder, dims, ep, reduction, seed):
    """``from_pretrained`` of ``folder`` against stock: parameters, loss, gradients."""
    tf = import_transformers()
    mesh = _mesh(dims)
    model = from_pretrained(folder, mesh, ep=ep, grad_reduction=reduction, **LOAD)
    serial = tf.AutoModelForCausalLM.from_pretrained(folder, **LOAD)
    ours = dict(model.named_parameters())
    assert set(ours) == set(dict(serial.named_parameters()))
    for n, p in serial.named_parameters():
        assert torch.equal(full(ours[n]), p.detach()), n
    batch = random_batch(bsz=2, seq=16, seed=seed)
    out = model(**shard_batch(batch, mesh))
    out.loss.backward()
    sync_gradients(model)
    ref = serial(**batch).loss
    ref.backward()
    torch.testing.assert_close(out.loss.item(), ref.item(), **TOL)
    compared = assert_grads_like_serial(model, serial, full64, **TOL)
    assert compared == len(ours)
    return model, load_report(model)


def _round_trip(tmp, kind):
    """Stock folder -> ours at (2, 2) ep 4 FSDP2 -> a step -> our save, compared with stock's
    save of the same weights."""
    rank = dist.get_rank()
    source = os.path.join(tmp, f"{kind}-stock")
    model, report = _check_against_stock(source, (2, 2), 4, "fsdp", seed=1)
    whole = [t for t in model_tensors(model).values() if not hasattr(t, "to_local")]
    reads = {"bytes": report.bytes_read, "folder": report.folder_bytes,
             "whole": sum(t.numel() * t.element_size() for t in whole)}  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    weights = {n: full(t) for n, t in model_tensors(model).items()}
    saved = os.path.join(tmp, f"{kind}-ep4")
    model.save_pretrained(saved, max_shard_size="16KB")
    written = len(os.listdir(saved))
    if rank == 0:  # stock save of the same weights: the same keys and values
        plain = tiny_model(kind, seed=5, **MOE[kind])
        plain.load_state_dict(weights)
        plain.save_pretrained(os.path.join(tmp, f"{kind}-ep4-stock"))
    dist.barrier()
    ours, stock = _read_folder(saved), _read_folder(os.path.join(tmp, f"{kind}-ep4-stock"))
    assert set(ours) == set(stock)
    for key, value in stock.items():
        assert torch.equal(ours[key], value), key
    return {"reads": reads, "written": written}


def _load_elsewhere(tmp, kind):
    """The folder saved at ep 4 on (2, 2), loaded at ep 2 on (2, 2, 1) under the all-reduce
    (a new process group: a mesh of another layout), saved again: stock's keys and values."""
    tf = import_transformers()
    stock = _read_folder(os.path.join(tmp, f"{kind}-ep4-stock"))
    again, _ = _check_against_stock(os.path.join(tmp, f"{kind}-ep4"), (2, 2, 1), 2, "allreduce", 2)
    again.save_pretrained(os.path.join(tmp, f"{kind}-ep2"))
    ours = _read_folder(os.path.join(tmp, f"{kind}-ep2"))
    assert set(ours) == set(stock)
    for key, value in ours.items():
        assert torch.equal(value, stock[key]), key
    plain = tf.AutoModelForCausalLM.from_pretrained(os.path.join(tmp, f"{kind}-ep2"), **LOAD)
    reference = tf.AutoModelForCausalLM.from_pretrained(
        os.path.join(tmp, f"{kind}-ep4-stock"), **LOAD
    )
    for (n, p), (m, q) in zip(plain.named_parameters(), reference.named_parameters()):
        assert n == m and torch.equal(p, q), n
    return True


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["kimi", "deepseek", "qwen3-next"])
def test_from_pretrained_and_save_pretrained_match_stock(tmp_path, kind):
    tiny_model(kind, seed=3, **MOE[kind]).save_pretrained(
        tmp_path / f"{kind}-stock", max_shard_size="20KB"
    )
    res = run_distributed(_round_trip, 4, str(tmp_path), kind, timeout=300)
    assert run_distributed(_load_elsewhere, 4, str(tmp_path), kind, timeout=300) == [True] * 4
    # under FSDP2 at (2, 2) with ep 4 every parameter is split over the four ranks: the reads
    # partition the folder, no byte read twice but the routers' bias buffers (whole everywhere;
    # Qwen3-Next's router has none)
    folder, whole = res[0]["reads"]["folder"], res[0]["reads"]["whole"]
    assert whole < 1000 and (whole > 0) == (kind != "qwen3-next")
    assert sum(r["reads"]["bytes"] for r in res) == folder + 3 * whole
    assert max(r["reads"]["bytes"] for r in res) < res[0]["reads"]["folder"] / 2
    assert len(os.listdir(tmp_path / f"{kind}-ep4")) > 4  # several files, from every rank
    saved = os.listdir(tmp_path / f"{kind}-ep4")
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(saved)


# ---- FP8 ---------------------------------------------------------------------------------------


def _quantise(w):
    """DeepSeek-V3's FP8 form of a 2-D weight: ``float8_e4m3fn`` values and a float32 scale per
    ``BLOCK × BLOCK`` block (``w ≈ q · scale_inv``), edge blocks partial."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (blk / s).to(q.dtype)
    return q, scale


def _dequantised(q, scale):
    """The reference: every element times its block's scale, block by block."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows = slice(i * BLOCK, (i + 1) * BLOCK)
            cols = slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def _fp8_folder(src, dst):
    """``src`` (a stock folder) with every 2-D projection in FP8 blocks, an MTP layer appended
    (``model.layers.<L>.*``: no place in the model) and ``quantization_config`` set; returns the
    dequantised weights by hub key."""
    tensors = _read_folder(src)
    expected = {}
    out = {}
    for key, w in tensors.items():
        if key.endswith("proj.weight") and w.dim() == 2:
            q, s = _quantise(w)
            out[key], out[key + "_scale_inv"] = q, s
            expected[key] = _dequantised(q, s).double()
        else:
            out[key] = w
    layers = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"]
    out[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)  # the MTP layer
    os.makedirs(dst)
    half = sorted(out)[: len(out) // 2]
    files = {"model-00001-of-00002.safetensors": half,
             "model-00002-of-00002.safetensors": sorted(set(out) - set(half))}  # fmt: skip
    for name, keys in files.items():
        save_file({k: out[k].contiguous() for k in keys}, os.path.join(dst, name))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in files.items() for k in ks}}
    json.dump(index, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }  # fmt: skip
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return expected


def _load_fp8(folder, expected):
    model = from_pretrained(folder, cp_tp_mesh(2, 2), ep=2, grad_reduction="fsdp", **LOAD)
    weights = {n: full(p) for n, p in model.named_parameters()}
    checked = 0
    for key, value in expected.items():  # hub keys: dense projections, per-expert weights
        if ".experts." in key:
            layer, e, which = (
                key.split(".mlp.experts.")[0],
                *key.split(".experts.")[1].split(".")[:2],
            )
            fused = weights[
                f"{layer}.mlp.experts." + ("down_proj" if which == "down_proj" else "gate_up_proj")
            ]
            half = fused.shape[1] // 2
            got = {"gate_proj": fused[int(e), :half], "up_proj": fused[int(e), half:],
                   "down_proj": fused[int(e)]}[which]  # fmt: skip
        else:
            got = weights[key]
        assert torch.equal(got, value), key
        checked += 1
    loss = model(**shard_batch(random_batch(seq=16, seed=3), cp_tp_mesh(2, 2))).loss.item()
    return checked, loss, load_report(model).bytes_read


@pytest.mark.timeout(300)
def test_fp8_blocks_are_dequantised_and_the_mtp_layer_skipped(tmp_path):
    tiny_model("deepseek", seed=4).save_pretrained(tmp_path / "bf", max_shard_size="20KB")
    expected = _fp8_folder(str(tmp_path / "bf"), str(tmp_path / "fp8"))
    res = run_distributed(_load_fp8, 4, str(tmp_path / "fp8"), expected, timeout=200)
    assert all(r[0] == len(expected) for r in res)
    assert len(expected) > 20  # attention, dense MLPs, shared and routed experts
    assert len({r[1] for r in res}) == 1 and torch.isfinite(torch.tensor(res[0][1]))


# ---- bad folders ---------------------------------------------------------------------------------


def _errors(tmp):
    mesh = cp_tp_mesh(1, 2)
    out = {}
    for name in ("missing", "shape", "llama", "empty", "no_weights"):
        try:
            from_pretrained(os.path.join(tmp, name), mesh, **LOAD)
            out[name] = None
        except Exception as exc:  # the test compares type and message
            out[name] = (type(exc).__name__, str(exc))
    model = from_pretrained(os.path.join(tmp, "good"), mesh, **LOAD)
    for name, kwargs in (("size", {"max_shard_size": "lots"}), ("variant", {"variant": "x"})):
        try:
            model.save_pretrained(os.path.join(tmp, "out"), **kwargs)
            out[name] = None
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
    return out


EXPECTED = {
    "missing": ("ValueError", "model.layers.0.self_attn.q_a_proj.weight (for "),
    "shape": ("ValueError", "model.norm.weight (for model.norm.weight) has shape [7]"),
    "llama": ("TypeError", "hp-models parallelises KimiLinearForCausalLM, DeepseekV3ForCausalLM"),
    "empty": ("ValueError", "is not a Hugging Face model folder: it has no config.json"),
    "no_weights": ("ValueError", "has no safetensors weights"),
    "size": ("ValueError", "max_shard_size 'lots' is not a size"),
    "variant": ("ValueError", "save_pretrained(variant=...) is not supported"),
}


@pytest.mark.timeout(200)
def test_bad_folders_raise_one_clear_error_on_every_rank(tmp_path):
    good = tmp_path / "good"
    tiny_model("deepseek", seed=0).save_pretrained(good)
    for name in ("missing", "shape", "llama", "no_weights"):
        shutil.copytree(good, tmp_path / name)
    (tmp_path / "empty").mkdir()
    tensors = load_file(good / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_a_proj.weight"]
    save_file(tensors, tmp_path / "missing" / "model.safetensors")
    tensors = load_file(good / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7, dtype=torch.float64)
    save_file(tensors, tmp_path / "shape" / "model.safetensors")
    cfg = json.loads((good / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    os.remove(tmp_path / "no_weights" / "model.safetensors")
    res = run_distributed(_errors, 2, str(tmp_path), timeout=150)
    assert res[0] == res[1]  # the same error on every rank
    for name, (kind, text) in EXPECTED.items():
        assert res[0][name] is not None, name
        assert res[0][name][0] == kind and text in res[0][name][1], (name, res[0][name])
