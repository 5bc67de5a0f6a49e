"""Images in the engine's own parts, against brute-force models: the prefix cache's key over image
positions (engine/kv_manager.tree_key), the rows each step gives the forward (step_inputs's
image slices, chunk by chunk), and the encoder cache's reuse and budget (engine/encoder_cache)."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from batchpage.engine.encoder_cache import EncoderCache
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import KVCacheManager, tree_key
from batchpage.engine.scheduler import Scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.step_inputs import ImageSlice, StepBuilder
from batchpage.engine.stop_checker import StopChecker
from batchpage.lora.request import LoRARequest
from batchpage.metrics import RunStats
from batchpage.model.image_prompt import IMAGE_KEY_BIT, PromptImage
from batchpage.sampling_params import SamplingParams

HIDDEN = 4
PLACEHOLDER = 7


def image(name: str, positions: list[int]) -> PromptImage:
    """An image whose digest is its name's hash, at `positions` of its prompt."""
    digest = hashlib.sha256(name.encode()).digest()
    return PromptImage(digest, {"pixel_values": torch.tensor([float(len(name))])}, tuple(positions))


def seq_of(seq_id: int, tokens: list[int], images: tuple[PromptImage, ...] = (), lora=None):
    params = SamplingParams(max_tokens=4)
    req = Request(seq_id, None, list(tokens), params, lora=lora, images=images)
    stop = StopChecker(lambda ids: "", params, prompt_len=len(tokens))
    return Sequence(seq_id, req, 0, list(tokens), 0, stop=stop)


def test_the_key_of_image_positions_is_the_images_content() -> None:
    tokens = [1, 2, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 3, PLACEHOLDER, 4]
    cat, dog = image("cat", [2, 3, 4]), image("dog", [6])
    a = seq_of(0, tokens, (cat, dog))
    b = seq_of(1, tokens, (image("cat", [2, 3, 4]), image("fox", [6])))
    plain = seq_of(2, tokens)
    assert tree_key(plain, 8) == tokens
    key = tree_key(a, 8)
    assert key == [1, 2, cat.key, cat.key, cat.key, 3, dog.key, 4]
    assert all(k >= IMAGE_KEY_BIT for k in key[2:5])
    assert tree_key(b, 6) == key[:6]  # the same picture: the same key
    assert tree_key(b, 8) != key  # another picture at position 6
    assert tree_key(a, 3) == [1, 2, cat.key]
    lora = LoRARequest("x", 3, "/none")
    with_lora = seq_of(3, tokens, (cat, dog), lora=lora)
    assert tree_key(with_lora, 8) == [k + (3 << 32) for k in key]


