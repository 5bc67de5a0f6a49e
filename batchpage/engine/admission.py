"""Admission control: how many blocks the running sequences will still need.

Admitting a sequence only because its prompt fits today fills the pool with sequences that then
all grow; when the pool runs dry the newest are preempted and recomputed, and the work they did
is thrown away. An offline job knows each request's output budget (max_tokens, or what is left
of max_model_len), so the scheduler admits against an estimate of the growth still to come:

    expected(seq) = max(ratio, certain_floor) * certain + ratio * uncertain

- `certain`: the tokens the sequence will surely still generate: all of its remaining budget
  with ignore_eos, else what min_tokens still demands. Reserving all of it keeps preemptions at
  zero but holds the batch at what fits at its peak, and a bigger batch costs little more per
  step (a GPU step is bound by reading the weights; a CPU step's small-M matmuls run faster per
  row as M grows): measured on a CPU and a GPU, reserving certain growth in full ran slower
  than admission on the prompt alone, which preempted far more (BENCHMARKS.md, admission). So
  certain growth is overcommitted too, by at most 1 / certain_floor, under the same feedback.
- `uncertain`: the rest of its budget, which an EOS or a stop string may cut short.
- `ratio` (SGLang's "new token ratio"): the share of that uncertain budget expected to be used.
  It starts at `initial` and decays by `decay` each step that preempts nothing, so the pool fills
  up as the job shows that sequences stop early; a preemption proves the estimate too low and
  resets it to 1.0 (the worst case: certain growth reserved in full), from where it decays
  again.

Sequences do not all reach their ends at once: each frees its blocks when it finishes, and the
shortest go first. So the check is on the peak of the blocks they will hold together, if every
running sequence appends one token per step: at step t the sequences still alive are those with
at least t tokens to come, each holding blocks_for(tokens + t). A sequence is admitted when that
peak, with it included, fits in the blocks they hold now plus the free ones. The estimate only
gates admission: a running sequence that outgrows it still gets blocks, by preempting the
newest, as before.
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass

from batchpage.engine.sequence import Sequence


@dataclass
class GrowthEstimate:
    initial: float = 0.7
    floor: float = 0.1
    decay: float = 0.002  # per step without preemption: (1.0 - floor) / decay steps to the floor
    certain_floor: float = 0.5  # certain growth is never counted below this share of itself
    ratio: float = 0.7

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.initial <= 1.0:
            raise ValueError(
                f"need 0 <= floor <= initial <= 1; got floor={self.floor}, initial={self.initial}"
            )
        if not 0.0 < self.certain_floor <= 1.0:
            raise ValueError(f"need 0 < certain_floor <= 1; got {self.certain_floor}")
        self.ratio = self.initial

    def stepped(self, preempted: bool) -> None:
        self.ratio = 1.0 if preempted else max(self.floor, self.ratio - self.decay)

    def expected_tokens(self, seq: Sequence, max_model_len: int) -> int:
        """Tokens seq is expected to still append (each needs a slot), its samples not counted."""
        room = max_model_len - seq.num_tokens
        budget = seq.params.max_tokens
        remaining = room if budget is None else min(room, budget - seq.num_output_tokens)
        remaining = max(0, remaining)
        if seq.params.ignore_eos:
            certain = remaining
        else:
            certain = min(remaining, max(0, seq.params.min_tokens - seq.num_output_tokens))
        share = max(self.ratio, self.certain_floor)
        return math.ceil(share * certain) + round(self.ratio * (remaining - certain))


class Demand:
    """The future of a set of sequences, each (tokens now, tokens still to come), kept sorted by
    tokens to come so that the peak is one pass. `peak_blocks` bounds the blocks they hold
    together when every sequence appends one token per step and frees its blocks when done (a
    partly filled last block may be counted whole: it never underestimates)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._future: list[tuple[int, int]] = []  # (tokens to come, tokens now), descending
        self.held = 0  # blocks the sequences hold now (their block tables' lengths)

    def add(self, tokens_now: int, to_come: int, copies: int = 1, held: int = 0) -> None:
        for _ in range(copies):
            insort(self._future, (to_come, tokens_now), key=lambda f: -f[0])
        self.held += held

    def add_all(self, futures: list[tuple[int, int]], held: int) -> None:
        """Many (tokens now, tokens to come) at once, sorted once: a step's running set."""
        self._future += [(to_come, now) for now, to_come in futures]
        self._future.sort(key=lambda f: -f[0])  # stable: ties keep their order, as insort's
        self.held += held

    def peak_blocks(self, extra: tuple[int, int] | None = None) -> int:
        """The peak with `extra` (tokens now, tokens to come) added, without keeping it."""
        future = self._future
        if extra is not None:
            future = list(future)
            insort(future, (extra[1], extra[0]), key=lambda f: -f[0])
        peak = tokens = 0
        for alive, (to_come, now) in enumerate(future, start=1):
            # At step to_come the `alive` sequences with at least that many tokens to come are
            # still running, each holding its tokens now plus to_come:
            # sum of ceil(x_i / bs) <= ceil((sum of x_i + alive * (bs - 1)) / bs).
            tokens += now
            slack = alive * (self.block_size - 1)
            peak = max(peak, -(-(tokens + alive * to_come + slack) // self.block_size))
        return peak
