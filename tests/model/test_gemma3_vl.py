"""Gemma 3 with images against HF transformers on a tiny random checkpoint: the image features of
real photographs through Gemma3ImageProcessor, the expansion of <start_of_image> as HF's
Gemma3Processor tokenizes it (its blank lines merged with the prompt's newlines), whole
prompts' logits with the images' rows attending both ways (a sliding window shorter than the
prompt and than an image's span) in both checkpoint layouts, and the config.json reading."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma3Config

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model.causal_lm import ImageEmbeds
from batchpage.model.config import UnsupportedModelError
from batchpage.model.gemma3_vl import Gemma3ForConditionalGeneration as OurGemma3
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.image_prompt import ImagePrompts
from batchpage.model.image_rules import NewlineJoin
from batchpage.model.tokenizer import Tokenizer
from tests.gemma3_vl_factory import (
    TOKENS_PER_IMAGE,
    gemma3_processor,
    gemma3_vl_folder,
    hf_processor,
)
from tests.model.test_gemma import HUB_STYLE_GEMMA3
from tests.model_factory import new_kv_cache, prefill_meta
from tests.vision_factory import sample_images

ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(HF model, its folder, the HF tokenizer, our model loaded from the folder)."""
    folder, hf, tok = gemma3_vl_folder(tmp_path_factory.mktemp("gemma3_vl"))
    return hf, folder, tok, load_hf_model(folder, torch.float32, "cpu")[0]


def test_image_features_match_transformers(gemma3) -> None:
    hf, _, _, ours = gemma3
    assert isinstance(ours, OurGemma3) and ours.BIDIRECTIONAL_IMAGES
    proc = gemma3_processor()
    inputs = [dict(proc(images=im, return_tensors="pt")) for im in sample_images()]
    got = ours.encode_images(inputs)  # one batch
    for one, rows in zip(inputs, got, strict=True):
        with torch.no_grad():
            want = hf.get_image_features(pixel_values=one["pixel_values"]).pooler_output[0]
        assert rows.shape == (TOKENS_PER_IMAGE, hf.config.text_config.hidden_size)
        torch.testing.assert_close(rows, want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="image 0: pixel_values of shape"):
        ours.encode_images([{"pixel_values": torch.zeros(1, 3, 16, 16)}])


PROMPTS = [
    "Describe <start_of_image>",
    "Describe\n<start_of_image>this",
    "<start_of_image>\n\nwhat\n",
    "two: <start_of_image><start_of_image> and\n\n<start_of_image>\nend",
    "no picture\n\nhere",
]


def test_the_expansion_is_gemma3_processors(gemma3) -> None:
    """Each <start_of_image> becomes HF's full image sequence, its blank lines merged with the
    prompt's newlines as the tokenizer merges them; the image rows are its soft tokens."""
    hf, folder, tok, _ = gemma3
    ours_tok = Tokenizer.from_hf_folder(folder)
    prompts = ImagePrompts.from_model(folder, model_config_from_hf(hf.config.to_dict()), ours_tok)
    reference = hf_processor(tok)
    photos = sample_images()
    runs = set()
    for text in PROMPTS:
        images = [photos[i % len(photos)] for i in range(text.count("<start_of_image>"))]
        want = reference(text=text, images=[images] if images else None, return_tensors="pt")
        ids, placed = prompts.place(ours_tok.encode(text), images)
        assert ids == want["input_ids"][0].tolist(), text
        soft = [i for i, t in enumerate(want["token_type_ids"][0].tolist()) if t == 1]
        assert [p for im in placed for p in im.positions] == soft
        runs.update(ours_tok.decode([t]) for t in ids if not ours_tok.decode([t]).strip("\n"))
    assert {"\n\n\n", "\n\n\n\n"} <= runs, "the prompts meet no newline merge"


