"""M-RoPE positions in the step builder (engine/mrope_steps.py): prompts with and without images,
computed in random chunks, then decoded, then recomputed from the start as after a preemption:
every token's [3] positions are its prompt's 3-D positions inside the prompt and p + delta past
it, whichever step computes it (a brute-force walk)."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import KVCacheManager
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.step_inputs import StepBuilder
from batchpage.engine.stop_checker import StopChecker
from batchpage.model.image_prompt import PromptImage
from batchpage.model.mrope import prompt_positions
from batchpage.sampling_params import SamplingParams

PLACEHOLDER = 7
MERGE = 2


def image(name: str, first: int, h: int, w: int) -> PromptImage:
    """An image of h x w merged rows (a grid of 2h x 2w patches) from prompt position `first`."""
    grid = torch.tensor([[1, MERGE * h, MERGE * w]])
    digest = hashlib.sha256(name.encode()).digest()
    return PromptImage(digest, {"image_grid_thw": grid}, tuple(range(first, first + h * w)))


def random_seq(rng: random.Random, seq_id: int) -> Sequence:
    tokens: list[int] = []
    images = []
    for j in range(rng.randrange(0, 3)):
        tokens += [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        h, w = rng.randrange(1, 4), rng.randrange(1, 4)
        images.append(image(f"{seq_id}-{j}", len(tokens), h, w))
        tokens += [PLACEHOLDER] * (h * w)
    tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
    params = SamplingParams(max_tokens=8)
    req = Request(seq_id, None, list(tokens), params, images=tuple(images))
    if images:
        req.mrope = prompt_positions(len(tokens), req.images, MERGE)
    stop = StopChecker(lambda ids: "", params, prompt_len=len(tokens))
    return Sequence(seq_id, req, 0, list(tokens), 0, stop=stop)


def expected(seq: Sequence, p: int) -> list[int]:
    mrope = seq.request.mrope
    if mrope is None:
        return [p] * 3
    if p < seq.num_prompt_tokens:
        return mrope.positions[:, p].tolist()
    return [p + mrope.delta] * 3


@pytest.mark.parametrize("seed", range(6))
def test_each_token_gets_its_positions_whichever_step_computes_it(seed: int) -> None:
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(num_blocks=128, block_size=bs, prefix_caching=False)
    batch = InputBatch(4, max_blocks=32)
    builder = StepBuilder(batch, block_size=bs, device=torch.device("cpu"), mrope=True)
    seqs = [random_seq(rng, i) for i in range(4)]
    assert any(s.request.mrope is not None for s in seqs)
    for s in seqs:
        batch.join(s)

    def run_until(target: dict[int, int]) -> None:
        """Steps of random chunks until each sequence has target[seq_id] tokens computed."""
        while True:
            todo = [s for s in seqs if s.num_computed_tokens < target[s.seq_id]]
            if not todo:
                return
            num_new = [rng.randrange(1, target[s.seq_id] - s.num_computed_tokens + 1) for s in todo]
            for s, n in zip(todo, num_new, strict=True):
                kv.allocate(s, n)
            batch.refresh_tables(kv.take_changed())
            rows = np.array([s.row for s in todo], dtype=np.int64)
            inputs = builder.build(rows, np.array(num_new, dtype=np.int64))
            assert inputs.positions.shape == (3, sum(num_new))
            want = [
                expected(s, p)
                for s, n in zip(todo, num_new, strict=True)
                for p in range(s.num_computed_tokens, s.num_computed_tokens + n)
            ]
            assert inputs.positions.T.tolist() == want
            batch.advance(inputs.rows, inputs.num_new)
            batch.check_integrity()

    run_until({s.seq_id: s.num_prompt_tokens for s in seqs})  # the prompts, chunk by chunk
    for _ in range(3):  # a few generated tokens, one a step
        rows = np.array([s.row for s in seqs], dtype=np.int64)
        batch.append_tokens(rows, [rng.randrange(50) for _ in seqs])
        run_until({s.seq_id: s.num_tokens for s in seqs})
    for s in seqs:  # recomputed from the start, prompt and generated tokens alike
        batch.leave(s)
        kv.free(s)
        s.num_computed_tokens = 0
        batch.join(s)
    run_until({s.seq_id: s.num_tokens for s in seqs})


def test_text_only_models_keep_one_dimensional_positions() -> None:
    batch = InputBatch(2, max_blocks=4)
    seq = random_seq(random.Random(1), 0)
    kv = KVCacheManager(num_blocks=16, block_size=4, prefix_caching=False)
    batch.join(seq)
    kv.allocate(seq, seq.num_prompt_tokens)
    batch.refresh_tables(kv.take_changed())
    builder = StepBuilder(batch, block_size=4, device=torch.device("cpu"))
    inputs = builder.build(np.array([seq.row]), np.array([seq.num_prompt_tokens]))
    assert inputs.positions.tolist() == list(range(seq.num_prompt_tokens))
