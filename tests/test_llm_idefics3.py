"""Images through the API on tiny random Idefics3 and SmolVLM checkpoints (issue #72), against HF
transformers with real photographs split into tiles: LLM.generate's prompt ids are HF
Idefics3Processor's and its greedy tokens HF generate's; K questions about one picture encode it
once; chat image parts equal the prompt with images."""

from __future__ import annotations

import pytest
from transformers import Idefics3Processor

from batchpage import LLM, SamplingParams
from tests.vision_factory import (
    IDEFICS3_TILE_TOKENS,
    hf_idefics3_greedy,
    idefics3_folder,
    idefics3_processor,
    sample_images,
)

MAX_NEW = 5


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def idefics3(request, tmp_path_factory):
    """(folder, HF model, tokenizer, HF's processor for the prompt ids)."""
    folder, hf, tok = idefics3_folder(tmp_path_factory.mktemp(request.param), request.param)
    # SmolVLM's processor writes the same text (tests/model/test_idefics3.py) but needs
    # num2words; Idefics3's, with the same image processing numbers, stands in for it.
    reference = Idefics3Processor(idefics3_processor(), tok, image_seq_len=IDEFICS3_TILE_TOKENS)
    return folder, hf, tok, reference


def make_llm(folder, **kw) -> LLM:
    # A small step budget: an image's tiles are split over several prefill chunks.
    args = dict(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=2**24, dtype="float32")
    return LLM(str(folder), **{**args, **kw})


def params() -> SamplingParams:
    # min_tokens as HF's min_new_tokens (hf_*_greedy): EOS masked in both until the end.
    return SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def test_generate_with_images_equals_transformers(idefics3) -> None:
    folder, hf, _, reference = idefics3
    llm = make_llm(folder)
    images = sample_images()
    cases = [
        ("<image>\nwhat is this", images[:1]),
        ("the cat <image> and", images[1:2]),
        ("<image> or <image>?", images[2:4]),
    ]
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases]
    outs = llm.generate([*prompts, "no image here"], params(), use_tqdm=False)
    for out, (text, ims) in zip(outs, cases, strict=False):
        assert out.error is None
        ids = reference(text=text, images=[ims])["input_ids"][0]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_idefics3_greedy(hf, ids, ims, MAX_NEW)
    plain = llm.tokenizer.encode("no image here")
    assert outs[3].outputs[0].token_ids == hf_idefics3_greedy(hf, plain, [], MAX_NEW)
    assert llm.stats["images_encoded"] == 4


def test_questions_about_the_same_picture_encode_it_once(idefics3) -> None:
    """K questions per picture: the tower runs once per distinct picture, the prompts share
    the picture's K/V, and the answers are HF's."""
    folder, hf, _, reference = idefics3
    llm = make_llm(folder, max_num_batched_tokens=64)
    images = sample_images()[:2]
    questions = ["what", "where", "why"]
    prompts = [
        {"prompt": f"<image>\n{q}", "multi_modal_data": {"image": im}}
        for im in images
        for q in questions
    ]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    assert llm.stats["images_encoded"] == len(images)
    image_tokens = sum(len(o.prompt_token_ids) for o in outs[::3])  # one prompt per picture
    assert llm.stats["cached_prompt_tokens"] >= (len(questions) - 1) * image_tokens // 2
    for p, out in zip(prompts[::4], outs[::4], strict=True):
        im = p["multi_modal_data"]["image"]
        ids = reference(text=p["prompt"], images=[[im]])["input_ids"][0]
        assert out.outputs[0].token_ids == hf_idefics3_greedy(hf, ids, [im], MAX_NEW)


def test_chat_image_parts_equal_the_prompt_with_images(idefics3, tmp_path) -> None:
    folder, _, _, _ = idefics3
    llm = make_llm(folder)
    photo = sample_images()[1]
    photo.save(tmp_path / "cat.png")
    question = {"type": "text", "text": "what is it"}
    part = {"type": "image_url", "image_url": {"url": str(tmp_path / "cat.png")}}
    outs = llm.chat([[{"role": "user", "content": [part, question]}]], params(), use_tqdm=False)
    rendered = llm.tokenizer.render_chat_template(
        [{"role": "user", "content": [{"type": "image"}, question]}]
    )
    ref = llm.generate({"prompt": rendered, "multi_modal_data": {"image": photo}}, params())
    assert outs[0].error is None and ref[0].error is None
    assert outs[0].prompt_token_ids == ref[0].prompt_token_ids
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
