"""The one-communication-runtime rule of tools/check_repo.py: a layer module calling a
collective directly is reported; the modules not yet moved are listed, and only shrink."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import check_repo

NEW = "packages/hp-mc2/src/hyper_parallel/mc2/new.py"
LISTED = "packages/hp-mc2/src/hyper_parallel/mc2/old.py"


def test_a_direct_collective_in_a_layer_is_reported():
    for call in (
        "dist.all_reduce(x, group=g)",
        "    work = dist.isend(out, dst=1)",
        "torch.distributed.all_to_all_single(o, i)",
        "all_gather_single(out, inp, group, True)",
    ):
        problems = check_repo.check_communication({NEW: f"import torch\n{call}\n"})
        assert len(problems) == 1 and problems[0].startswith(f"{NEW}:2: calls a collective")


def test_comm_calls_imports_and_comments_are_fine():
    text = (
        "from hyper_parallel.dtensor import all_gather_single\n"
        "# dist.all_reduce(x) is what we do not call\n"
        "w = comm.start_all_reduce(x, g, 'all_reduce:x', 'forward', 'mc2')\n"
        "n = dist.get_world_size(g)\n"
    )
    assert check_repo.check_communication({NEW: text}) == []


def test_the_list_of_modules_not_yet_moved_only_shrinks(monkeypatch):
    monkeypatch.setitem(check_repo.NOT_YET_ON_COMM, LISTED, "its all-reduce")
    assert check_repo.check_communication({LISTED: "dist.broadcast(t, src=0)\n"}) == []
    (problem,) = check_repo.check_communication({LISTED: "x = 1\n"})
    assert "no direct collective is left; remove it from NOT_YET_ON_COMM" in problem


def test_the_repository_follows_the_rule():
    assert check_repo.check_communication(check_repo.layer_sources()) == []
    assert check_repo.NOT_YET_ON_COMM == {}  # every layer is on hp-dtensor's comm


def test_hp_models_own_collectives_are_checked_too():
    checked = check_repo.layer_sources()
    assert "packages/hp-models/src/hyper_parallel/models/grads.py" in checked
    assert "packages/hp-models/src/hyper_parallel/models/loss.py" in checked
