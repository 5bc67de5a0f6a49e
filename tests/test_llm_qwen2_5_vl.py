"""Images through the API on a tiny random Qwen2.5-VL (issue #72), against HF transformers with
real photographs of several sizes: LLM.generate's prompt ids are HF's processor's and its greedy
tokens and their logprobs HF generate's, with M-RoPE positions through chunked prefills, text
after the images (the rope delta), prefix-cache hits on the same picture, preemption and
recomputation, and speculative drafts; chat image parts equal the prompt with images; the
padded decode step (what CUDA graphs replay) takes the 3-D positions."""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.engine.decode_graphs import DecodeGraphs, ladder
from batchpage.ops.onednn_linear import onednn_packs
from tests.engine.speculation import WeightBound
from tests.qwen_vl_factory import hf_prompt_ids, qwen_folder, qwen_inputs
from tests.vision_factory import sample_images

MAX_NEW = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, HF model, tokenizer)."""
    return qwen_folder(tmp_path_factory.mktemp("qwen2_5_vl"))


def make_llm(folder, **kw) -> LLM:
    # A small step budget: images are split over several prefill chunks.
    args = dict(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=2**24, dtype="float32")
    llm = LLM(str(folder), **{**args, **kw})
    llm.engine.check_integrity_each_step = True
    return llm


def params(**kw) -> SamplingParams:
    # ignore_eos as HF's eos_token_id=None (hf_generate): an EOS taken ends neither.
    return SamplingParams(**{"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **kw})


@torch.no_grad()
def hf_generate(
    model, ids: list[int], images: list, max_new: int = MAX_NEW
) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for a prompt whose <|image_pad|> tokens are expanded already, and
    each one's logprob; mm_token_type_ids marks the image rows, as HF's processor returns
    them (get_rope_index reads them)."""
    pad = model.config.image_token_id
    kwargs = qwen_inputs(images)
    if images:
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == pad).int()
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, eos_token_id=None,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t])
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


CASES = [
    (f"{IMAGE}what is this", [1]),
    (f"the cat {IMAGE} and {IMAGE} then", [1, 3]),  # two sizes, text after
    (f"look{IMAGE}{IMAGE}", [2, 0]),
    ("no image here", []),
]


def _cases() -> list[tuple[str, list]]:
    photos = sample_images()
    return [(text, [photos[i] for i in which]) for text, which in CASES]


