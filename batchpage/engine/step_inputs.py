"""Builds one step's tensors from the scheduler's decision: the single place that computes token
ids, positions, slot mapping, block tables and which rows are sampled.

The running sequences' state persists between steps in the input batch (input_batch.py), so a
step's inputs are gathers of its columns: positions from the computed counts, slots from the
block-table rows, the token of each decode from the newest-token column. Only rows that compute
more than their newest token (prefill chunks, recomputation) read their token lists, and only
rows that read every prompt row (prompt logprobs, MEAN / CLS pooling) are walked one by one. On
CUDA the step's integer inputs travel in one pinned host tensor and a single copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.engine.image_spans import span_key_ends
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.mrope_steps import step_positions
from batchpage.engine.sequence import Sequence

if TYPE_CHECKING:
    from batchpage.model.image_prompt import PromptImage


class ImageSlice(NamedTuple):
    """The part of one prompt image a step computes: the image's encoder rows `rows` (indices
    into its rows, in order) replace the token embeddings of the step's token rows `tokens`."""

    image: PromptImage
    rows: np.ndarray  # int64 [K]
    tokens: np.ndarray  # int64 [K]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]; an M-RoPE model's [3, T] (mrope_steps.py)
    meta: AttentionMetadata
    # int64 [L]: the rows whose logits are sampled: the last row of each sequence that samples,
    # and before it the row of its newest token and of each draft but the last when it runs
    # drafts (speculative decoding: sample_counts[i] rows for sample_rows[i]).
    logits_indices: torch.Tensor
    # Prompt logprobs: rows whose logits score the next prompt token, and who asked for them.
    prompt_rows: torch.Tensor  # int64 [P]
    prompt_targets: list[int]  # [P]: the prompt token each row scores
    prompt_owners: list[tuple[Sequence, int]]  # (sequence, how many of the P rows are its)
    # MEAN / CLS pooling (engine/pooled_states.py): the rows each pooling sequence sums this step.
    pool_rows: torch.Tensor  # int64 [R]
    pool_owners: list[tuple[Sequence, int, int]]  # (sequence, chunk start, how many R rows)
    # The input batch's rows: of every scheduled sequence, with the tokens each computes, and
    # of the N that sample, in order (InputBatch.seqs gives their sequences).
    rows: np.ndarray  # int64 [B]
    num_new: np.ndarray  # int64 [B]
    sample_rows: np.ndarray  # int64 [N]
    sample_counts: np.ndarray  # int64 [N]: logits rows of each (1 + the drafts it ran)
    sample_entries: np.ndarray  # int64 [N]: where each sample row is in `rows`
    # Each token row's LoRA slot (-1: the base model); None when no row runs an adapter.
    token_lora: torch.Tensor | None = None
    # The image positions this step computes, per image part (none for a text-only step).
    images: tuple[ImageSlice, ...] = ()


