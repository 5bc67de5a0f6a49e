"""The step builder's persistent block-table rows against a brute-force model (every table
padded afresh each step), through random growth, copy-on-write, release, readmission and row
reclaiming; and a step's tensors against the values written out by hand."""

from __future__ import annotations

import random

import pytest
import torch

from batchpage.engine.scheduler import ScheduledSeq
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.step_inputs import BlockTableRows, StepBuilder
from batchpage.sampling_params import SamplingParams


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    req = Request(index=seq_id, prompt=None, prompt_token_ids=prompt, params=SamplingParams())
    return Sequence(seq_id, req, 0, list(prompt), None, stop=None)  # type: ignore[arg-type]


def _padded(seqs: list[Sequence]) -> list[list[int]]:
    width = max(len(s.block_table) for s in seqs)
    return [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_freshly_padded_tables(seed: int) -> None:
    rng = random.Random(seed)
    capacity, max_blocks = 6, 12
    rows = BlockTableRows(capacity, max_blocks)
    seqs = [_seq(i, [1]) for i in range(10)]
    for s in seqs:
        s.block_table = [rng.randrange(100)]
    for _ in range(300):
        s = rng.choice(seqs)
        op = rng.randrange(5)
        if op == 0 and len(s.block_table) < max_blocks:
            s.block_table.append(rng.randrange(100))  # the table grows in place
        elif op == 1:
            s.block_table[-1] = rng.randrange(100)  # copy-on-write of the last block
        elif op == 2:
            # Released and readmitted: a new list, perhaps shorter, perhaps equal in content.
            s.block_table = [rng.randrange(100) for _ in range(rng.randrange(1, max_blocks))]
        elif op == 3:
            rows.release(s)
        step = rng.sample(seqs, rng.randrange(1, capacity + 1))
        got = rows.rows(step)
        rows.check_integrity()
        assert len(set(got)) == len(got)
        width = max(len(x.block_table) for x in step)
        gathered = rows.buffer[:, :width].index_select(0, torch.tensor(got))
        assert gathered.tolist() == _padded(step)


def test_a_step_of_decodes_and_prefill_chunks() -> None:
    bs = 4
    builder = StepBuilder(capacity=4, max_blocks=8, block_size=bs, device=torch.device("cpu"))
    decode = _seq(0, [5, 6, 7, 8, 9])
    decode.token_ids.append(10)  # sampled last step; K/V of the 5 prompt tokens is computed
    decode.num_computed_tokens = 5
    decode.block_table = [3, 7]
    chunk = _seq(1, list(range(20, 30)))  # 10 prompt tokens: a chunk of 6, then 4
    chunk.block_table = [1, 2]
    chunk.num_computed_tokens = 0
    inputs = builder.build([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 6)])
    assert inputs.input_ids.tolist() == [10, 20, 21, 22, 23, 24, 25]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 3, 4, 5]
    # Position p of a sequence lives at block_table[p // bs] * bs + p % bs.
    assert inputs.meta.slot_mapping.tolist() == [7 * 4 + 1, 4, 5, 6, 7, 8, 9]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 7]
    assert inputs.meta.seq_lens.tolist() == [6, 6]
    assert inputs.meta.block_tables.tolist() == [[3, 7], [1, 2]]
    assert inputs.logits_indices.tolist() == [0]  # the chunk does not complete its prompt
    assert inputs.sample_seqs == [decode]
    assert inputs.meta.query_start_loc.dtype == torch.int32
    assert inputs.meta.block_tables.is_contiguous()

    chunk.num_computed_tokens = 6
    chunk.block_table.append(4)
    decode.num_computed_tokens = 6
    decode.token_ids.append(11)
    inputs = builder.build([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 4)])
    assert inputs.meta.block_tables.tolist() == [[3, 7, 0], [1, 2, 4]]
    assert inputs.logits_indices.tolist() == [0, 4]
    assert inputs.sample_seqs == [decode, chunk]
    builder.tables.check_integrity()
