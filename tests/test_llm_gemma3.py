"""Images through the API on a tiny random Gemma 3 (issue #72), against HF transformers with real
photographs: LLM.generate's prompt ids are HF Gemma3Processor's, its greedy tokens HF generate's
(token_type_ids: image rows attend both ways) and its logprobs HF's logits; with a sliding window
shorter than the prompt and than an image's span, two images in a prompt, a step budget that
would end chunks inside spans, a prefix-cache hit that ends inside a span; LLM.chat with an
image part is HF's processor's chat."""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, SamplingParams
from tests.gemma3_vl_factory import (
    TOKENS_PER_IMAGE,
    gemma3_vl_folder,
    hf_gemma3_greedy,
    hf_processor,
)
from tests.vision_factory import sample_images

MAX_NEW = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, HF model, HF's Gemma3Processor)."""
    folder, hf, tok = gemma3_vl_folder(tmp_path_factory.mktemp("gemma3_vl"))
    return folder, hf, hf_processor(tok)


def make_llm(folder, **kw) -> LLM:
    # A step budget below an image's span (16 rows): chunks would end inside spans.
    args = dict(max_num_batched_tokens=12, max_num_seqs=8, kv_cache_memory=2**24, dtype="float32")
    return LLM(str(folder), **{**args, **kw})


def params(logprobs: int | None = None) -> SamplingParams:
    # min_tokens as HF's min_new_tokens (hf_gemma3_greedy): EOS masked in both until the end
    # (with ignore_eos min_tokens would not mask it, as in vLLM).
    return SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, logprobs=logprobs)


@torch.no_grad()
def hf_logprobs(hf, inputs: dict, tokens: list[int]) -> torch.Tensor:
    """HF's log-softmax over each generated position, the prompt then `tokens` in one forward
    (token_type_ids extended with text)."""
    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
    types = torch.cat([inputs["token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.long)], 1)
    extra = {"pixel_values": inputs["pixel_values"]} if "pixel_values" in inputs else {}
    logits = hf(input_ids=ids, token_type_ids=types, **extra).logits[0].float()
    n = inputs["input_ids"].shape[1]
    return logits[n - 1 : n - 1 + len(tokens)].log_softmax(-1)


def check_against_hf(hf, processor, out, text: str, images: list) -> None:
    """out's prompt ids are HF's processor's, its tokens HF's greedy ones, its logprobs HF's."""
    inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
    assert out.error is None
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    tokens = out.outputs[0].token_ids
    assert tokens == hf_gemma3_greedy(hf, inputs, MAX_NEW)
    want = hf_logprobs(hf, inputs, tokens)
    for step, top in enumerate(out.outputs[0].logprobs):
        for token, logprob in top.items():
            assert abs(logprob - want[step, token].item()) < ATOL, (text, step, token)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_generate_with_images_equals_transformers(gemma3, backend: str) -> None:
    folder, hf, processor = gemma3
    llm = make_llm(folder, attention_backend=backend)
    photos = sample_images()
    cases = [
        ("Describe\n<start_of_image>in a word", photos[:1]),
        ("the cat <start_of_image> and", photos[1:2]),
        ("<start_of_image> or <start_of_image>? which is older", photos[2:4]),
    ]
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases]
    outs = llm.generate([*prompts, "no image here"], params(logprobs=3), use_tqdm=False)
    for out, (text, images) in zip(outs, cases, strict=False):
        assert len(out.prompt_token_ids) > 8 + TOKENS_PER_IMAGE  # past the window (8)
        check_against_hf(hf, processor, out, text, images)
    check_against_hf(hf, processor, outs[3], "no image here", [])
    assert llm.stats["images_encoded"] == 4


def test_the_same_image_again_hits_the_cache_inside_its_span(gemma3) -> None:
    """A second question about a picture: the prefix cache lends blocks that end inside the
    picture's span (block size 16, the span at 11..27), the chunk after the hit runs to the
    span's end, the tower runs once, and both answers are HF's."""
    folder, hf, processor = gemma3
    llm = make_llm(folder, block_size=16)
    photo = sample_images()[1]
    texts = ["What:\n<start_of_image>\nis it?", "What:\n<start_of_image>\ncolour?"]
    first = llm.generate({"prompt": texts[0], "multi_modal_data": {"image": photo}}, params(3))
    check_against_hf(hf, processor, first[0], texts[0], [photo])
    second = llm.generate({"prompt": texts[1], "multi_modal_data": {"image": photo}}, params(3))
    check_against_hf(hf, processor, second[0], texts[1], [photo])
    ids = second[0].prompt_token_ids
    soft = [i for i, t in enumerate(ids) if t == hf.config.image_token_id]
    cached = llm.stats["cached_prompt_tokens"]
    assert soft[0] < cached <= soft[-1], (cached, soft[0], soft[-1])
    assert llm.stats["images_encoded"] == 0  # the tower's rows of the first call, kept


def test_chat_image_parts_equal_transformers_chat(gemma3, tmp_path) -> None:
    folder, hf, processor = gemma3
    llm = make_llm(folder)
    photo = sample_images()[0]
    photo.save(tmp_path / "astronaut.png")
    question = {"type": "text", "text": "who is this?"}
    part = {"type": "image_url", "image_url": {"url": str(tmp_path / "astronaut.png")}}
    outs = llm.chat([{"role": "user", "content": [part, question]}], params(3), use_tqdm=False)
    messages = [{"role": "user", "content": [{"type": "image", "image": photo}, question]}]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True,
        return_tensors="pt",
    )  # fmt: skip
    assert outs[0].error is None
    assert outs[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    tokens = outs[0].outputs[0].token_ids
    assert tokens == hf_gemma3_greedy(hf, dict(inputs), MAX_NEW)
    want = hf_logprobs(hf, dict(inputs), tokens)
    for step, top in enumerate(outs[0].outputs[0].logprobs):
        for token, logprob in top.items():
            assert abs(logprob - want[step, token].item()) < ATOL
