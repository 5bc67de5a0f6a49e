"""Images through the API (issue #72), against HF transformers on a tiny random LLaVA with real
photographs: LLM.generate with vLLM's multi_modal_data, LLM.chat with image parts, the image's
content in the prefix cache's key, the vision tower run once per picture, bad images as the
prompt's error."""

from __future__ import annotations

import base64
import io

import pytest

from batchpage import LLM, SamplingParams
from tests.vision_factory import hf_llava_greedy, llava_folder, sample_images

MAX_NEW = 5
ROWS = 25  # placeholders per image: the tiny tower's 5 x 5 patches


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder, hf, image_token = llava_folder(tmp_path_factory.mktemp("llava"))
    return folder, hf, image_token


def make_llm(folder, **kw) -> LLM:
    # A small step budget: a prompt's image is split over several prefill chunks.
    args = dict(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=2**24, dtype="float32")
    return LLM(str(folder), **{**args, **kw})


def params() -> SamplingParams:
    # min_tokens as HF's min_new_tokens (hf_*_greedy): EOS masked in both until the end.
    return SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def expanded(llm: LLM, text: str, image_token: int) -> list[int]:
    """The prompt's ids with each <image> made ROWS placeholders, written here by hand."""
    ids = []
    for t in llm.tokenizer.encode(text):
        ids += [image_token] * ROWS if t == image_token else [t]
    return ids


def test_generate_with_images_equals_transformers(llava) -> None:
    folder, hf, image_token = llava
    llm = make_llm(folder)
    images = sample_images()
    prompts = [
        {"prompt": "<image>\nwhat is this", "multi_modal_data": {"image": images[0]}},
        {"prompt": "the cat <image> and", "multi_modal_data": {"image": [images[1]]}},
        {"prompt": "<image> or <image>?", "multi_modal_data": {"image": images[2:4]}},
        "no image here",
    ]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    texts = ["<image>\nwhat is this", "the cat <image> and", "<image> or <image>?"]
    for out, text, ims in zip(outs, texts, [images[:1], images[1:2], images[2:4]], strict=False):
        assert out.error is None
        ids = expanded(llm, text, image_token)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_llava_greedy(hf, ids, ims, MAX_NEW)
    plain = llm.tokenizer.encode("no image here")
    assert outs[3].outputs[0].token_ids == hf_llava_greedy(hf, plain, [], MAX_NEW)
    assert llm.stats["images_encoded"] == 4


def test_the_picture_is_in_the_cache_key(llava) -> None:
    """Equal placeholder tokens over two pictures: each output is HF's for its own picture and
    no K/V over the image is shared; the same picture again hits the cache and the tower's
    cached rows."""
    folder, hf, image_token = llava
    llm = make_llm(folder)
    a, b = sample_images()[:2]
    text = "<image>\ndescribe it"
    ids = expanded(llm, text, image_token)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, params())
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, params())
    assert first[0].outputs[0].token_ids == hf_llava_greedy(hf, ids, [a], MAX_NEW)
    assert other[0].outputs[0].token_ids == hf_llava_greedy(hf, ids, [b], MAX_NEW)
    # Only the tokens before the image could be shared (the block of BOS-free text before it).
    assert llm.stats["cached_prompt_tokens"] < llm.config.block_size
    assert llm.stats["images_encoded"] == 1
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": a.copy()}}, params())
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert llm.stats["cached_prompt_tokens"] >= len(ids) - llm.config.block_size
    assert llm.stats["images_encoded"] == 0  # every image position came from the cache


def test_questions_about_the_same_pictures_encode_each_once(llava) -> None:
    """K questions per image: the tower runs once per distinct picture, and prompts share the
    image's K/V."""
    folder, hf, image_token = llava
    llm = make_llm(folder, max_num_batched_tokens=64)
    images = sample_images()[:3]
    questions = ["what", "where", "why", "who"]
    prompts = [
        {"prompt": f"<image>\n{q}", "multi_modal_data": {"image": im}}
        for im in images
        for q in questions
    ]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    assert llm.stats["images_encoded"] == len(images)
    assert llm.stats["cached_prompt_tokens"] >= (len(questions) - 1) * len(images) * ROWS // 2
    for p, out in zip(prompts[::5], outs[::5], strict=True):  # a few against HF
        ids = expanded(llm, p["prompt"], image_token)
        im = p["multi_modal_data"]["image"]
        assert out.outputs[0].token_ids == hf_llava_greedy(hf, ids, [im], MAX_NEW)


