"""The main job's synthetic data: a learnable token stream, one batch per step, seeded by
``--seed`` and the step alone (a resumed or a longer run sees the same stream), and the same
stream packed as documents of random lengths (Hugging Face's ``DataCollatorWithFlattening``
convention). Replace with your data loader."""

from __future__ import annotations

import argparse

import torch

IGNORE_INDEX = -100


def _generator(args: argparse.Namespace, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(args.seed * 1_000_003 + step + salt)


def tokens(args: argparse.Namespace, step: int) -> torch.Tensor:
    """Step ``step``'s ``[batch, seq]`` token ids: a fixed random Markov chain (learnable)."""
    g = torch.Generator().manual_seed(args.seed + 1234)
    trans = torch.softmax(torch.randn(args.vocab, args.vocab, generator=g) * 3.0, dim=-1)
    g = _generator(args, step)
    toks = torch.empty(args.batch, args.seq, dtype=torch.long)
    toks[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
    for i in range(1, args.seq):
        toks[:, i] = torch.multinomial(trans[toks[:, i - 1]], 1, generator=g).squeeze(1)
    return toks


def documents(args: argparse.Namespace, step: int) -> list[list[int]]:
    """Per row, the offsets ``[0, …, seq]`` of documents of random lengths in
    ``[1, seq // 2]`` (the last one cut at the row's end)."""
    g = _generator(args, step, salt=7_919)
    rows = []
    for _ in range(args.batch):
        offsets = [0]
        while offsets[-1] < args.seq:
            length = int(torch.randint(1, max(2, args.seq // 2 + 1), (1,), generator=g))
            offsets.append(min(args.seq, offsets[-1] + length))
        rows.append(offsets)
    return rows


def batch(args: argparse.Namespace, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s whole batch for ``shard_batch``: ``input_ids`` and ``labels``; with
    ``--packed``, each row cut into :func:`documents`: ``position_ids`` restarting at 0 at
    every document and ``labels`` ``-100`` at each document's first token."""
    ids = tokens(args, step)
    if not args.packed:
        return {"input_ids": ids, "labels": ids}
    labels, pos = ids.clone(), torch.empty_like(ids)
    for row, offsets in enumerate(documents(args, step)):
        for a, b in zip(offsets, offsets[1:]):
            pos[row, a:b] = torch.arange(b - a)
            labels[row, a] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos}
