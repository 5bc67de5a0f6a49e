"""The persistent input batch: the running sequences' per-row state, in preallocated columns.

A sequence takes a row (a stable slot) when the scheduler admits it (`join`) and gives it back
when it finishes or is preempted (`leave`). While it runs, its row is the one home of what
changes every step: the computed count (`advance`, the scheduler's commit), the length, the
newest token and the tokens taken since its list was last read (`append_tokens`), one
vectorised write each for the whole step; Sequence reads them through the row. Block tables
mirror the KV cache manager's and are rewritten only for the sequences it reports changed
(KVCacheManager.take_changed). So a decode-only step is decided, built and committed from
these columns with no Python per row (scheduler.py, step_inputs.py).

The other columns are written once when a row joins: the flags that say which rows need Python
(stop strings, grammar, thinking, logprobs, beams, forks) and the sampling settings. They are
the seam later work plugs into (a row may compute several tokens in one step). A LoRA request's
row carries its adapter's slot, which stays put while the row runs (engine/adapter_slots.py).
"""

from __future__ import annotations

import numpy as np

from batchpage.engine.adapter_slots import AdapterSlots
from batchpage.engine.admission import OutputLimits
from batchpage.engine.constraint import Constraint
from batchpage.engine.reasoning import ThinkingTracker
from batchpage.engine.sampler import RowParams
from batchpage.engine.sequence import PendingForks, Sequence


