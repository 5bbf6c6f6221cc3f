"""Each pair of layers that shares the tp x cp mesh in one step (MC2 over tp with MLA or KDA
over cp; MLA and KDA both over cp) equals the serial model, and the tp and cp groups are the
ones the layout promises (they cross in exactly this rank and never collide)."""

from __future__ import annotations

import _hybrid_model as hm
import _integration_util as iu
import pytest

PAIRS = {
    "mc2_tp+mla_cp": ("mlp", "mla"),
    "mc2_tp+kda_cp": ("kda", "mlp"),
    "mla_cp+kda_cp": ("mla", "kda"),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layers", list(PAIRS.values()), ids=list(PAIRS))
def test_integration_pair_shares_mesh_and_matches_serial(layers):
    config = hm.HybridConfig(layers=layers)
    x, dy = iu.inputs(config, batch=2, seq=32, seed=7)
    results = iu.run_parallel(config, x, dy, tp=2, cp=2)
    iu.check_against_serial(config, results, x, dy)
    # rank = t * cp + c (row-major over ("tp", "cp"))
    for rank, r in enumerate(results):
        t, c = divmod(rank, 2)
        assert r["groups"]["tp"] == (c, 2 + c)
        assert r["groups"]["cp"] == (2 * t, 2 * t + 1)
        assert set(r["groups"]["tp"]) & set(r["groups"]["cp"]) == {rank}
        assert r["block"] == (c * 2 + t, 4)
