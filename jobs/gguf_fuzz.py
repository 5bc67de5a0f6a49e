"""Hostile GGUF files for the reliability benchmark (jobs/bench/reliability.py): the tests' own
builder, edits and load (tests/model/hostile_gguf.py, the one copy), and the seeded random edits
the benchmark draws for the counts in BENCHMARKS.md.
"""

from __future__ import annotations

import random

from tests.model.hostile_gguf import INTERESTING, MUTATIONS, load_outcome, mutate, tiny_gguf

__all__ = ["load_outcome", "mutate", "random_mutations", "tiny_gguf"]


def random_mutations(rng: random.Random, header_bytes: int) -> list[tuple[str, int, int]]:
    """1-3 edits, at positions inside the header (edits to tensor data only change weights)."""
    edits = []
    for _ in range(rng.randint(1, 3)):
        value = rng.choice(INTERESTING) if rng.random() < 0.6 else rng.getrandbits(64)
        edits.append((rng.choice(MUTATIONS), rng.randrange(header_bytes), value))
    return edits
