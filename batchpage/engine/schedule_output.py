"""The scheduler's decision for one step (Scheduler.schedule): which rows of the input batch run
and how many tokens each computes, and the block moves the runner applies first."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import BlockCopy
from batchpage.engine.sequence import Sequence
from batchpage.lora.request import LoRARequest


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """After this step all of the sequence's tokens are computed (and any drafts it runs
        after its newest): it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens


@dataclass(frozen=True)
class Swap:
    seq_id: int
    blocks: list[int]  # the sequence's blocks, in block-table order


@dataclass
class SchedulerOutput:
    """The step's decision. The runner applies swap_out, then swap_in, then copies, then runs
    the forward: a block freed by a swap-out may be reused in this very step.

    What runs is `rows` (each scheduled sequence's input batch row) and `num_new` (the tokens
    each computes), beam searches first, then the other running sequences in admission order,
    then those admitted this step. `scheduled` reads the same as sequences, for code that
    wants them (tests, the simulator); a step's hot path never does."""

    batch: InputBatch
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_new: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[Swap] = field(default_factory=list)
    swap_in: list[Swap] = field(default_factory=list)
    # Adapters to copy into their slots before the forward (slot, adapter).
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @functools.cached_property
    def scheduled(self) -> list[ScheduledSeq]:
        """(sequence, tokens) of each row; read it before the rows' sequences finish."""
        seqs = self.batch.seqs(self.rows)
        return [ScheduledSeq(s, n) for s, n in zip(seqs, self.num_new.tolist(), strict=True)]

    @property
    def num_tokens(self) -> int:
        return int(self.num_new.sum())


class Picks:
    """The rows a schedule() call picks, gathered in pieces: single rows (beams, admissions)
    and whole arrays (the running decodes)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.num_new: list[np.ndarray] = []
        self._one_rows: list[int] = []
        self._one_new: list[int] = []

    @property
    def empty(self) -> bool:
        return not (self.rows or self._one_rows)

    def one(self, row: int, n: int) -> None:
        self._one_rows.append(row)
        self._one_new.append(n)

    def many(self, rows: np.ndarray, num_new: np.ndarray) -> None:
        self._flush()
        self.rows.append(rows)
        self.num_new.append(num_new)

    def done(self, out: SchedulerOutput) -> None:
        self._flush()
        if self.rows:
            out.rows = np.concatenate(self.rows)
            out.num_new = np.concatenate(self.num_new)

    def _flush(self) -> None:
        if self._one_rows:
            self.rows.append(np.array(self._one_rows, dtype=np.int64))
            self.num_new.append(np.array(self._one_new, dtype=np.int64))
            self._one_rows, self._one_new = [], []
