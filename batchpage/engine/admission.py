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

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from batchpage.engine.sequence import Sequence

_UNBOUNDED = np.iinfo(np.int64).max // 2


class OutputLimits(NamedTuple):
    """What the growth estimate reads of each sequence, as arrays (the input batch keeps them
    as columns of its running rows)."""

    num_prompt: np.ndarray  # int64
    max_tokens: np.ndarray  # int64; a huge number where there is none
    min_tokens: np.ndarray  # int64
    ignore_eos: np.ndarray  # bool

    @classmethod
    def of(cls, seqs: list[Sequence]) -> OutputLimits:
        params = [s.request.params for s in seqs]
        return cls(
            np.array([s.num_prompt_tokens for s in seqs], dtype=np.int64),
            np.array([p.max_tokens or _UNBOUNDED for p in params], dtype=np.int64),
            np.array([p.min_tokens for p in params], dtype=np.int64),
            np.array([p.ignore_eos for p in params], dtype=bool),
        )

    def take(self, rows: np.ndarray) -> OutputLimits:
        return OutputLimits(*(column[rows] for column in self))


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

    def expected_tokens(
        self, num_tokens: np.ndarray, limits: OutputLimits, max_model_len: int
    ) -> np.ndarray:
        """Tokens each sequence (its length now, its limits) is expected to still append (each
        needs a slot), its samples not counted: int64, computed for all of them at once."""
        output = num_tokens - limits.num_prompt
        remaining = np.minimum(max_model_len - num_tokens, limits.max_tokens - output).clip(min=0)
        min_left = (limits.min_tokens - output).clip(min=0)
        certain = np.where(limits.ignore_eos, remaining, np.minimum(remaining, min_left))
        share = max(self.ratio, self.certain_floor)
        expected = np.ceil(share * certain) + np.round(self.ratio * (remaining - certain))
        return expected.astype(np.int64)


class Demand:
    """The future of a set of sequences, each (tokens now, tokens still to come), kept sorted by
    tokens to come so that the peak is one pass. `peak_blocks` bounds the blocks they hold
    together when every sequence appends one token per step and frees its blocks when done (a
    partly filled last block may be counted whole: it never underestimates).

    Sequences added one at a time wait in a list and are sorted in when a peak is asked for:
    `fits` first tries a bound that needs no order (every sequence at its largest at once), which
    settles admission whenever the pool is roomy, so most admissions sort nothing."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (tokens to come, tokens now) of each sequence, by tokens to come descending.
        self._to_come = np.zeros(0, dtype=np.int64)
        self._now = np.zeros(0, dtype=np.int64)
        self._added: list[tuple[int, int]] = []  # (now, to_come) added since the last sort
        # Sum over the sequences of tokens now + to come + block_size - 1 (`fits`' bound).
        self._largest = 0
        self.held = 0  # blocks the sequences hold now (their block tables' lengths)

    def add(self, tokens_now: int, to_come: int, copies: int = 1, held: int = 0) -> None:
        self._added += [(tokens_now, to_come)] * copies
        self._largest += copies * (tokens_now + to_come + self.block_size - 1)
        self.held += held

    def add_all(self, now: np.ndarray, to_come: np.ndarray, held: int) -> None:
        """Many sequences at once (tokens now, tokens to come; arrays of one length), sorted
        once: a step's running set. Ties keep their order, as one `add` after another."""
        self._sort_in(now, to_come)
        self._largest += int(now.sum() + to_come.sum()) + len(now) * (self.block_size - 1)
        self.held += held

    def fits(self, extra: tuple[int, int], capacity: int) -> bool:
        """Whether the peak with `extra` (tokens now, tokens to come) added is at most
        `capacity` blocks (`peak_blocks(extra) <= capacity`, the same answer). The peak's
        alive sequences hold at most their largest (tokens to come being sorted descending,
        every one alive at a step has at least as many still to come as the last): when all
        of them at their largest fit, so does the peak, with no sort."""
        largest = self._largest + extra[0] + extra[1] + self.block_size - 1
        if -(-largest // self.block_size) <= capacity:
            return True
        return self.peak_blocks(extra) <= capacity

    def peak_blocks(self, extra: tuple[int, int] | None = None) -> int:
        """The peak with `extra` (tokens now, tokens to come) added, without keeping it."""
        if self._added:
            added = np.array(self._added, dtype=np.int64).reshape(-1, 2)
            self._added = []
            self._sort_in(added[:, 0], added[:, 1])
        to_come, now = self._to_come, self._now
        if extra is not None:
            to_come, now = self._inserted(extra[0], extra[1])
        if not len(to_come):
            return 0
        # At step to_come[i] the alive = i + 1 sequences with at least that many tokens to come
        # are still running, each holding its tokens now plus to_come[i]:
        # sum of ceil(x_j / bs) <= ceil((sum of x_j + alive * (bs - 1)) / bs).
        alive = np.arange(1, len(to_come) + 1)
        total = np.cumsum(now) + alive * (to_come + self.block_size - 1)
        return int((-(-total // self.block_size)).max())

    def _sort_in(self, now: np.ndarray, to_come: np.ndarray) -> None:
        """Merge sequences into the sorted arrays, after the ties they meet, in their order."""
        to_come = np.concatenate([self._to_come, to_come])
        order = np.argsort(-to_come, kind="stable")
        self._to_come = to_come[order]
        self._now = np.concatenate([self._now, now])[order]

    def _inserted(self, now: int, to_come: int) -> tuple[np.ndarray, np.ndarray]:
        """The sorted arrays with (now, to_come) inserted after the ties it meets."""
        at = int(np.searchsorted(-self._to_come, -to_come, side="right"))
        # concatenate, not np.insert: the same arrays at a fraction of its per-call cost
        return (
            np.concatenate((self._to_come[:at], [to_come], self._to_come[at:])),
            np.concatenate((self._now[:at], [now], self._now[at:])),
        )
