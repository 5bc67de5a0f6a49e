"""Admission control: how many blocks the running sequences will still need.

Admitting a sequence only because its prompt fits today fills the pool with sequences that then
all grow; when the pool runs dry the newest are preempted and recomputed, and the work they did
is thrown away. An offline job knows each request's output budget (max_tokens, or what is left
of max_model_len), so the scheduler admits against an estimate of the growth still to come:

    expected(seq) = certain + ratio * uncertain

- `certain`: the tokens the sequence will surely still generate: all of its remaining budget
  with ignore_eos, else what min_tokens still demands.
- `uncertain`: the rest of its budget, which an EOS or a stop string may cut short.
- `ratio` (SGLang's "new token ratio"): the share of that uncertain budget expected to be used.
  It starts at `initial` and decays by `decay` each step that preempts nothing, so the pool fills
  up as the job shows that sequences stop early; a preemption proves the estimate too low and
  resets it to 1.0 (the worst case), from where it decays again.

A sequence is admitted when the free blocks cover its next chunk, its own expected growth and
the expected growth of every running sequence. The estimate only gates admission: a running
sequence that outgrows it still gets blocks, by preempting the newest, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpage.engine.kv_manager import blocks_for
from batchpage.engine.sequence import Sequence


@dataclass
class GrowthEstimate:
    initial: float = 0.7
    floor: float = 0.1
    decay: float = 0.002  # per step without preemption: from 1.0 to the floor in 450 steps
    ratio: float = 0.7

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.initial <= 1.0:
            raise ValueError(
                f"need 0 <= floor <= initial <= 1; got floor={self.floor}, initial={self.initial}"
            )
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
            return remaining
        certain = min(remaining, max(0, seq.params.min_tokens - seq.num_output_tokens))
        return certain + round(self.ratio * (remaining - certain))

    def expected_blocks(self, seq: Sequence, max_model_len: int, block_size: int) -> int:
        """Blocks seq will need beyond the slots its current tokens take (computed or not)."""
        now = blocks_for(seq.num_tokens, block_size)
        return (
            blocks_for(seq.num_tokens + self.expected_tokens(seq, max_model_len), block_size) - now
        )
