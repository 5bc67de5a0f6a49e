"""Builds one step's tensors from the scheduler's decision: the single place that computes token
ids, positions, slot mapping, block tables and which rows are sampled."""

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


def build_step(
    scheduled: list[ScheduledSeq], block_size: int, device: torch.device | str
) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    sample_seqs: list[Sequence] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_owners: list[tuple[Sequence, int]] = []
    for s in scheduled:
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = seq.block_table
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_start.append(query_start[-1] + s.num_new_tokens)
        seq_lens.append(end)
        tables.append(table)
        if s.completes_prefill:
            logits_indices.append(query_start[-1] - 1)
            sample_seqs.append(seq)
        if seq.prompt_logprobs is not None:
            # Position p's logits score prompt token p + 1; positions already scored (before a
            # recompute) are not scored again.
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if first < last:
                row0 = query_start[-2] - start
                prompt_rows += range(row0 + first, row0 + last)
                prompt_targets += seq.token_ids[first + 1 : last + 1]
                prompt_owners.append((seq, last - first))

    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.long),
        query_start_loc=as_tensor(query_start, torch.int32),
        seq_lens=as_tensor(seq_lens, torch.int32),
        block_tables=as_tensor(padded, torch.int32).reshape(len(tables), width),
        block_size=block_size,
        query_lens_cpu=tuple(s.num_new_tokens for s in scheduled),
        seq_lens_cpu=tuple(seq_lens),
    )
    return StepInputs(
        input_ids=as_tensor(input_ids, torch.long),
        positions=as_tensor(positions, torch.long),
        meta=meta,
        logits_indices=as_tensor(logits_indices, torch.long),
        sample_seqs=sample_seqs,
        prompt_rows=as_tensor(prompt_rows, torch.long),
        prompt_targets=prompt_targets,
        prompt_owners=prompt_owners,
    )