def test_generate_with_images_equals_transformers(qwen) -> None:
    folder, hf, tok = qwen
    llm = make_llm(folder)
    cases = _cases()
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in cases]
    outs = llm.generate(prompts, params(logprobs=0), use_tqdm=False)
    for out, (text, ims) in zip(outs, cases, strict=True):
        assert out.error is None
        ids = hf_prompt_ids(tok, text, ims)
        assert out.prompt_token_ids == ids
        tokens, logprobs = hf_generate(hf, ids, ims)
        got = out.outputs[0]
        assert got.token_ids == tokens, text
        ours = [lp[t] for lp, t in zip(got.logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert llm.stats["images_encoded"] == 4  # photo 1 in two prompts: once


def test_questions_about_the_same_picture_share_its_kv(qwen) -> None:
    """K questions per picture: the tower runs once per distinct picture, the prompts after the
    first reuse the picture's K/V (computed at the same 3-D positions), the answers are HF's."""
    folder, hf, tok = qwen
    llm = make_llm(folder, max_num_batched_tokens=64, max_num_seqs=2)
    photos = sample_images()[1:3]
    questions = ["what", "where is it", "why"]
    prompts = [
        {"prompt": f"{IMAGE}{q}", "multi_modal_data": {"image": im}}
        for im in photos
        for q in questions
    ]
    outs = llm.generate(prompts, params(), use_tqdm=False)
    assert llm.stats["images_encoded"] == len(photos)
    shared = sum(len(o.prompt_token_ids) - 4 for o in outs[::3])  # the picture's part, roughly
    assert llm.stats["cached_prompt_tokens"] >= (len(questions) - 1) * shared // 2
    for p, out in zip(prompts, outs, strict=True):
        im = p["multi_modal_data"]["image"]
        ids = hf_prompt_ids(tok, p["prompt"], [im])
        assert out.outputs[0].token_ids == hf_generate(hf, ids, [im])[0]


def test_preempted_and_drafted_rows_keep_their_positions(qwen) -> None:
    """A KV pool too small for every row at once (rows preempted and recomputed, their
    generated tokens past the prompt at p + delta) and n-gram drafts (verified at p + delta):
    the answers are HF's."""
    folder, hf, tok = qwen
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 heads of 16, float32
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    llm = make_llm(folder, kv_cache_memory=8 * block, max_model_len=128,
                   max_num_batched_tokens=32, speculative_config=spec)  # fmt: skip
    llm.engine.drafts.cost = WeightBound()  # drafts pay on any machine
    cases = _cases()[:3]
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases * 3]
    outs = llm.generate(prompts, params(max_tokens=40), use_tqdm=False)
    assert llm.stats["preemptions"] > 0
    assert llm.stats["accepted_draft_tokens"] > 0
    want = [hf_generate(hf, hf_prompt_ids(tok, t, ims), ims, 40)[0] for t, ims in cases]
    assert [o.outputs[0].token_ids for o in outs] == want * 3


def test_chat_image_parts_equal_the_prompt_with_images(qwen, tmp_path) -> None:
    folder, hf, tok = qwen
    llm = make_llm(folder)
    photo = sample_images()[3]
    photo.save(tmp_path / "gradient.png")
    question = {"type": "text", "text": "what is it"}
    part = {"type": "image_url", "image_url": {"url": str(tmp_path / "gradient.png")}}
    outs = llm.chat([[{"role": "user", "content": [part, question]}]], params(), use_tqdm=False)
    rendered = llm.tokenizer.render_chat_template(
        [{"role": "user", "content": [{"type": "image"}, question]}]
    )
    assert IMAGE in rendered
    assert outs[0].error is None
    ids = hf_prompt_ids(tok, rendered, [photo])
    assert outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == hf_generate(hf, ids, [photo])[0]


@torch.no_grad()
def test_padded_decode_steps_take_3d_positions(qwen) -> None:
    """The padded static-shape decode step (what CUDA graphs replay, here eagerly) of rows with
    images gives the unpadded step's logits: its positions buffer is [3, B]."""
    folder, _, _ = qwen
    # Linears whose rows do not depend on how many there are (oneDNN's), as test_decode_graphs.
    packs = onednn_packs(torch.float32, torch.device("cpu"))
    linears = "onednn" if packs else "torch"
    llm = make_llm(folder, max_num_batched_tokens=256, linear_backend=linears)
    engine = llm.engine
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in _cases()[:3]]
    requests = [llm._make_request(i, p, params()) for i, p in enumerate(prompts)]
    engine.add_requests(requests)
    engine.step()  # the prompts
    runner = engine.runner
    pool = engine.kv_manager.pool
    pad_block = next(b for b in reversed(range(pool.num_blocks)) if pool.refcount(b) == 0)
    graphs = DecodeGraphs(
        runner.model, runner.kv, runner.attention, ladder(4), 512, pad_block, capture=False
    )
    out = engine.scheduler.schedule()
    inputs = engine.step_builder.build(out.rows, out.num_new)
    assert inputs.meta.is_decode_only and inputs.positions.shape == (3, 3)
    rows = [s.request for s in engine.batch.seqs(out.rows)]
    assert sorted(r.index for r in rows) == [0, 1, 2]
    past = [len(r.prompt_token_ids) + r.mrope.delta for r in rows]
    assert inputs.positions.tolist() == [past] * 3
    saved = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]
    want = runner.execute(inputs, out).logits
    for t, s in zip((*runner.kv.k, *runner.kv.v), saved, strict=True):
        t.copy_(s)
    got = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
    assert torch.equal(got, want)
