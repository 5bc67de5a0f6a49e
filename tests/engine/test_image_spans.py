"""Image spans kept whole (engine/image_spans.py), against brute-force checks: the chunk rule
alone, the scheduler's chunks over random prompts with images (budgets that end inside spans,
prefix-cache hits that end inside them, beams), and the step's key_end and span sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchpage.engine.image_spans import span_key_ends, whole_spans
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import KVCacheManager
from batchpage.engine.scheduler import Scheduler
from batchpage.engine.step_inputs import StepBuilder
from tests.engine.test_image_rows import PLACEHOLDER, image, seq_of


def inside(p: int, spans: list[tuple[int, int]]) -> bool:
    """Whether a chunk ending at p (exclusive) ends strictly inside a span [a, b)."""
    return any(a < p < b for a, b in spans)


def brute_chunk(start: int, take: int, spans: list[tuple[int, int]]) -> int:
    """The longest chunk from start of at most `take` tokens that ends outside every span, else
    the shortest longer one."""
    ends = [e for e in range(start + 1, start + take + 1) if not inside(e, spans)]
    if ends:
        return max(ends) - start
    end = start + take
    while inside(end, spans):
        end += 1
    return end - start


def random_prompt(rng: random.Random, name: str):
    """Tokens and their images at random places (spans of 1 to 9 rows, some back to back)."""
    tokens, images = [rng.randrange(50)], []
    for j in range(rng.randrange(0, 4)):
        n = rng.randrange(1, 10)
        images.append(image(f"{name}-{j}-{n}", list(range(len(tokens), len(tokens) + n))))
        tokens += [PLACEHOLDER] * n + [rng.randrange(50) for _ in range(rng.randrange(0, 3))]
    tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
    return tokens, tuple(images)


def spans_of(seq) -> list[tuple[int, int]]:
    return [(im.positions[0], im.positions[-1] + 1) for im in seq.request.images]


@pytest.mark.parametrize("seed", range(4))
def test_a_chunk_is_cut_back_or_runs_to_the_span_end_as_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(200):
        tokens, images = random_prompt(rng, f"{seed}-{i}")
        seq = seq_of(i, tokens, images)
        start = rng.randrange(len(tokens))
        take = rng.randrange(1, len(tokens) - start + 1)
        assert whole_spans(seq, start, take) == brute_chunk(start, take, spans_of(seq))
        assert whole_spans(seq, start, 0) == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "causal"])
def test_no_chunk_ends_inside_a_span(seed: int, whole: bool) -> None:
    """Prompts with images through the scheduler, small budgets and block sizes, a prefix cache
    (prompts share pictures and text, so hits end inside spans): with whole_image_spans no
    chunk ends inside a span and a chunk passes the budget only to finish the span it starts
    in or at; every prompt ends. Without, some chunk ends inside one (the check bites)."""
    rng = random.Random(seed)
    budget = rng.randrange(3, 9)
    kv = KVCacheManager(num_blocks=256, block_size=rng.choice([2, 4]), prefix_caching=True)
    sched = Scheduler(kv, 4, budget, whole_image_spans=whole)
    shared = random_prompt(rng, f"{seed}-shared")
    seqs = []
    for i in range(10):
        if rng.random() < 0.5:
            tokens, images = shared
            tokens = tokens + [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
        else:
            tokens, images = random_prompt(rng, f"{seed}-{i}")
        seqs.append(seq_of(i, tokens, images))
    sched.add_batch(seqs)
    ended_inside = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.scheduled, "no progress"
        for s in out.scheduled:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            spans = spans_of(s.seq)
            ended_inside += inside(start + n, spans)
            if whole:
                assert not inside(start + n, spans)
                if n > budget:
                    assert any(a <= start < b == start + n for a, b in spans), (start, n, spans)
        sampling = [s.seq for s in out.scheduled if s.completes_prefill]
        sched.update_from_output(out)
        for seq in sampling:
            seq.append_token(1)
            sched.finish(seq)
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert (ended_inside == 0) == whole


@pytest.mark.parametrize("seed", range(6))
def test_key_end_is_the_span_end_of_span_rows(seed: int) -> None:
    """Prompts computed in chunks that end outside spans (some starting inside one, as after a
    prefix hit): each step row's key_end is its span's end inside a span and its position + 1
    elsewhere, and the span sequences are those with a row that sees past itself."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(num_blocks=128, block_size=bs, prefix_caching=False)
    batch = InputBatch(4, max_blocks=16)
    builder = StepBuilder(batch, block_size=bs, device=torch.device("cpu"), image_spans=True)
    seqs = []
    for i in range(3):
        tokens, images = random_prompt(rng, f"{seed}-{i}")
        seq = seq_of(i, tokens, images)
        batch.join(seq)
        # a prefix hit inside a span: the rows before it count as computed
        hit = rng.choice([0, *(a + 1 for a, b in spans_of(seq) if b - a > 1)])
        if hit:
            kv.allocate(seq, hit)
            seq.num_computed_tokens = hit
        seqs.append(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        todo = [s for s in seqs if s.num_computed_tokens < s.num_prompt_tokens]
        num_new = []
        for s in todo:
            start = s.num_computed_tokens
            take = rng.randrange(1, s.num_prompt_tokens - start + 1)
            num_new.append(whole_spans(s, start, take))
            kv.allocate(s, num_new[-1])
        batch.refresh_tables(kv.take_changed())
        rows = np.array([s.row for s in todo], dtype=np.int64)
        inputs = builder.build(rows, np.array(num_new, dtype=np.int64))
        want, wide = [], []
        for b, (s, n) in enumerate(zip(todo, num_new, strict=True)):
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                want.append(next((e for a, e in spans_of(s) if a <= p < e), p + 1))
                if want[-1] > p + 1 and b not in wide:
                    wide.append(b)
        meta = inputs.meta
        if wide:
            assert meta.key_end is not None and meta.key_end.dtype == torch.int32
            assert meta.key_end.tolist() == want
        else:
            assert meta.key_end is None
        assert meta.span_seqs == tuple(wide)
        batch.advance(inputs.rows, inputs.num_new)
        batch.check_integrity()


def test_a_chunk_ending_inside_a_span_is_refused() -> None:
    seq = seq_of(0, [1, *[PLACEHOLDER] * 5, 2], (image("cat", [1, 2, 3, 4, 5]),))
    batch = InputBatch(1, max_blocks=4)
    batch.join(seq)
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=False)
    kv.allocate(seq, 4)
    batch.refresh_tables(kv.take_changed())
    builder = StepBuilder(batch, block_size=4, device=torch.device("cpu"), image_spans=True)
    with pytest.raises(RuntimeError, match="inside an image span"):
        builder.build(np.array([seq.row]), np.array([4]))
    causal = StepBuilder(batch, block_size=4, device=torch.device("cpu"))
    assert causal.build(np.array([seq.row]), np.array([4])).meta.key_end is None
    ends, seqs = span_key_ends((), np.arange(3), np.full(3, 3), np.array([0, 3]))
    assert ends is None and seqs == ()