def test_newline_join_merges_only_runs_across_the_seam() -> None:
    """NewlineJoin against brute force: joining the tokens of two texts gives the tokens of
    the joined text, for a tokenizer whose newline runs are tokens (here: each run one token)."""
    vocab = ["a", "b", "\n", "\n\n", "\n\n\n", "\n\n\n\n"]

    def encode(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            j = i + 1
            if text[i] == "\n":
                while j < len(text) and text[j] == "\n" and j - i < 4:
                    j += 1
            out.append(vocab.index(text[i:j]))
            i = j
        return out

    join = NewlineJoin(encode, lambda t: vocab[t])
    texts = ["", "a", "\n", "a\n", "\na", "\n\nb\n", "b\n\n", "\n\n"]
    for left in texts:
        for right in texts:
            ids = encode(left)
            join(ids, encode(right))
            assert ids == encode(left + right), (left, right)


@torch.no_grad()
def our_logits(model, ids: list[int], placed, whole_spans: bool = True) -> torch.Tensor:
    """Our model's logits over a whole prompt in one step (torch attention), its images' rows
    in place and each span's rows seeing the whole span (as the engine's step inputs make it)."""
    bs = 8
    n = len(ids)
    meta = prefill_meta(n, bs)
    if whole_spans:
        key_end = torch.arange(1, n + 1, dtype=torch.int32)
        for im in placed:
            key_end[list(im.positions)] = im.positions[-1] + 1
        meta = replace(meta, key_end=key_end, span_seqs=(0,))
    rows = model.encode_images([im.inputs for im in placed])
    index = torch.tensor([p for im in placed for p in im.positions])
    embeds = ImageEmbeds(index, torch.cat(rows))
    kv = new_kv_cache(model.config, -(-n // bs), bs)
    step = TorchPagedAttention().plan(meta)
    hidden = model(torch.tensor(ids), torch.arange(n), meta, kv, step, embeds)
    return model.compute_logits(hidden)


# The checkpoint layouts transformers has written, from the model's own (5.x) names.
LAYOUTS = {
    "5.x": [],
    "4.52": [("model.vision_tower.", "model.vision_tower.vision_model.")],
    "4.50": [
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    ],
}


@pytest.mark.parametrize("layout", ["saved", *LAYOUTS])
def test_prompt_logits_match_transformers(gemma3, tmp_path, layout: str) -> None:
    """Two images in a prompt longer than the window (8) and their spans (16): the logits
    equal HF's with token_type_ids; with causal image rows they would not. Every layout: what
    save_pretrained writes now, and the names of transformers 5 (model.language_model.*,
    model.vision_tower.*, model.multi_modal_projector.*, lm_head), 4.52 (its tower under
    vision_model.) and 4.50 (language_model.model.*, vision_tower.vision_model.*, ...)."""
    hf, folder, tok, ours = gemma3
    if layout != "saved":
        state = {}
        for name, tensor in hf.state_dict().items():
            for old, new in LAYOUTS[layout]:
                if name.startswith(old):
                    name = new + name.removeprefix(old)
            state[name] = tensor.clone()
        (tmp_path / "config.json").write_text((folder / "config.json").read_text())
        save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        ours = load_hf_model(tmp_path, torch.float32, "cpu")[0]
    text = "Look: <start_of_image> and\n<start_of_image> which one is older?"
    photos = sample_images()[:2]
    inputs = hf_processor(tok)(text=text, images=[photos], return_tensors="pt")
    with torch.no_grad():
        want = hf(**inputs).logits[0]
    ours_tok = Tokenizer.from_hf_folder(folder)
    prompts = ImagePrompts.from_model(folder, ours.config, ours_tok)
    ids, placed = prompts.place(ours_tok.encode(text), photos)
    assert ids == inputs["input_ids"][0].tolist() and len(ids) > 2 * TOKENS_PER_IMAGE
    torch.testing.assert_close(our_logits(ours, ids, placed), want, atol=ATOL, rtol=0)
    causal = our_logits(ours, ids, placed, whole_spans=False)
    assert (causal - want).abs().max() > 100 * ATOL


def hub_config(**top) -> dict:
    return {**HUB_STYLE_GEMMA3, **top}


def test_config_reads_as_transformers_reads_it() -> None:
    """A hub-style config.json (the vision_config names its type only): the tower's and the
    image tokens' numbers are Gemma3Config's defaults; *_id keys win over *_index ones."""
    ours = model_config_from_hf(HUB_STYLE_GEMMA3)
    theirs = Gemma3Config(**HUB_STYLE_GEMMA3)
    tower = theirs.vision_config
    assert ours.family == "gemma3_vl" and ours.vision is not None
    v = ours.vision
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads) == (
        tower.hidden_size,
        tower.intermediate_size,
        tower.num_hidden_layers,
        tower.num_attention_heads,
    )
    assert (v.image_size, v.patch_size, v.layer_norm_eps, v.hidden_act) == (
        tower.image_size,
        tower.patch_size,
        tower.layer_norm_eps,
        tower.hidden_act,
    )
    assert (v.image_token_id, v.soft_token_id, v.end_token_id, v.tokens_per_image) == (
        theirs.boi_token_index,
        theirs.image_token_index,
        theirs.eoi_token_index,
        theirs.mm_tokens_per_image,
    )
    renamed = model_config_from_hf({**HUB_STYLE_GEMMA3, "boi_token_id": 7, "image_token_id": 9})
    assert renamed.vision is not None
    assert (renamed.vision.image_token_id, renamed.vision.soft_token_id) == (7, 9)
    text_only = {k: v for k, v in HUB_STYLE_GEMMA3.items() if k != "vision_config"}
    plain = model_config_from_hf(text_only)
    assert plain.family == "gemma3" and plain.vision is None
    assert replace(ours, family="gemma3", vision=None) == plain


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"mm_tokens_per_image": 15}, ValueError, "must be a square"),
        ({"mm_tokens_per_image": 9}, ValueError, "must be a square whose side divides"),
        ({"vision_config": {"model_type": "clip_vision_model"}}, UnsupportedModelError, "SigLIP"),
        ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedModelError, "quantized"),
        ({"image_token_index": 10**6}, ValueError, "image_token_index"),
    ],
)
def test_config_refuses_what_it_cannot_run(change, error, match) -> None:
    with pytest.raises(error, match=match):
        model_config_from_hf(hub_config(**change))


def test_pan_and_scan_crops_are_the_images_error(gemma3) -> None:
    hf, folder, _, _ = gemma3
    prompts = ImagePrompts.from_model(folder, model_config_from_hf(hf.config.to_dict()))
    prompts.processor = gemma3_processor()
    prompts.processor.do_pan_and_scan = True
    prompts.processor.pan_and_scan_min_crop_size = 8
    prompts.processor.pan_and_scan_max_num_crops = 4
    prompts.processor.pan_and_scan_min_ratio_to_activate = 1.2
    wide = sample_images()[3]  # 71 x 47
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        prompts.place([2, prompts.vision.image_token_id], [wide])
