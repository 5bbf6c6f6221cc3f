"""The bytes the layers' own collectives move over one rank's link per training step, by the
names hp-dtensor's recorder gives them (each counted by ``comm.link_bytes``, the recorder's
rule). FSDP2's collectives come from the placement (:mod:`.placement`).

Per layer, on ``P = cp·tp`` ranks holding ``n = B·T/P`` tokens each, ``b`` bytes an element:

==========================  ===========================================  ==================
collective (recorder name)  buffer                                       calls a step
==========================  ===========================================  ==================
MLA ``all_gather:latent``   ``B·T·(kv_lora + rope)·b`` over ``P``        1 (backward: the
                                                                         reduce-scatter
                                                                         ``dlatent``)
MLA ``a2a:q`` / ``a2a:dq``  ``n·H·(d_nope + rope)·b`` over ``P``          1 / 1
MLA ``a2a:o`` / ``a2a:do``  ``n·H·d_v·b`` over ``P``                      1 / 1
KDA state (``auto``: the    allgather: ``P·4·B·H·K·(K+V)``; p2p: one      1 / 1
layer's cost model picks)   ``4·B·H·K·V`` state sent and received
KDA ``send/recv:halo``      ``(W−1)·B·3·H·K·b`` (a middle rank)           1 / 1 each way
Gated DeltaNet              as KDA with ``H = Hv`` value heads, a state
                            ``K×V``, the halo ``(W−1)·B·(2HkK + HvV)·b``
GQA ``a2a:q`` / ``a2a:o``   ``n·H·d·b`` over ``P`` (``:dq``, ``:do``)     1 / 1
GQA ``a2a:kv``              ``n·P·max(1, Hkv/P)·2d·b`` over ``P`` (key/   1 / 1
                            value heads repeated where ``Hkv < P``)
MC2 ``all_gather:x``        ``n·tp·D·b`` over ``tp``                      3 (2 in backward)
MC2 ``reduce_scatter:       the same                                     2
partial``
MoE ``moe:dispatch`` /      ``n·k·D·b``, the share to the other ``ep−1``  1 / 1 each, with
``moe:combine``             ranks (balanced routing)                      ``:grad``
MoE ``moe:counts``          ``ep·(E+2)`` int64 over ``ep``                1
loss ``all_reduce:loss``,   a float32 scalar; ``1 + 6·dp`` int64 over      1 each
``all_reduce:loss_tokens``  every rank
==========================  ===========================================  ==================

Activation checkpointing runs each layer's forward again in backward: its forward
collectives twice.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hyper_parallel.models.plan.activations import LayerShape

__all__ = ["collective_name", "layer_collectives"]

_SLOTS_PER_GROUP = 6  # the fingerprint slots the loss-token all-reduce carries per dp group


def collective_name(name: str) -> str:
    """A recorder name without its chunk numbers (``moe:dispatch0`` -> ``moe:dispatch``)."""
    return re.sub(r"(?<=[a-z])\d+(?=$|:)", "", name)


def _link(op: str, nbytes: int, size: int) -> int:
    from hyper_parallel.dtensor.comm import link_bytes

    return link_bytes(op, nbytes, size)


def _kda_protocol(
    p: int, rows: int, h: int, k: int, device_type: str, v: int | None = None
) -> tuple[str, int | None]:
    from hyper_parallel.kda.cost import choose_protocol

    choice = choose_protocol(p, rows, h, k, k if v is None else v, device_type=device_type)
    return choice.protocol, choice.group_size


def layer_collectives(
    shapes: list[tuple[LayerShape, int]],
    *,
    dims: tuple[int, int, int],
    rows: int,
    seq: int,
    ep: int,
    b: int,
    device_type: str,
    kda_protocol: str = "auto",
    checkpointing: bool = False,
    loss: bool = True,
) -> dict[str, int]:
    """``{recorder name: bytes}`` one rank moves per step through the layers' collectives
    (the module docstring's table), for the layer kinds ``shapes`` with their counts on a
    ``(dp, cp, tp)`` mesh; ``rows = batch/dp``; ``loss``: with the loss's two all-reduces (a
    pipeline stage's layers go without: the planner counts its loss)."""
    dp, cp, tp = dims
    p = cp * tp
    n = rows * seq // p
    out: dict[str, int] = {}
    fwd = 2 if checkpointing else 1

    def add(name: str, nbytes: int, times: int = 1) -> None:
        if nbytes and times:
            out[name] = out.get(name, 0) + nbytes * times

    for shape, count in shapes:
        g = shape.get
        d = g("D")
        if shape.attn == "mla" and p > 1:
            latent = _link("all_gather", rows * seq * (g("kv_lora") + g("rope")) * b, p)
            q = _link("all_to_all", n * g("H") * (g("nope") + g("rope")) * b, p)
            o = _link("all_to_all", n * g("H") * g("dv") * b, p)
            add("all_gather:latent", latent, fwd * count)
            add("reduce_scatter:dlatent", latent, count)
            add("a2a:q", q, fwd * count)
            add("a2a:dq", q, count)
            add("a2a:o", o, fwd * count)
            add("a2a:do", o, count)
        elif shape.attn == "gqa" and p > 1:
            hd = g("d")
            kvl = max(1, g("Hkv") // p)  # the key/value heads a rank receives (repeated)
            q = _link("all_to_all", n * g("H") * hd * b, p)
            kv = _link("all_to_all", n * p * kvl * 2 * hd * b, p)
            for name, nbytes in (("q", q), ("kv", kv), ("o", q)):
                add(f"a2a:{name}", nbytes, fwd * count)
                add(f"a2a:d{name}", nbytes, count)
        elif shape.attn in ("kda", "gdn") and p > 1:
            if shape.attn == "kda":
                h, k, v, conv_dim = g("H"), g("K"), g("K"), 3 * g("H") * g("K")
            else:  # Gated DeltaNet: the state is per value head; q, k, v through the conv
                h, k, v = g("Hv"), g("K"), g("V")
                conv_dim = 2 * g("Hk") * k + h * v
            protocol, width = (
                _kda_protocol(p, rows, h, k, device_type, v)
                if kda_protocol == "auto"
                else (kda_protocol, None)
            )
            state = 4 * rows * h * k * v
            summary = 4 * rows * h * k * (k + v)
            if protocol == "allgather":
                add("all_gather:state", _link("all_gather", p * summary, p), fwd * count)
                add("all_gather:dstate", _link("all_gather", p * summary, p), count)
            else:  # p2p, or grouped: a gather in the group, the leaders' chain, a broadcast
                w = width or 1
                if w > 1:
                    add("all_gather:state", _link("all_gather", w * summary, w), fwd * count)
                    add("all_gather:dstate", _link("all_gather", w * summary, w), count)
                    hops = math.ceil(math.log2(w))
                    add("broadcast:state", hops * state, fwd * count)
                    add("broadcast:dstate", hops * state, count)
                for way in ("send", "recv"):
                    add(f"{way}:state", state, fwd * count)
                    add(f"{way}:dstate", state, count)
            halo = (g("conv") - 1) * rows * conv_dim * b
            for way in ("send", "recv"):
                add(f"{way}:halo", halo, fwd * count)
                add(f"{way}:dhalo", halo, count)
        if shape.mlp == "dense" and tp > 1:
            x = _link("all_gather", n * tp * d * b, tp)
            add("all_gather:x", x, (2 + fwd) * count)
            add("reduce_scatter:partial", x, (1 + fwd) * count)
        elif shape.mlp == "moe" and ep > 1:
            rows_out = n * g("k") * d * b * (ep - 1) // ep
            add("moe:counts", _link("all_gather", ep * (g("E") + 2) * 8, ep), fwd * count)
            for name in ("moe:dispatch", "moe:combine"):
                add(name, rows_out, fwd * count)
                add(f"{name}:grad", rows_out, count)
    if loss:
        world = dp * p
        add("all_reduce:loss", _link("all_reduce", 4, world))
        add("all_reduce:loss_tokens", _link("all_reduce", (1 + dp * _SLOTS_PER_GROUP) * 8, world))
    return out


def merged(*parts: dict[str, int]) -> dict[str, Any]:
    """The per-collective dicts added up."""
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out