def test_equal_placeholders_over_other_images_share_no_blocks() -> None:
    """The radix tree lends a prompt only the blocks computed over its own pictures."""
    bs = 2
    kv = KVCacheManager(num_blocks=32, block_size=bs, prefix_caching=True)
    tokens = [1, 2, 3, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 5, 6, 8, 9]
    first = seq_of(0, tokens, (image("cat", [3, 4, 5, 6]),))
    kv.allocate(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    kv.free(first)
    same = seq_of(1, tokens, (image("cat", [3, 4, 5, 6]),))
    other = seq_of(2, tokens, (image("dog", [3, 4, 5, 6]),))
    assert kv.lend_prefix(same) == 10  # all but the last token, whose logits are needed
    assert kv.lend_prefix(other) == 2  # the block before the image only
    kv.check_integrity([same, other])


def test_prompts_about_the_same_picture_queue_together() -> None:
    """The prefix order sorts by the cache's key: questions behind equal placeholders group
    by picture (a brute-force check: every picture's prompts are adjacent, text prompts too)."""
    rng = random.Random(3)
    kv = KVCacheManager(num_blocks=64, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = []
    for i in range(24):
        picture = rng.choice(["cat", "dog", "fox", None])
        question = [rng.randrange(50) for _ in range(3)]
        if picture is None:
            seqs.append(seq_of(i, [1, 2, 3, *question]))
        else:
            images = (image(picture, [1, 2, 3]),)
            seqs.append(seq_of(i, [1, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, *question], images))
    sched.add_batch(seqs)
    order = [s.request.images[0].digest if s.request.images else None for s in sched.waiting]
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert len(runs) == len(set(order)), order


@pytest.mark.parametrize("seed", range(6))
def test_a_step_starts_at_most_its_budget_of_the_towers_work(seed: int) -> None:
    """Prompts with images through the scheduler, with an encoder cache that keeps every image
    it encoded: each step's new images (overlapping its chunks, not held) total at most the
    token budget in rows, or are one image; every image is encoded once; every prompt ends."""
    rng = random.Random(seed)
    held: set[bytes] = set()
    budget = 12
    kv = KVCacheManager(num_blocks=256, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, 4, budget, encoder_holds=held.__contains__)
    pictures = {f"{seed}-{k}": rng.randrange(2, 16) for k in range(5)}
    seqs = []
    for i in range(8):
        tokens, images = [rng.randrange(50)], []
        for name in rng.sample(sorted(pictures), rng.randrange(0, 3)):
            n = pictures[name]
            images.append(image(name, list(range(len(tokens), len(tokens) + n))))
            tokens += [PLACEHOLDER] * n + [rng.randrange(50) for _ in range(rng.randrange(0, 3))]
        seqs.append(seq_of(i, tokens, tuple(images)))
    sched.add_batch(seqs)
    encoded: list[bytes] = []
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.scheduled, "no progress"
        new: dict[bytes, int] = {}
        for s in out.scheduled:
            a, b = s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens
            for im in s.seq.request.images:
                if im.positions[0] < b and im.positions[-1] >= a and im.digest not in held:
                    new[im.digest] = len(im.positions)
        assert len(new) <= 1 or sum(new.values()) <= budget, new
        encoded += new
        held.update(new)
        sampling = [s.seq for s in out.scheduled if s.completes_prefill]
        sched.update_from_output(out)
        for seq in sampling:
            seq.append_token(1)
            sched.finish(seq)
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert sorted(encoded) == sorted({im.digest for s in seqs for im in s.request.images})


@pytest.mark.parametrize("seed", range(6))
def test_each_image_position_gets_its_row_once_over_the_chunks(seed: int) -> None:
    """Prompts with images computed in random chunks: every image position is given its
    image's row exactly once, at the step row of that position (a brute-force walk)."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(num_blocks=64, block_size=bs, prefix_caching=False)
    batch = InputBatch(4, max_blocks=16)
    builder = StepBuilder(batch, block_size=bs, device=torch.device("cpu"))
    seqs = []
    for i in range(3):
        tokens, images = [], []
        for j in range(rng.randrange(0, 3)):
            tokens += [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
            n = rng.randrange(1, 6)
            images.append(image(f"{seed}-{i}-{j}", list(range(len(tokens), len(tokens) + n))))
            tokens += [PLACEHOLDER] * n
        tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
        seq = seq_of(i, tokens, tuple(images))
        batch.join(seq)
        seqs.append(seq)
    given: dict[tuple[bytes, int], int] = {}  # (image, its row) -> prompt position given at
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        todo = [s for s in seqs if s.num_computed_tokens < s.num_prompt_tokens]
        num_new = [rng.randrange(1, s.num_prompt_tokens - s.num_computed_tokens + 1) for s in todo]
        for s, n in zip(todo, num_new, strict=True):
            kv.allocate(s, n)
        batch.refresh_tables(kv.take_changed())
        rows = np.array([s.row for s in todo], dtype=np.int64)
        inputs = builder.build(rows, np.array(num_new, dtype=np.int64))
        # The brute-force step rows: entry i's positions a..a+n-1 at rows start_i..
        step_row = {}
        at = 0
        for s, n in zip(todo, num_new, strict=True):
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                step_row[at] = (s, p)
                at += 1
        for piece in inputs.images:
            for r, t in zip(piece.rows.tolist(), piece.tokens.tolist(), strict=True):
                s, p = step_row[t]
                assert piece.image in s.request.images
                assert piece.image.positions[r] == p
                assert (piece.image.digest, r) not in given
                given[(piece.image.digest, r)] = p
        batch.advance(inputs.rows, inputs.num_new)
        batch.check_integrity()
    expected = {(im.digest, r): p for s in seqs for im in s.request.images
                for r, p in enumerate(im.positions)}  # fmt: skip
    assert given == expected


def test_the_encoder_runs_once_per_image_while_its_rows_fit() -> None:
    """Random steps' image slices against a brute-force LRU of digests: the same images
    encoded, the same hits, every row the one the tower gave, one tower call a step."""
    rng = random.Random(0)
    sizes = {f"im{i}": rng.randrange(1, 5) for i in range(8)}
    images = {name: image(name, list(range(n))) for name, n in sizes.items()}
    of_input = {id(im.inputs["pixel_values"]): im for im in images.values()}
    calls: list[list[PromptImage]] = []

    def encode(inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        batch = [of_input[id(x["pixel_values"])] for x in inputs]  # on CPU .to() is the tensor
        calls.append(batch)
        return [encoded_rows(im) for im in batch]

    budget = 6 * HIDDEN * 4  # six rows of float32
    cache = EncoderCache(encode, budget, torch.device("cpu"))
    stats = RunStats(1, 1)
    lru: OrderedDict[bytes, int] = OrderedDict()
    encoded = hits = 0
    for _ in range(60):
        names = rng.sample(sorted(sizes), rng.randrange(1, 4))
        names += rng.sample(names, 1)  # an image used twice in a step (two prompts)
        slices = []
        for name in names:
            im = images[name]
            rows = sorted(rng.sample(range(sizes[name]), rng.randrange(1, sizes[name] + 1)))
            at = np.arange(len(rows)) + 10 * len(slices)
            slices.append(ImageSlice(im, np.array(rows), at))
        calls.clear()
        embeds = cache.embeds(slices, stats)
        distinct = list(dict.fromkeys(names))
        hits += sum(images[n].digest in lru for n in distinct)
        missing = [n for n in distinct if images[n].digest not in lru]
        for n in distinct:
            if images[n].digest in lru:
                lru.move_to_end(images[n].digest)
        assert [[im.digest for im in c] for c in calls] == (
            [[images[n].digest for n in missing]] if missing else []
        )
        encoded += len(missing)
        for n in missing:
            size = sizes[n] * HIDDEN * 4
            if size <= budget:
                while sum(lru.values()) + size > budget:
                    lru.popitem(last=False)
                lru[images[n].digest] = size
        assert (stats.images_encoded, stats.encoder_cache_hits) == (encoded, hits)
        want = torch.cat([encoded_rows(s.image)[torch.from_numpy(s.rows)] for s in slices])
        assert torch.equal(embeds.rows, want)
        assert embeds.index.tolist() == np.concatenate([s.tokens for s in slices]).tolist()
        cache.check_integrity()
        assert len(cache) == len(lru)
    assert hits > 0 and encoded > 8


def encoded_rows(im: PromptImage) -> torch.Tensor:
    """What the stand-in tower gives: row r of image im is [its first digest byte, r, r, r]."""
    r = torch.arange(len(im.positions), dtype=torch.float32)
    return torch.stack([torch.full_like(r, im.digest[0]), r, r, r], dim=1)
