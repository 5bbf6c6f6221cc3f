"""The whole hybrid stack (KDA, MLP, MLA, MLP) on a tp x cp mesh equals the serial model:
forward, the input gradient and every parameter gradient, on every rank."""

from __future__ import annotations

import _hybrid_model as hm
import _integration_util as iu
import pytest
import torch

from hyper_parallel.dtensor.testing import run_distributed

CONFIG = hm.HybridConfig(layers=("kda", "mlp", "mla", "mlp"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mla_strategy, kda_protocol, mla_overlap",
    [("expanded", "p2p", True), ("latent", "allgather", True), ("latent", "auto", False)],
)
def test_integration_hybrid_tp2_cp2_matches_serial(mla_strategy, kda_protocol, mla_overlap):
    x, dy = iu.inputs(CONFIG, batch=2, seq=32)
    results = iu.run_parallel(
        CONFIG, x, dy, mla_strategy=mla_strategy, mla_overlap=mla_overlap, kda_protocol=kda_protocol
    )
    iu.check_against_serial(CONFIG, results, x, dy)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp, cp", [(1, 4), (4, 1)])
def test_integration_hybrid_degenerate_meshes_match_serial(tp, cp):
    """Pure cp (no MC2) and pure tp (mixers replicated, sequence-parallel MLPs)."""
    x, dy = iu.inputs(CONFIG, batch=1, seq=32)
    results = iu.run_parallel(CONFIG, x, dy, tp=tp, cp=cp)
    iu.check_against_serial(CONFIG, results, x, dy)


def _train_rank(config, tokens, steps, lr):
    device = iu.rank_device()
    mesh = iu.build_mesh(2, 2)
    torch.manual_seed(0)
    model = hm.HybridLM(config).to(device=device, dtype=iu.dtype())
    hm.parallelize_hybrid(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    inp = hm.shard_tokens(tokens[:, :-1], mesh).to(device)
    tgt = hm.shard_tokens(tokens[:, 1:], mesh).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(inp)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tgt.flatten(), reduction="sum"
        ) / tgt.new_tensor(tokens[:, 1:].numel(), dtype=logits.dtype)
        loss.backward()
        hm.sync_gradients(model, mesh)
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    return losses, hm.full_gradients(model)


@pytest.mark.timeout(180)
def test_integration_training_steps_follow_serial_losses():
    """SGD on DTensor shards and replicated parameters keeps the parallel model identical to
    the serial one: the losses of three steps agree."""
    config = hm.HybridConfig(layers=("kda", "mlp", "mla", "mlp"), vocab=32)
    tokens = torch.randint(0, config.vocab, (2, 33), generator=torch.Generator().manual_seed(3))
    results = run_distributed(
        _train_rank, 4, config, tokens, 3, 0.5, backend=iu.backend(), timeout=iu.TIMEOUT
    )
    torch.manual_seed(0)
    ref = hm.HybridLM(config).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    expected = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert expected[-1] < expected[0]  # the steps do train
    for losses, _ in results:
        torch.testing.assert_close(
            torch.tensor(losses, dtype=torch.float64),
            torch.tensor(expected, dtype=torch.float64),
            **iu.tolerances(has_kda=True),
        )