class StepBuilder:
    """Builds StepInputs from the scheduler's persistent input batch (input_batch.py)."""

    def __init__(
        self,
        batch: InputBatch,
        block_size: int,
        device: torch.device,
        mrope: bool = False,
        image_spans: bool = False,
    ) -> None:
        """`mrope`: the model's rope has M-RoPE sections, so positions are [3, T];
        `image_spans`: the model's image rows see their whole span (image_spans.py), so a step
        over image positions bounds their keys (AttentionMetadata.key_end)."""
        self.batch = batch
        self.block_size = block_size
        self.device = torch.device(device)
        self.mrope = mrope
        self.image_spans = image_spans

    def build(self, rows: np.ndarray, num_new: np.ndarray) -> StepInputs:
        """The step's tensors: `rows` of the batch compute num_new tokens each (the scheduler's
        decision, SchedulerOutput, with the batch's block tables brought up to date)."""
        batch, bs = self.batch, self.block_size
        start = batch.computed[rows]
        end = start + num_new
        newest = batch.num_tokens[rows]
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        total = int(query_start[-1])
        if total == len(rows):  # one token a row: a row is its token
            token_rows, positions = rows, start
        else:
            entry = np.repeat(np.arange(len(rows)), num_new)  # each token's scheduled entry
            token_rows = rows[entry]
            positions = (start - query_start[:-1])[entry] + np.arange(total)
        slots = batch.block_tables[token_rows, positions // bs].astype(np.int64) * bs
        slots += positions % bs
        input_ids = batch.last_token[token_rows]  # right for every row that computes its newest
        # Rows that compute tokens before their newest (prompt chunks, recomputation) read them.
        older = np.flatnonzero(start < newest - 1).tolist()
        if older:
            starts, first = start.tolist(), query_start.tolist()
            stops = np.minimum(end, newest).tolist()
            for i in older:
                a, b = starts[i], stops[i]
                tokens = batch.seq_at(int(rows[i])).token_ids
                input_ids[first[i] : first[i] + b - a] = tokens[a:b]
        drafted = np.maximum(end - newest, 0)  # drafts run after the newest token
        if drafted.any():
            at = positions - np.repeat(newest, num_new)
            past = at >= 0
            input_ids[past] = batch.drafts[token_rows[past], at[past]]
        samples = end >= newest  # all the sequence's tokens computed (and its drafts): it samples
        sample_entries = np.flatnonzero(samples)
        sample_counts = drafted[samples] + 1
        last = query_start[1:][samples]
        if drafted.any():  # each draft's row and the newest token's are sampled too
            base = np.repeat(last - sample_counts, sample_counts)
            offsets = np.arange(int(sample_counts.sum())) - np.repeat(
                np.cumsum(sample_counts) - sample_counts, sample_counts
            )
            logits_indices = base + offsets
        else:
            logits_indices = last - 1
        sample_rows = rows[samples]
        images = ()
        if batch.has_images[rows].any():
            images = _image_slices(batch, rows, start, end, query_start)
        key_end, span_seqs = None, ()
        if images and self.image_spans:
            spans = [(s.tokens, s.image.positions[-1] + 1) for s in images]
            row_ends = np.repeat(end, num_new)
            key_end, span_seqs = span_key_ends(spans, positions, row_ends, query_start)
        reads = np.flatnonzero(batch.reads_rows[rows]).tolist()
        prompt, pool = _rows_read(batch, rows, num_new, reads, query_start.tolist())
        prompt_rows, prompt_targets, prompt_owners = prompt
        pool_rows, pool_owners = pool

        width = int(batch.table_len[rows].max()) if len(rows) else 0
        tables = torch.from_numpy(batch.block_tables[rows, :width])  # a contiguous copy
        # Every integer input in one host tensor (one copy to a device), then views of it.
        read = [np.array(r, dtype=np.int64) for r in (prompt_rows, pool_rows)]
        rope = positions
        if self.mrope:
            rope = step_positions(batch, rows, token_rows, positions, start, end, query_start)
        parts = [input_ids, rope.reshape(-1), slots, logits_indices, *read, query_start, end]
        if batch.lora_rows:
            parts.append(batch.lora_slot[token_rows])
        flat = torch.from_numpy(np.concatenate(parts))
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
            tables = tables.pin_memory().to(self.device, non_blocking=True)
        views = flat.split([len(p) for p in parts])
        ids, pos, slot_mapping, logits_rows, prompt_index, pool_index, starts, lens = views[:8]
        token_lora = views[8] if batch.lora_rows else None
        if self.mrope:
            pos = pos.view(3, -1)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=starts.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=tables,
            block_size=bs,
            query_lens_cpu=tuple(num_new.tolist()),
            seq_lens_cpu=tuple(end.tolist()),
            key_end=None if key_end is None else torch.from_numpy(key_end).to(self.device),
            span_seqs=span_seqs,
        )
        return StepInputs(
            input_ids=ids,
            positions=pos,
            meta=meta,
            logits_indices=logits_rows,
            prompt_rows=prompt_index,
            prompt_targets=prompt_targets,
            prompt_owners=prompt_owners,
            pool_rows=pool_index,
            pool_owners=pool_owners,
            rows=rows,
            num_new=num_new,
            sample_rows=sample_rows,
            sample_counts=sample_counts,
            sample_entries=sample_entries,
            token_lora=token_lora,
            images=images,
        )


def _image_slices(
    batch: InputBatch,
    rows: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    query_start: np.ndarray,
) -> tuple[ImageSlice, ...]:
    """The image parts of the scheduled rows that compute prompt positions of an image."""
    slices = []
    prompt = np.flatnonzero(batch.has_images[rows] & (start < batch.num_prompt[rows]))
    for i in prompt.tolist():
        a, b = int(start[i]), int(end[i])
        for image in batch.seq_at(int(rows[i])).request.images:
            at = np.asarray(image.positions, dtype=np.int64)
            inside = np.flatnonzero((at >= a) & (at < b))
            if len(inside):
                slices.append(ImageSlice(image, inside, at[inside] - a + query_start[i]))
    return tuple(slices)


_PromptRows = tuple[list[int], list[int], list[tuple[Sequence, int]]]
_PoolRows = tuple[list[int], list[tuple[Sequence, int, int]]]


def _rows_read(
    batch: InputBatch,
    rows: np.ndarray,
    num_new: np.ndarray,
    reads: list[int],
    query_start: list[int],
) -> tuple[_PromptRows, _PoolRows]:
    """The step rows of the scheduled entries `reads` (indices into rows) whose outputs their
    sequences read: prompt logprobs (the rows, the prompt token each scores, and how many are
    each sequence's) and MEAN / CLS pooling (the rows, and each sequence's chunk start and row
    count)."""
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_owners: list[tuple[Sequence, int]] = []
    pool_rows: list[int] = []
    pool_owners: list[tuple[Sequence, int, int]] = []
    for i in reads:
        seq, n = batch.seq_at(int(rows[i])), int(num_new[i])
        start = seq.num_computed_tokens
        end = start + n
        row0 = query_start[i] - start  # the step row of the sequence's position 0
        scored = seq.result.prompt_logprobs
        if scored is not None:
            # Position p's logits score prompt token p + 1; positions already scored (before
            # a recompute) are not scored again.
            first = max(start, len(scored) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                prompt_rows += range(row0 + first, row0 + last)
                prompt_targets += seq.token_ids[first + 1 : last + 1]
                prompt_owners.append((seq, last - first))
        pooling = seq.request.pooling
        if pooling is not None and pooling.reads_every_row:
            wanted = pooling.chunk_rows(start, end)
            if wanted:
                pool_rows += (row0 + p for p in wanted)
                pool_owners.append((seq, start, len(wanted)))
    return (prompt_rows, prompt_targets, prompt_owners), (pool_rows, pool_owners)
