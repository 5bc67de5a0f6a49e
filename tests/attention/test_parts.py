"""The torch attention parts (batchpage/attention/parts.py): how a step's rows are grouped."""

from __future__ import annotations

import torch

from batchpage.attention.parts import length_groups


def test_length_groups_cover_every_sequence_once() -> None:
    lens = tuple(int(x) for x in torch.randint(1, 3000, (100,)))
    seqs = list(range(0, 100, 2))
    groups = length_groups(seqs, lens)
    assert sorted(b for g in groups for b in g) == seqs
    assert len(groups) > 1
    for g in groups:
        assert [lens[b] for b in g] == sorted((lens[b] for b in g), reverse=True)
        padded, held = len(g) * lens[g[0]], sum(lens[b] for b in g)
        assert len(g) <= 8 or padded <= 1.25 * held
