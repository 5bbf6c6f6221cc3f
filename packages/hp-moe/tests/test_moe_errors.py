"""The inputs hp-moe rejects, each with the same clear error on every rank and no hang:

- ``parallelize_experts``: a module of another form (``TypeError`` naming the form), E not
  divisible by ep, an n-D mesh, bad ``impl`` / ``chunks`` / ``overlap``, applied twice;
- the forward: a ``top_k_index`` outside ``[0, E)`` on one rank only, hidden of another dtype
  than the weights on one rank only, a wrong hidden size on one rank only, routing tensors of
  mismatched shapes; ranks whose rows would travel in different dtypes (autocast on one only).

After each error the ep group still works (a later forward on good inputs is exact)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _moe_testutil import TIMEOUT, E, H, ep_mesh, routing, stock_experts
from torch import nn

from hyper_parallel.dtensor import init_device_mesh
from hyper_parallel.dtensor.testing import run_distributed
from hyper_parallel.moe import parallelize_experts, unparallelize_experts


def _error(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class _NotExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))  # no down_proj

    def act_fn(self, x):
        return x


def rank_errors() -> dict[str, str]:
    rank = dist.get_rank()
    mesh = ep_mesh()
    errors: dict[str, str] = {}
    errors["form"] = _error(lambda: parallelize_experts(_NotExperts(), mesh))
    errors["indivisible"] = _error(
        lambda: parallelize_experts(stock_experts(experts=6), ep_mesh(4))
    )
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    errors["2d_mesh"] = _error(lambda: parallelize_experts(stock_experts(), mesh2d))
    errors["impl"] = _error(lambda: parallelize_experts(stock_experts(), mesh, impl="cuda"))
    errors["chunks"] = _error(lambda: parallelize_experts(stock_experts(), mesh, chunks=0))
    errors["overlap"] = _error(lambda: parallelize_experts(stock_experts(), mesh, overlap="yes"))
    m = parallelize_experts(stock_experts(), mesh)
    errors["twice"] = _error(lambda: parallelize_experts(m, mesh))

    def forward(h, i, w):
        return lambda: m(h, i, w)

    h, i, w = routing(rank, 6)
    bad = i.clone()
    bad[2, 1] = E if rank == 1 else bad[2, 1]
    errors["index_range"] = _error(forward(h, bad, w))
    neg = i.clone()
    neg[0, 0] = -1 if rank == 3 else neg[0, 0]
    errors["index_negative"] = _error(forward(h, neg, w))
    errors["dtype"] = _error(forward(h.float() if rank == 2 else h, i, w))
    errors["hidden_size"] = _error(forward(h[:, : H - 1] if rank == 0 else h, i, w))
    errors["index_shape"] = _error(forward(h, i[:, :1] if rank == 1 else i, w))
    errors["index_float"] = _error(forward(h, i.double() if rank == 1 else i, w))

    def mixed_autocast():
        f = parallelize_experts(stock_experts(dtype=torch.float32), mesh)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            f(h.float(), i, w.float())

    errors["autocast_one_rank"] = _error(mixed_autocast)
    errors["not_parallel"] = _error(lambda: unparallelize_experts(stock_experts()))
    # the group still works: a good forward afterwards is exact
    ref = stock_experts()
    out = m(h, i, w)
    errors["after"] = "exact" if torch.allclose(out, _serial_rows(ref, rank)) else "wrong"
    return errors


def _serial_rows(ref, rank):
    inputs = [routing(s, 6) for s in range(dist.get_world_size())]
    out = ref(*(torch.cat(t) for t in zip(*inputs)))
    return out.split(6)[rank]


_CACHE: dict[str, list] = {}


def _errors() -> list[dict[str, str]]:
    if "e" not in _CACHE:
        _CACHE["e"] = run_distributed(rank_errors, 4, timeout=TIMEOUT)
    return _CACHE["e"]


EXPECTED = {
    "form": ("TypeError", "Hugging Face 5.x experts form"),
    "indivisible": ("ValueError", "divisible by ep"),
    "2d_mesh": ("ValueError", "1-D mesh"),
    "impl": ("ValueError", "impl must be"),
    "chunks": ("ValueError", "chunks must be"),
    "overlap": ("ValueError", "overlap must be"),
    "twice": ("RuntimeError", "already parallelized"),
    "index_range": ("ValueError", "ranks [1]: top_k_index holds an expert id outside [0, E)"),
    "index_negative": ("ValueError", "ranks [3]: top_k_index holds an expert id outside"),
    "dtype": ("ValueError", "ranks [2]: hidden's dtype differs"),
    "hidden_size": ("ValueError", "ranks [0]: hidden is not [N, H]"),
    "index_shape": ("ValueError", "ranks [1]: top_k_weights is not"),
    "index_float": ("ValueError", "ranks [1]: top_k_index is not an integer tensor"),
    "autocast_one_rank": ("ValueError", "travel in different dtypes"),
    "not_parallel": ("RuntimeError", "not parallelized"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_raises_the_same_clear_error_on_every_rank(case):
    kind, words = EXPECTED[case]
    messages = {errors[case] for errors in _errors()}
    if case in ("index_range", "index_negative", "dtype", "hidden_size", "index_shape",
                "index_float", "autocast_one_rank"):  # fmt: skip
        assert len(messages) == 1, messages  # one rank's problem, every rank's identical error
    for msg in messages:
        assert msg.startswith(kind), msg
        assert words in msg, msg


def test_the_group_still_computes_exactly_after_every_error():
    assert all(errors["after"] == "exact" for errors in _errors())
