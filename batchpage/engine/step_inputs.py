"""Builds one step's tensors from the scheduler's decision: the single place that computes token
ids, positions, slot mapping, block tables and which rows are sampled.

The running sequences' block tables persist between steps in one preallocated int32 buffer, a
row per sequence (BlockTableRows): a row is written when its sequence first runs and then only
where its table changed, so a step's block tables are one gather of its rows, never a padded
copy of every table. The step's integer inputs are gathered into one host tensor (pinned on
CUDA) that reaches the device in a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.engine.scheduler import ScheduledSeq
from batchpage.engine.sequence import Sequence


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]: the last row of each sequence that samples
    sample_seqs: list[Sequence]  # the N sequences that sample, in row order
    # Prompt logprobs: rows whose logits score the next prompt token, and who asked for them.
    prompt_rows: torch.Tensor  # int64 [P]
    prompt_targets: list[int]  # [P]: the prompt token each row scores
    prompt_owners: list[tuple[Sequence, int]]  # (sequence, how many of the P rows are its)
    # MEAN / CLS pooling (engine/pooling.py): the rows each pooling sequence sums this step.
    pool_rows: torch.Tensor  # int64 [R]
    pool_owners: list[tuple[Sequence, int, int]]  # (sequence, chunk start, how many R rows)


class BlockTableRows:
    """Copies of sequences' block tables, one row each of an int32 [capacity, max_blocks]
    buffer, padded with 0.

    Contract with the KV cache manager (the one writer of Sequence.block_table): a sequence's
    table list only grows, or has its last entry replaced (copy-on-write), until its blocks are
    released, and then it is replaced by a new list, never cleared in place. So a row is current
    when it was written from this very list object (`is`) and the list's length and last entry
    are those written; otherwise the changed part (or, for a new list, the whole row) is written.
    Rows are a cache keyed by sequence id: when none is free, the rows of sequences outside the
    step being built are reclaimed (a sequence that comes back is written afresh)."""

    def __init__(self, capacity: int, max_blocks: int) -> None:
        self.buffer = torch.zeros(capacity, max_blocks, dtype=torch.int32)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(capacity - 1, -1, -1))
        self._source: list[list[int] | None] = [None] * capacity  # the list a row copies
        self._written = [0] * capacity  # entries written from it
        self._last = [0] * capacity  # its last entry when written
        self._last_step: list[Sequence] = []  # what check_integrity can hold current

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """The current rows of seqs (in order), writing what changed."""
        rows = []
        for seq in seqs:
            row = self._row.get(seq.seq_id)
            if row is None:
                row = self._take(seq, seqs)
            table = seq.block_table
            n = len(table)
            if self._source[row] is not table:
                self._write(row, table, 0)
            elif n != self._written[row] or (n and table[-1] != self._last[row]):
                self._write(row, table, max(0, self._written[row] - 1))
            rows.append(row)
        self._last_step = seqs
        return rows

    def release(self, seq: Sequence) -> None:
        row = self._row.pop(seq.seq_id, None)
        if row is not None:
            self._source[row] = None
            self._free.append(row)

    def _take(self, seq: Sequence, step: list[Sequence]) -> int:
        if not self._free:
            keep = {s.seq_id for s in step}
            for seq_id in [i for i in self._row if i not in keep]:
                row = self._row.pop(seq_id)
                self._source[row] = None
                self._free.append(row)
        row = self._free.pop()
        self._row[seq.seq_id] = row
        return row

    def _write(self, row: int, table: list[int], start: int) -> None:
        n = len(table)
        if n > self.buffer.shape[1]:
            limit = self.buffer.shape[1]
            raise ValueError(
                f"a block table of {n} blocks exceeds the rows' {limit} (max_model_len)"
            )
        if n > start:
            self.buffer[row, start:n] = torch.tensor(table[start:], dtype=torch.int32)
        if self._source[row] is not table and self._written[row] > n:
            self.buffer[row, n : self._written[row]] = 0
        self._source[row], self._written[row] = table, n
        self._last[row] = table[-1] if n else 0

    def check_integrity(self) -> None:
        """Rows are in use or free, never both; every row is zero past what was written into
        it; the rows of the last `rows` call hold exactly their sequences' tables."""
        assert len(self._row) + len(self._free) == self.buffer.shape[0]
        assert set(self._row.values()).isdisjoint(self._free)
        for row in range(self.buffer.shape[0]):
            assert not self.buffer[row, self._written[row] :].any(), f"row {row}: stale padding"
        for seq in self._last_step:
            row, table = self._row[seq.seq_id], seq.block_table
            assert self._source[row] is table and self._written[row] == len(table)
            assert self.buffer[row, : len(table)].tolist() == table, f"row {row} is stale"


class StepBuilder:
    """Builds StepInputs; owns the persistent block-table rows (see BlockTableRows)."""

    def __init__(
        self, capacity: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.tables = BlockTableRows(capacity, max_blocks)
        self.block_size = block_size
        self.device = torch.device(device)

    def release(self, seq: Sequence) -> None:
        """seq has finished: its row may go to another sequence."""
        self.tables.release(seq)

    def build(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[Sequence, int]] = []
        pool_rows: list[int] = []
        pool_owners: list[tuple[Sequence, int, int]] = []
        total = 0
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # a decode: one token, one slot
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            total += n
            query_start.append(total)
            query_lens.append(n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the prefill is complete: the sequence samples
                logits_indices.append(total - 1)
                sample_seqs.append(seq)
            if seq.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1; positions already scored (before
                # a recompute) are not scored again.
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    row0 = total - n - start
                    prompt_rows += range(row0 + first, row0 + last)
                    prompt_targets += seq.token_ids[first + 1 : last + 1]
                    prompt_owners.append((seq, last - first))
            pooling = seq.request.pooling
            if pooling is not None and pooling.reads_every_row:
                wanted = pooling.chunk_rows(start, end)
                if wanted:
                    row0 = total - n - start
                    pool_rows += (row0 + p for p in wanted)
                    pool_owners.append((seq, start, len(wanted)))

        seqs = [s.seq for s in scheduled]
        rows = self.tables.rows(seqs)
        width = max((len(s.block_table) for s in seqs), default=0)
        index = torch.tensor(rows, dtype=torch.long)
        tables = self.tables.buffer[:, :width].index_select(0, index)  # contiguous [B, width]
        # One host tensor for every integer input, one copy to the device.
        parts = (
            input_ids, positions, slots, logits_indices, prompt_rows, pool_rows, query_start,
            seq_lens,
        )  # fmt: skip
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
            tables = tables.pin_memory().to(self.device, non_blocking=True)
        views = flat.split([len(part) for part in parts])
        ids, pos, slot_mapping, logits_rows, prompt_index, pool_index, starts, lens = views
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=starts.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=tables,
            block_size=bs,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
        return StepInputs(
            input_ids=ids,
            positions=pos,
            meta=meta,
            logits_indices=logits_rows,
            sample_seqs=sample_seqs,
            prompt_rows=prompt_index,
            prompt_targets=prompt_targets,
            prompt_owners=prompt_owners,
            pool_rows=pool_index,
            pool_owners=pool_owners,
        )