def test_chat_image_parts_equal_the_prompt_with_images(llava, tmp_path) -> None:
    folder, _, _ = llava
    llm = make_llm(folder)
    photo = sample_images()[1]
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    photo.save(tmp_path / "cat.png")
    question = {"type": "text", "text": "what is it"}
    by_url = [{"type": "image_url", "image_url": {"url": data_url}}, question]
    by_path = [{"type": "image_url", "image_url": {"url": str(tmp_path / "cat.png")}}, question]
    chats = [[{"role": "user", "content": by_url}], [{"role": "user", "content": by_path}]]
    outs = llm.chat(chats, params(), use_tqdm=False)
    rendered = llm.tokenizer.render_chat_template(
        [{"role": "user", "content": [{"type": "image"}, question]}]
    )
    ref = llm.generate({"prompt": rendered, "multi_modal_data": {"image": photo}}, params())
    for out in outs:
        assert out.error is None
        assert out.prompt_token_ids == ref[0].prompt_token_ids
        assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_bad_images_are_their_prompts_errors(llava, tmp_path) -> None:
    folder, _, _ = llava
    llm = make_llm(folder, max_image_pixels=100 * 100)
    photo = sample_images()[3]  # 71 x 47: within the bound
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    prompts = [
        {"prompt": "<image> a", "multi_modal_data": {"image": str(tmp_path / "broken.png")}},
        {"prompt": "<image> b", "multi_modal_data": {"image": str(tmp_path / "missing.png")}},
        {"prompt": "<image> c", "multi_modal_data": {"image": sample_images()[0]}},  # 512 x 512
        {"prompt": "<image> d <image>", "multi_modal_data": {"image": photo}},
        {"prompt": "e", "multi_modal_data": {"video": photo}},
        {"prompt": "<image> f", "multi_modal_data": {"image": photo}},
    ]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    errors = [o.error for o in outs]
    assert "image 0" in errors[0]
    assert "image 0" in errors[1] and "missing.png" in errors[1]
    assert "max_image_pixels" in errors[2]
    assert "2 image placeholders" in errors[3] and "1 images" in errors[3]
    assert "images only" in errors[4]
    assert errors[5] is None and len(outs[5].outputs[0].token_ids) == MAX_NEW


def test_a_text_model_refuses_images(tiny_folder) -> None:
    llm = LLM(str(tiny_folder), kv_cache_memory=2**24)
    out = llm.generate(
        {"prompt": "hi", "multi_modal_data": {"image": sample_images()[0]}}, params()
    )
    assert "takes none" in out[0].error
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    assert "takes no images" in llm.chat([chat], params())[0].error


def test_tensor_parallel_vision_is_refused_before_loading(llava) -> None:
    folder, _, _ = llava
    with pytest.raises(ValueError, match="vision-language model runs on one device"):
        LLM(str(folder), tensor_parallel_size=2, kv_cache_memory=2**24)


def test_rows_on_disk_spare_the_tower_across_runs(llava, tmp_path) -> None:
    """A second engine with the same encoder_cache_dir (a rerun, a resumed job) encodes no
    picture the first did, and gives the same tokens; another tower never reads those rows;
    a damaged file is encoded again."""
    folder, hf, image_token = llava
    cache = tmp_path / "encoder"
    images = sample_images()[:2]
    prompts = [{"prompt": "<image> what", "multi_modal_data": {"image": im}} for im in images]
    first = make_llm(folder, encoder_cache_dir=str(cache))
    outs = first.generate(prompts, params(), use_tqdm=False)
    assert first.stats["images_encoded"] == 2 and first.stats["encoder_disk_hits"] == 0
    files = sorted(cache.rglob("*.safetensors"))
    assert len(files) == 2
    again = make_llm(folder, encoder_cache_dir=str(cache))
    outs2 = again.generate(prompts, params(), use_tqdm=False)
    assert again.stats["images_encoded"] == 0 and again.stats["encoder_disk_hits"] == 2
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    ids = expanded(again, "<image> what", image_token)
    assert outs2[1].outputs[0].token_ids == hf_llava_greedy(hf, ids, images[1:], MAX_NEW)
    other_folder, _, _ = llava_folder(tmp_path / "other", seed=1)
    other = make_llm(other_folder, encoder_cache_dir=str(cache))
    other.generate(prompts, params(), use_tqdm=False)
    assert other.stats["images_encoded"] == 2 and other.stats["encoder_disk_hits"] == 0
    files[0].write_bytes(b"not safetensors")
    third = make_llm(folder, encoder_cache_dir=str(cache))
    outs3 = third.generate(prompts, params(), use_tqdm=False)
    assert third.stats["images_encoded"] == 1 and third.stats["encoder_disk_hits"] == 1
    assert [o.outputs[0].token_ids for o in outs3] == [o.outputs[0].token_ids for o in outs]


def test_multi_modal_uuids_name_the_pictures(llava) -> None:
    """vLLM's multi_modal_uuids: a uuid stands for its picture in the cache (its pixels are not
    hashed), so the same uuid shares K/V and encoder rows; other uuids for the same picture do
    not; a wrong count is the prompt's error."""
    folder, hf, image_token = llava
    llm = make_llm(folder)
    photo = sample_images()[0]

    def prompt(uuid):
        return {"prompt": "<image> a", "multi_modal_data": {"image": photo},
                "multi_modal_uuids": {"image": [uuid]}}  # fmt: skip

    first = llm.generate(prompt("photo-1"), params())
    ids = expanded(llm, "<image> a", image_token)
    assert first[0].outputs[0].token_ids == hf_llava_greedy(hf, ids, [photo], MAX_NEW)
    again = llm.generate(prompt("photo-1"), params())
    assert llm.stats["cached_prompt_tokens"] >= llm.config.block_size
    assert llm.stats["images_encoded"] == 0 and llm.stats["encoder_cache_hits"] == 1
    other = llm.generate(prompt("photo-2"), params())
    assert llm.stats["images_encoded"] == 1
    assert again[0].outputs[0].token_ids == other[0].outputs[0].token_ids
    bad = {"prompt": "<image> a", "multi_modal_data": {"image": photo},
           "multi_modal_uuids": {"image": ["x", "y"]}}  # fmt: skip
    assert "one str (or None) per image" in llm.generate(bad, params())[0].error