class InputBatch:
    """Columns indexed by row: what the step builder reads (`computed`: num_computed_tokens,
    `num_tokens`: len(token_ids), `last_token`: token_ids[-1], the int32 [capacity, max_blocks]
    `block_tables`, zero past each row's `table_len`, `reads_rows`), what the stop checks read
    (`num_prompt`, `stop_len`, `each_token`) and what the sampler reads (`plain_greedy`,
    `forking`, `beam`, `sampling`, `constrained`), and the LoRA slot the forward reads
    (`lora_slot`, -1: the base model). Set when a row joins; after that only `computed`,
    `num_tokens`, `last_token`, the unread tokens, the tables and `forking` change. A free row
    is zero in every column the scheduler sums (`computed`, `table_len`)."""

    def __init__(
        self,
        capacity: int,
        max_blocks: int,
        adapters: AdapterSlots | None = None,
        max_drafts: int = 0,
    ) -> None:
        """`max_drafts`: speculative decoding's num_speculative_tokens (0: off)."""
        # Numpy, not torch: a step reads these with a few dozen small gathers and writes single
        # elements, where torch's per-call overhead is many times the work.
        self.capacity = capacity
        self.computed = np.zeros(capacity, dtype=np.int64)
        self.num_tokens = np.zeros(capacity, dtype=np.int64)
        self.last_token = np.zeros(capacity, dtype=np.int64)
        self.block_tables = np.zeros((capacity, max_blocks), dtype=np.int32)
        self.table_len = np.zeros(capacity, dtype=np.int64)  # entries written in each row
        # Whether the sequence needs the output of every prompt row it computes (prompt
        # logprobs, MEAN / CLS pooling): the step builder reads such rows one by one.
        self.reads_rows = np.zeros(capacity, dtype=bool)
        # What the stop checks read (rows_to_check): the prompt's length, the length at which
        # the row stops, and whether its tokens need Python every step (stop strings, grammar,
        # thinking, logprobs); the tokens that may end some row (EOS, stop ids).
        self.num_prompt = np.zeros(capacity, dtype=np.int64)
        self.stop_len = np.zeros(capacity, dtype=np.int64)
        self.each_token = np.zeros(capacity, dtype=bool)
        # What the sampler reads: the row takes its raw argmax (Sequence.plain_greedy), and it
        # has samples still to fork from it (n > 1) when its prompt is done.
        self.plain_greedy = np.zeros(capacity, dtype=bool)
        self.forking = np.zeros(capacity, dtype=bool)
        # A beam of a beam search: its logits go to the search (beam_steps.py), not the sampler.
        self.beam = np.zeros(capacity, dtype=bool)
        # Its prompt has images: the step builder gives the forward their encoder rows for the
        # image positions a step computes (Request.images).
        self.has_images = np.zeros(capacity, dtype=bool)
        # An M-RoPE model's offset of every position past the prompt (Request.mrope's delta;
        # 0 for a prompt without images): step_inputs.py gives p + rope_delta on each axis.
        self.rope_delta = np.zeros(capacity, dtype=np.int64)
        # The row's sampling settings (sampler.RowParams), and whether a grammar constrains it.
        empty = RowParams.of([])
        self.sampling = RowParams(*(np.zeros(capacity, dtype=c.dtype) for c in empty))
        self.constrained = np.zeros(capacity, dtype=bool)
        self.seed = np.zeros(capacity, dtype=np.int64)  # Sequence.seed: its draws' key
        # What admission's growth estimate reads (admission.OutputLimits).
        no_rows = OutputLimits.of([])
        self.limits = OutputLimits(*(np.zeros(capacity, dtype=c.dtype) for c in no_rows))
        self.adapters = adapters if adapters is not None else AdapterSlots(0)
        self.lora_slot = np.full(capacity, -1, dtype=np.int64)
        self.lora_rows = 0  # rows with an adapter: none, and a step reads no slot column
        # The tokens each row took since its sequence's list was last read (Sequence.token_ids):
        # tokens [synced, num_tokens) of the row are unread[row, : num_tokens - synced].
        self.synced = np.zeros(capacity, dtype=np.int64)
        self.unread = np.zeros((capacity, 16), dtype=np.int64)
        # Speculative decoding (engine/drafts.py): whether the row speculates (its tokens are
        # checked against nothing token by token: no penalties, grammar, thinking or beams),
        # and the drafts it runs in the next step after its newest token.
        self.speculates = np.zeros(capacity, dtype=bool)
        self.drafts = np.zeros((capacity, max_drafts), dtype=np.int64)
        self.num_drafts = np.zeros(capacity, dtype=np.int64)
        # Its drafts accepted and tried (up to the first rejected), counted with decay: its
        # running acceptance, which decides how many drafts it runs (speculative/budget.py).
        self.draft_hits = np.zeros(capacity, dtype=np.float64)
        self.draft_tries = np.zeros(capacity, dtype=np.float64)
        # The sequence's id (-1: a free row): the drafter follows rows by it (engine/drafts.py).
        self.seq_id = np.full(capacity, -1, dtype=np.int64)
        self._ending: set[int] = set()
        self._ending_ids = np.zeros(0, dtype=np.int64)
        self._seq: list[Sequence | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    def seq_at(self, row: int) -> Sequence:
        seq = self._seq[row]
        assert seq is not None, f"row {row} is free"
        return seq

    def seqs(self, rows: np.ndarray) -> list[Sequence]:
        """The sequences of rows, in order (Python per row: for the rows that need it)."""
        at = self._seq
        return [at[r] for r in rows.tolist()]  # type: ignore[misc]

    def join(self, seq: Sequence) -> int:
        """seq starts running: it takes a free row, written whole from it; from now on its
        computed count and tokens live in the row."""
        assert seq.batch is None, f"sequence {seq.seq_id} already holds a row"
        if not self._free:
            raise RuntimeError(f"more than {self.capacity} running sequences: this is a bug")
        row = self._free.pop()
        self._seq[row] = seq
        self.seq_id[row] = seq.seq_id
        tokens = seq.token_ids
        self.computed[row] = seq.num_computed_tokens
        self.num_tokens[row] = len(tokens)
        self.synced[row] = len(tokens)
        self.last_token[row] = tokens[-1]
        self.reads_rows[row] = seq.reads_every_prompt_row
        self.plain_greedy[row] = seq.plain_greedy
        self.forking[row] = seq.feature(PendingForks) is not None
        self.beam[row] = seq.params.use_beam_search
        self.has_images[row] = bool(seq.request.images)
        self.rope_delta[row] = _rope_delta(seq)
        for column, value in zip(self.sampling, RowParams.of([seq.params]), strict=True):
            column[row] = value[0]
        self.constrained[row] = seq.feature(Constraint) is not None
        self.speculates[row] = self.drafts.shape[1] > 0 and _may_speculate(seq, self, row)
        self.seed[row] = seq.seed
        for column, value in zip(self.limits, OutputLimits.of([seq]), strict=True):
            column[row] = value[0]
        slot = self.adapters.slot_of(seq.request.lora)
        self.lora_slot[row] = slot
        self.lora_rows += int(slot >= 0)
        self._write_stop_columns(row, seq)
        self._write_table(row, seq.block_table, 0)
        seq.batch, seq.row = self, row
        return row

    def leave(self, seq: Sequence) -> None:
        """seq finished or was preempted: its computed count and tokens go back to it, and its
        row may go to another sequence."""
        assert seq.batch is self
        row = seq.row
        self.sync(row)
        seq._computed = int(self.computed[row])
        seq.batch, seq.row = None, -1
        self._clear(row)

    def in_use(self, row: int) -> bool:
        """Whether a sequence holds the row."""
        return self._seq[row] is not None

    def held(self) -> tuple[int, int]:
        """(tokens computed, block-table entries) of all running rows together (a free row is
        zero in both)."""
        return int(self.computed.sum()), int(self.table_len.sum())

    def sync(self, row: int) -> None:
        """Move the row's unread tokens into its sequence's list."""
        n = int(self.num_tokens[row])
        done = int(self.synced[row])
        if n != done:
            seq = self._seq[row]
            assert seq is not None
            seq._tokens += self.unread[row, : n - done].tolist()
            self.synced[row] = n

    def refresh_tables(self, changed: list[Sequence]) -> None:
        """Rewrite the block-table rows of sequences whose tables changed. A table only grows
        or has its last entry replaced (copy-on-write) while its sequence holds a row: its
        blocks are freed only when it leaves."""
        for seq in changed:
            row = seq.row
            if seq.batch is self:
                self._write_table(row, seq.block_table, max(0, int(self.table_len[row]) - 1))

    def advance(self, rows: np.ndarray, num_new: np.ndarray) -> None:
        """The step computed num_new tokens of each of rows (distinct rows)."""
        self.computed[rows] += num_new

    def append_tokens(self, rows: np.ndarray, tokens: list[int] | np.ndarray) -> None:
        """Each of rows (distinct) took one new token."""
        at = self.num_tokens[rows] - self.synced[rows]
        if len(at) and int(at.max()) >= self.unread.shape[1]:
            wider = np.zeros((self.capacity, 2 * self.unread.shape[1]), dtype=np.int64)
            wider[:, : self.unread.shape[1]] = self.unread
            self.unread = wider
        self.unread[rows, at] = tokens
        self.last_token[rows] = tokens
        self.num_tokens[rows] += 1

    def rows_to_check(self, rows: np.ndarray, tokens: list[int]) -> list[int]:
        """The indices i of rows (which just took tokens[i], counted in num_tokens) whose token
        needs Python: it is their first, it may end them (an ending id, the length limit), or
        their flags ask for every token. No other row's sequence stops on this token."""
        n = self.num_tokens[rows]
        check = self.each_token[rows] | (n >= self.stop_len[rows])
        check |= n == self.num_prompt[rows] + 1
        check |= np.isin(np.asarray(tokens, dtype=np.int64), self._ending_ids)
        return np.flatnonzero(check).tolist()

    def _write_stop_columns(self, row: int, seq: Sequence) -> None:
        stop = seq.stop
        self.num_prompt[row] = seq.num_prompt_tokens
        limit = stop.length_limit
        self.stop_len[row] = seq.num_prompt_tokens + (limit if limit is not None else 2**62)
        self.each_token[row] = (
            stop.follows_each_token
            or seq.feature(Constraint) is not None
            or seq.feature(ThinkingTracker) is not None
            or seq.params.logprobs is not None
        )
        ending = stop.ending_ids
        if not ending <= self._ending:
            self._ending |= ending
            self._ending_ids = np.array(sorted(self._ending), dtype=np.int64)

    def _clear(self, row: int) -> None:
        self.block_tables[row, : self.table_len[row]] = 0
        self.table_len[row] = 0
        self.computed[row] = self.num_tokens[row] = self.synced[row] = 0
        self.speculates[row] = self.has_images[row] = False
        self.rope_delta[row] = 0
        self.num_drafts[row] = 0
        self.draft_hits[row] = self.draft_tries[row] = 0.0
        self.seq_id[row] = -1
        self.lora_rows -= int(self.lora_slot[row] >= 0)
        self.lora_slot[row] = -1
        self._seq[row] = None
        self._free.append(row)

    def _write_table(self, row: int, table: list[int], start: int) -> None:
        n = len(table)
        if n > self.block_tables.shape[1]:
            limit = self.block_tables.shape[1]
            raise ValueError(
                f"a block table of {n} blocks exceeds the rows' {limit} (max_model_len)"
            )
        if n > start:
            self.block_tables[row, start:n] = table[start:]
        self.table_len[row] = n

    def check_integrity(self) -> None:
        """Rows are in use or free, never both; a free row is zero where the scheduler sums;
        each row in use is its sequence's (and it knows it), with its length, newest token,
        unread tokens and block table, zero past the table."""
        assert len(self._free) == len(set(self._free))
        assert self.lora_rows == int((self.lora_slot >= 0).sum())
        used = [row for row in range(self.capacity) if self._seq[row] is not None]
        assert len(used) + len(self._free) == self.capacity
        assert not set(used) & set(self._free)
        for row in range(self.capacity):
            seq = self._seq[row]
            n = int(self.table_len[row])
            assert not self.block_tables[row, n:].any(), f"row {row}: stale padding"
            if seq is None:
                assert n == 0 and self.lora_slot[row] == -1 and self.seq_id[row] == -1
                assert not self.speculates[row] and not self.num_drafts[row], f"row {row}: drafts"
                assert not self.has_images[row], f"row {row}: images"
                assert not self.rope_delta[row], f"row {row}: rope delta"
                assert self.computed[row] == self.num_tokens[row] == 0, f"row {row}: not zero"
                continue
            assert seq.batch is self and seq.row == row, f"row {row}: not its sequence's"
            assert self.seq_id[row] == seq.seq_id, f"row {row}: sequence id"
            unread = int(self.num_tokens[row] - self.synced[row])
            assert len(seq._tokens) == self.synced[row] and unread >= 0, f"row {row}: length"
            tail = self.unread[row, unread - 1] if unread else seq._tokens[-1]
            assert self.last_token[row] == tail, f"row {row}: last token"
            assert self.computed[row] <= self.num_tokens[row], f"row {row}: computed"
            assert self.reads_rows[row] == seq.reads_every_prompt_row
            assert self.plain_greedy[row] == seq.plain_greedy
            forking = seq.feature(PendingForks) is not None
            assert self.forking[row] == forking, f"row {row}: forking"
            assert self.beam[row] == seq.params.use_beam_search, f"row {row}: beam"
            assert self.has_images[row] == bool(seq.request.images), f"row {row}: images"
            assert self.rope_delta[row] == _rope_delta(seq), f"row {row}: rope delta"
            own = RowParams.of([seq.params])
            assert all(c[row] == v[0] for c, v in zip(self.sampling, own, strict=True))
            assert self.constrained[row] == (seq.feature(Constraint) is not None)
            assert self.seed[row] == seq.seed, f"row {row}: seed"
            may = self.drafts.shape[1] > 0 and _may_speculate(seq, self, row)
            assert self.speculates[row] == may, f"row {row}: speculates"
            drafts = int(self.num_drafts[row])
            assert 0 <= drafts <= self.drafts.shape[1], f"row {row}: drafts"
            assert not drafts or self.speculates[row], f"row {row}: drafts without speculating"
            limits = OutputLimits.of([seq])
            assert all(c[row] == v[0] for c, v in zip(self.limits, limits, strict=True))
            assert self.lora_slot[row] == self.adapters.slot_of(seq.request.lora), "lora slot"
            assert self.block_tables[row, :n].tolist() == seq.block_table, f"row {row}: table"


def _rope_delta(seq: Sequence) -> int:
    mrope = seq.request.mrope
    return 0 if mrope is None else mrope.delta


def _may_speculate(seq: Sequence, batch: InputBatch, row: int) -> bool:
    """Whether seq's row may take drafted tokens (its sampling columns written): nothing checks
    its tokens one by one (penalties, logit bias, min_tokens, thinking, beams). A grammar row
    may: its drafts are cut where the grammar rejects one (engine/drafts.py) and each position
    is masked by the grammar after the drafts before it (GrammarMasks.fill)."""
    return not (
        batch.sampling.processed[row] or batch.beam[row] or seq.feature(ThinkingTracker) is not None
    )
