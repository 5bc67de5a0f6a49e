"""The persistent input batch and the step builder against a brute-force model: every step's
tensors written out afresh from the sequences' own lists (token ids, computed counts, block
tables), through random prefill chunks, decodes, copy-on-write forks, prefix sharing, preemption,
finishing and row reclaiming driven through a real KV cache manager; and one step's tensors
against values written out by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchpage.cache.block_pool import OutOfBlocks
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import KVCacheManager
from batchpage.engine.schedule_output import ScheduledSeq
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.step_inputs import StepBuilder, StepInputs
from batchpage.engine.stop_checker import StopChecker
from batchpage.sampling_params import SamplingParams


def _seq(seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> Sequence:
    params = params or SamplingParams()
    req = Request(index=seq_id, prompt=None, prompt_token_ids=prompt, params=params)
    stop = StopChecker(lambda ids: "", params, prompt_len=len(prompt))
    seq = Sequence(seq_id, req, 0, list(prompt), 0, stop=stop)
    if params.prompt_logprobs is not None:
        seq.result.prompt_logprobs = [None]
    return seq


def _expected(
    scheduled: list[ScheduledSeq], bs: int, truth: dict[int, list[int]]
) -> dict[str, list]:
    """The step's inputs from the sequences' own records alone (tokens from `truth`)."""
    ids, pos, slots, starts, lens, logits, prompt_rows = [], [], [], [0], [], [], []
    width = max(len(s.seq.block_table) for s in scheduled)
    for seq, n in scheduled:
        a = seq.num_computed_tokens
        row0 = starts[-1] - a
        for p in range(a, a + n):
            ids.append(truth[seq.seq_id][p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        starts.append(starts[-1] + n)
        lens.append(a + n)
        if a + n == len(truth[seq.seq_id]):
            logits.append(starts[-1] - 1)
        scored = seq.result.prompt_logprobs
        if scored is not None:
            first = max(a, len(scored) - 1)
            prompt_rows += range(row0 + first, row0 + min(a + n, seq.num_prompt_tokens - 1))
    tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in scheduled]
    return {
        "input_ids": ids,
        "positions": pos,
        "slots": slots,
        "query_start": starts,
        "seq_lens": lens,
        "logits": logits,
        "tables": tables,
        "prompt_rows": prompt_rows,
    }


def _got(inputs: StepInputs) -> dict[str, list]:
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slots": meta.slot_mapping.tolist(),
        "query_start": meta.query_start_loc.tolist(),
        "seq_lens": meta.seq_lens.tolist(),
        "logits": inputs.logits_indices.tolist(),
        "tables": meta.block_tables.tolist(),
        "prompt_rows": inputs.prompt_rows.tolist(),
    }


@pytest.mark.parametrize("seed", range(8))
def test_steps_equal_inputs_written_afresh(seed: int) -> None:
    rng = random.Random(seed)
    bs, capacity = 4, 6
    kv = KVCacheManager(num_blocks=40, block_size=bs, prefix_caching=True)
    batch = InputBatch(capacity, max_blocks=16)
    builder = StepBuilder(batch, block_size=bs, device=torch.device("cpu"))
    base = [rng.randrange(50) for _ in range(12)]  # a shared prefix some prompts start with
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    truth: dict[int, list[int]] = {}  # each sequence's tokens, kept apart from the batch
    next_id = 0

    def leave(seq: Sequence) -> None:
        running.remove(seq)
        batch.leave(seq)
        kv.free(seq)
        assert seq.token_ids == truth[seq.seq_id]

    for _ in range(120):
        while len(waiting) < 3:
            prompt = base[: rng.randrange(13)] + [rng.randrange(50) for _ in range(1, 9)]
            logprobs = SamplingParams(prompt_logprobs=1) if rng.random() < 0.2 else None
            waiting.append(_seq(next_id, prompt, logprobs))
            truth[next_id] = list(prompt)
            next_id += 1
        if len(running) < capacity - 1 and rng.random() < 0.5:
            seq = waiting.pop(0)
            kv.lend_prefix(seq)
            batch.join(seq)
            running.append(seq)
        if running and rng.random() < 0.15:  # a fork of a sequence that has sampled
            parent = rng.choice(running)
            if parent.num_computed_tokens == parent.num_tokens - 1 and len(running) < capacity:
                child = _seq(next_id, parent.token_ids[: parent.num_prompt_tokens])
                child.token_ids = list(parent.token_ids)
                truth[next_id] = list(parent.token_ids)
                next_id += 1
                kv.fork(parent, child)
                batch.join(child)
                running.append(child)
        if running and rng.random() < 0.1:  # preempted or finished: its blocks go back
            leave(rng.choice(running))
        scheduled = []
        for seq in running:
            n = min(seq.num_uncomputed_tokens, rng.randrange(1, 7))
            try:
                kv.allocate(seq, n)
            except OutOfBlocks:
                continue
            scheduled.append(ScheduledSeq(seq, n))
        if not scheduled:
            continue
        batch.refresh_tables(kv.take_changed())
        rows = np.array([s.seq.row for s in scheduled])
        inputs = builder.build(rows, np.array([n for _, n in scheduled]))
        batch.check_integrity()
        assert _got(inputs) == _expected(scheduled, bs, truth)
        sampling = [s.seq for s in scheduled if s.completes_prefill]
        assert batch.seqs(inputs.sample_rows) == sampling
        # Commit the step as the scheduler and the engine do.
        batch.advance(inputs.rows, inputs.num_new)
        for seq, _ in scheduled:
            scored = seq.result.prompt_logprobs
            if scored is not None:
                last = min(seq.num_computed_tokens, seq.num_prompt_tokens - 1)
                scored += [None] * max(0, last - len(scored) + 1)
            kv.cache_progress(seq)
        tokens = [rng.randrange(50) for _ in sampling]
        for seq, token in zip(sampling, tokens, strict=True):
            truth[seq.seq_id].append(token)
        batch.append_tokens(inputs.sample_rows, tokens)
        batch.check_integrity()
        for seq in [s for s in running if s.num_tokens >= 40]:
            leave(seq)


def test_a_step_of_decodes_and_prefill_chunks() -> None:
    bs = 4
    batch = InputBatch(capacity=4, max_blocks=8)
    builder = StepBuilder(batch, block_size=bs, device=torch.device("cpu"))
    decode = _seq(0, [5, 6, 7, 8, 9])
    decode.append_token(10)  # sampled last step; K/V of the 5 prompt tokens is computed
    decode.num_computed_tokens = 5
    decode.block_table = [3, 7]
    chunk = _seq(1, list(range(20, 30)))  # 10 prompt tokens: a chunk of 6, then 4
    chunk.block_table = [1, 2]
    rows = np.array([batch.join(decode), batch.join(chunk)])
    inputs = builder.build(rows, np.array([1, 6]))
    assert inputs.input_ids.tolist() == [10, 20, 21, 22, 23, 24, 25]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 3, 4, 5]
    # Position p of a sequence lives at block_table[p // bs] * bs + p % bs.
    assert inputs.meta.slot_mapping.tolist() == [7 * 4 + 1, 4, 5, 6, 7, 8, 9]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 7]
    assert inputs.meta.seq_lens.tolist() == [6, 6]
    assert inputs.meta.block_tables.tolist() == [[3, 7], [1, 2]]
    assert inputs.logits_indices.tolist() == [0]  # the chunk does not complete its prompt
    assert batch.seqs(inputs.sample_rows) == [decode]
    assert inputs.meta.query_start_loc.dtype == torch.int32
    assert inputs.meta.block_tables.is_contiguous()

    batch.advance(inputs.rows, inputs.num_new)
    assert (chunk.num_computed_tokens, decode.num_computed_tokens) == (6, 6)
    chunk.block_table.append(4)
    batch.refresh_tables([chunk])
    batch.append_tokens(inputs.sample_rows, [11])
    assert decode.token_ids == [5, 6, 7, 8, 9, 10, 11]
    inputs = builder.build(rows, np.array([1, 4]))
    assert inputs.input_ids.tolist() == [11, 26, 27, 28, 29]
    assert inputs.meta.block_tables.tolist() == [[3, 7, 0], [1, 2, 4]]
    assert inputs.logits_indices.tolist() == [0, 4]
    assert batch.seqs(inputs.sample_rows) == [decode, chunk]
    batch.check_integrity()


def test_a_row_holds_its_sequence_until_it_leaves() -> None:
    """A running sequence's computed count and new tokens live in its row (however many, past
    the unread columns' first width); leaving hands them back and zeroes the row."""
    batch = InputBatch(capacity=2, max_blocks=4)
    seqs = [_seq(i, [i + 1, i + 2]) for i in range(3)]
    rows = [batch.join(seqs[0]), batch.join(seqs[1])]
    with pytest.raises(RuntimeError, match="more than 2 running sequences"):
        batch.join(seqs[2])
    new = list(range(100, 140))
    for token in new:
        batch.append_tokens(np.array(rows), [token, token + 1])
        batch.check_integrity()
    seqs[0].num_computed_tokens = 30
    assert batch.computed[rows[0]] == 30 and seqs[0].num_tokens == 42
    batch.leave(seqs[0])
    assert seqs[0].batch is None and seqs[0].num_computed_tokens == 30
    assert seqs[0].token_ids == [1, 2, *new]
    assert batch.held() == (0, 0) and len(batch) == 1
    assert batch.join(seqs[2]) == rows[0]
    assert seqs[1].token_ids == [2, 3, *(t + 1 for t in new)]
    batch.check_integrity()
