"""Idefics3 and SmolVLM against HF transformers on tiny random checkpoints: the image features of
real photographs through the family's own image processor (split into tiles or not, padded
tiles and pixels, tiles larger than the tower's image_size), the expansion of <image> as HF's
Idefics3Processor tokenizes it, whole prompts' logits, and the config.json reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Idefics3Config, Idefics3Processor, SmolVLMConfig
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model.causal_lm import ImageEmbeds
from batchpage.model.config import UnsupportedModelError
from batchpage.model.hf_checks import check_weights, read_shapes
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model, read_hf_config, safetensors_files
from batchpage.model.idefics3 import Idefics3ForConditionalGeneration as OurIdefics3
from batchpage.model.idefics3 import pixel_shuffle
from batchpage.model.image_prompt import ImagePrompts
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.model.tokenizer import Tokenizer
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear_method import TORCH_LINEARS
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs
from batchpage.ops.select import ModelOps
from tests.model_factory import (
    hf_logits,
    new_kv_cache,
    prefill_logits,
    prefill_meta,
    tiny_tokenizer,
)
from tests.vision_factory import (
    IDEFICS3_TILE_TOKENS,
    IDEFICS3_VISION,
    idefics3_folder,
    idefics3_processor,
    idefics3_tokenizer,
    sample_images,
)

ATOL = 1e-5


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """(HF model, its saved folder, the tokenizer, our model loaded from the folder)."""
    folder, hf, tok = idefics3_folder(tmp_path_factory.mktemp("idefics3"))
    return hf, folder, tok, load_hf_model(folder, torch.float32, "cpu")[0]


def processed(images: list, **changes) -> list[dict[str, torch.Tensor]]:
    """Each image alone through the family's image processor, as ImagePrompts runs it."""
    proc = idefics3_processor(**changes)
    return [dict(proc(images=image, return_tensors="pt")) for image in images]


@torch.no_grad()
def hf_features(hf, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """HF's rows of each image alone."""
    return [hf.get_image_features(**one).pooler_output[0] for one in inputs]


def test_pixel_shuffle_is_transformers_connectors(idefics3) -> None:
    hf = idefics3[0]
    x = torch.randn(3, 36, 5, generator=torch.Generator().manual_seed(0))
    for scale in (2, 3):
        want = hf.model.connector.pixel_shuffle(x, scale)
        torch.testing.assert_close(pixel_shuffle(x, scale), want, rtol=0, atol=0)


@pytest.mark.parametrize("split", [True, False], ids=["tiles", "whole"])
def test_image_features_match_transformers(idefics3, split: bool) -> None:
    hf, _, _, ours = idefics3
    assert isinstance(ours, OurIdefics3)
    images = sample_images()
    inputs = processed(images, do_image_splitting=split)
    got, want = ours.encode_images(inputs), hf_features(hf, inputs)
    for g, w, one in zip(got, want, inputs, strict=True):
        tiles = one["pixel_values"].shape[1]
        assert tiles > 1 if split else tiles == 1
        assert g.shape == (tiles * IDEFICS3_TILE_TOKENS, 64) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert not torch.allclose(got[0][:4], got[1][:4], atol=1e-3)  # the pictures differ
    alone = ours.encode_images(inputs[2:3])  # alone or in a batch: the same rows
    torch.testing.assert_close(alone[0], got[2], atol=ATOL, rtol=0)


def test_padding_tiles_and_pixels_match_transformers(idefics3) -> None:
    """A batch as HF's processor pads it (a shorter image's missing tiles all zeros) and a tile
    whose lower right is padding (zero pixels, masked): padding tiles are dropped and padding
    patches take no attention, as HF does."""
    hf, _, _, ours = idefics3
    a, b = sample_images()[:2]
    batch = idefics3_processor()(images=[[a], [b]], return_tensors="pt")
    pixels, mask = batch["pixel_values"].clone(), batch["pixel_attention_mask"].clone()
    assert pixels.shape[:2] == (2, 10) and not pixels[1, 7:].any()  # b: 7 tiles, then padding
    pixels[0, 2, :, 20:, :] = 0  # rows 20.. and columns 12.. of tile 2 are padding
    pixels[0, 2, :, :, 12:] = 0
    mask[0, 2, 20:, :] = 0
    mask[0, 2, :, 12:] = 0
    with torch.no_grad():
        want = hf.get_image_features(pixel_values=pixels, pixel_attention_mask=mask).pooler_output
    inputs = [
        {"pixel_values": pixels[i : i + 1], "pixel_attention_mask": mask[i : i + 1]}
        for i in range(2)
    ]
    got = ours.encode_images(inputs)
    assert [g.shape[0] for g in got] == [40, 28]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    unmasked = ours.encode_images([{"pixel_values": pixels[:1]}])[0]
    assert not torch.allclose(unmasked[8:12], got[0][8:12], atol=1e-3)  # the mask counts


def test_tiles_larger_than_the_tower_image(idefics3, tmp_path) -> None:
    """48-pixel tiles (6 x 6 patches for a tower of 4 x 4 position embeddings): positions spread
    over the grid as HF's, 9 rows a tile, placed as HF's processor with image_seq_len 9."""
    hf, folder, tok, ours = idefics3
    sizes = {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 48}}
    images = sample_images()[:2]
    inputs = processed(images, **sizes)
    got_want = zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True)
    for (got, want), one in zip(got_want, inputs, strict=True):
        assert got.shape[0] == one["pixel_values"].shape[1] * 9
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    idefics3_processor(**sizes).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    prompts = ImagePrompts.from_model(tmp_path, read_hf_config(folder), Tokenizer(tok))
    reference = Idefics3Processor(idefics3_processor(**sizes), tok, image_seq_len=9)
    text = "look <image> and <image>"
    ids, _ = prompts.place(Tokenizer(tok).encode(text), images)
    assert ids == reference(text=text, images=[images])["input_ids"][0]


# Tokenizers: released checkpoints' (<row_i_col_j> added tokens), one where they are text, and
# one whose "\n\n" is a token of its own (the newline after the last row of tiles meets the one
# before the whole image).
TOKENIZERS = {
    "row-col-tokens": lambda: idefics3_tokenizer(),
    "row-col-text": lambda: idefics3_tokenizer(row_col_tokens=False),
    "double-newline": lambda: _with_double_newline(idefics3_tokenizer()),
}


def _with_double_newline(tok):
    tok.add_tokens(["\n\n"])
    return tok


@pytest.mark.parametrize("split", [True, False], ids=["tiles", "whole"])
@pytest.mark.parametrize("tokenizer", list(TOKENIZERS))
def test_expansion_is_transformers_processors(idefics3, split: bool, tokenizer: str) -> None:
    """place() on a prompt's ids equals the input_ids of HF's Idefics3Processor for the same
    prompt and images, and the image positions are its <image> tokens, image after image."""
    _, folder, _, _ = idefics3
    tok = TOKENIZERS[tokenizer]()
    ours = Tokenizer(tok)
    prompts = ImagePrompts.from_model(folder, read_hf_config(folder), ours)
    prompts.processor = idefics3_processor(do_image_splitting=split)
    reference = Idefics3Processor(
        idefics3_processor(do_image_splitting=split), tok, image_seq_len=4
    )
    image_token = tok.convert_tokens_to_ids("<image>")
    photos = sample_images()
    cases = [
        ("<image>What is in the picture?", photos[:1]),
        ("the cat <image>\n\nand <image> together", photos[1:3]),
        ("User:<image><image>\nAssistant:", [photos[3], photos[0]]),
    ]
    for text, images in cases:
        ids, placed = prompts.place(ours.encode(text), images)
        want = reference(text=text, images=[images])["input_ids"][0]
        assert ids == want, text
        positions = [p for image in placed for p in image.positions]
        assert positions == [i for i, t in enumerate(ids) if t == image_token]
        for image in placed:
            assert len(image.positions) == image.inputs["pixel_values"].shape[1] * 4
            assert set(image.inputs) == {"pixel_values", "pixel_attention_mask"}


def test_smolvlm_expansion_is_its_processors_text(idefics3, tmp_path) -> None:
    """SmolVLM's processor (which needs num2words to be built) writes the same text: its
    get_image_prompt_string for the processor's tile grid, tokenized, is our expansion."""
    _, folder, tok, _ = idefics3
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "smolvlm"}))
    idefics3_processor("smolvlm").save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert cfg.family == "idefics3"
    prompts = ImagePrompts.from_model(tmp_path, cfg, Tokenizer(tok))
    image_token = tok.convert_tokens_to_ids("<image>")
    for photo in sample_images():
        tiles = idefics3_processor("smolvlm")(images=photo, return_row_col_info=True)
        text = get_image_prompt_string(
            tiles["rows"][0][0],
            tiles["cols"][0][0],
            IDEFICS3_TILE_TOKENS,
            fake_token_around_image="<fake_token_around_image>",
            image_token="<image>",
            global_image_token="<global-img>",
        )
        ids, _ = prompts.place([5, image_token, 6], [photo])
        assert ids == [5, *tok.encode(text, add_special_tokens=False), 6]


@torch.no_grad()
def test_prompt_with_images_matches_transformers(idefics3) -> None:
    """Two images' rows in place of their placeholders' embeddings (CausalLM.forward's embeds):
    the logits of the whole prompt equal HF's forward with the pixel values."""
    hf, folder, tok, ours = idefics3
    prompts = ImagePrompts.from_model(folder, read_hf_config(folder))
    images = sample_images()[1:3]
    text = "a <image> and <image> b"
    ids, placed = prompts.place(Tokenizer(tok).encode(text), images)
    batch = idefics3_processor()(images=[images], return_tensors="pt")
    want = hf(
        input_ids=torch.tensor([ids]),
        pixel_values=batch["pixel_values"],
        pixel_attention_mask=batch["pixel_attention_mask"],
    ).logits[0]
    rows = ours.encode_images([image.inputs for image in placed])
    index = torch.tensor([p for image in placed for p in image.positions])
    embeds = ImageEmbeds(index, torch.cat(rows))
    meta = prefill_meta(len(ids), 8)
    kv = new_kv_cache(ours.config, -(-len(ids) // 8), 8)
    attention = TorchPagedAttention().plan(meta)
    hidden = ours(torch.tensor(ids), torch.arange(len(ids)), meta, kv, attention, embeds=embeds)
    got = ours.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert not torch.allclose(got, prefill_logits(ours, ids), atol=1e-3)  # the images count


def test_text_logits_match_transformers(idefics3) -> None:
    hf, _, _, ours = idefics3
    ids = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_smolvlm_checkpoint_matches_transformers(tmp_path) -> None:
    """A SmolVLM folder (model_type smolvlm, SmolVLMForConditionalGeneration's names and its
    own image processor) runs as the idefics3 family."""
    folder, hf, tok = idefics3_folder(tmp_path, "smolvlm", seed=3)
    ours, cfg = load_hf_model(folder, torch.float32, "cpu")
    assert cfg.family == "idefics3" and hf.config.model_type == "smolvlm"
    inputs = processed(sample_images()[:2])
    for got, want in zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    ids = list(range(5, 40))
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_bound_tower_keeps_its_numbers(idefics3) -> None:
    """bind makes the tower's and the projection's linears with the engine's method (oneDNN's
    packed ones where this torch has them) like every other linear; the rows stay HF's."""
    hf, folder, _, _ = idefics3
    ours = load_hf_model(folder, torch.float32, "cpu")[0]
    vision = [m for m in ours.vision.modules() if isinstance(m, LoadedLinear)]
    assert len(vision) == 4 * IDEFICS3_VISION["num_hidden_layers"] + 1
    packs = onednn_packs(torch.float32, torch.device("cpu"))
    report = ours.bind(ModelOps(LayerOps(), ONEDNN_LINEARS if packs else TORCH_LINEARS))
    assert report.linears == len(vision) + 4 * ours.config.num_layers + 1
    assert not any(isinstance(m, LoadedLinear) for m in ours.modules())
    inputs = processed(sample_images()[:2])
    for got, want in zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_folder_reads_as_idefics3(idefics3) -> None:
    """The folder's config and the checks before loading accept it, counting the parameters
    the loaded model holds."""
    hf, folder, tok, ours = idefics3
    cfg = read_hf_config(Path(folder))
    assert cfg.family == "idefics3" and ours.config.vision == cfg.vision
    v = cfg.vision
    assert v is not None and v.kind == "idefics3" and v.scale_factor == 2
    assert v.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert v.tokens_per_image == hf.model.image_seq_len == IDEFICS3_TILE_TOKENS
    count = check_weights(folder, cfg, read_shapes(safetensors_files(folder)))
    assert count == sum(p.numel() for p in ours.parameters())


@pytest.mark.parametrize("config_class", [Idefics3Config, SmolVLMConfig])
@pytest.mark.parametrize("text", [None, {"vocab_size": 1000}, {"model_type": "mistral"}])
def test_absent_keys_take_transformers_defaults(config_class, text) -> None:
    """A config.json that states little reads as transformers' config class resolves it (the
    tower's image_size stated: the default 224 makes 7 patches a side, which no shuffle of 2
    divides)."""
    vision = {"image_size": 256}
    raw = {"model_type": config_class.model_type, "image_token_id": 7, "vision_config": vision}
    if text is not None:
        raw["text_config"] = text
    ref = config_class.from_dict(raw)
    t, vision = ref.text_config, ref.vision_config
    cfg = model_config_from_hf(raw)
    assert cfg.family == "idefics3" and cfg.vision is not None
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        t.vocab_size,
        t.hidden_size,
        t.intermediate_size,
        t.num_hidden_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.max_position_embeddings) == (
        t.num_attention_heads,
        t.num_key_value_heads,
        t.max_position_embeddings,
    )
    assert cfg.rms_norm_eps == t.rms_norm_eps
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    v = cfg.vision
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads) == (
        vision.hidden_size,
        vision.intermediate_size,
        vision.num_hidden_layers,
        vision.num_attention_heads,
    )
    assert (v.image_size, v.patch_size, v.num_channels, v.hidden_act, v.layer_norm_eps) == (
        vision.image_size,
        vision.patch_size,
        vision.num_channels,
        vision.hidden_act,
        vision.layer_norm_eps,
    )
    assert (v.scale_factor, v.image_token_id) == (ref.scale_factor, ref.image_token_id)
    side = vision.image_size // vision.patch_size
    assert v.tokens_per_image == side**2 // ref.scale_factor**2


def test_only_the_top_level_ties_the_head() -> None:
    """transformers ties Idefics3's lm_head by the top-level tie_word_embeddings alone."""
    raw = {
        "model_type": "idefics3",
        "image_token_id": 3,
        "text_config": {"model_type": "llama", "tie_word_embeddings": True},
        "vision_config": IDEFICS3_VISION,
    }
    assert not model_config_from_hf(raw).tie_word_embeddings
    assert not Idefics3Config.from_dict(raw).tie_word_embeddings
    tied = {**raw, "tie_word_embeddings": True}
    assert model_config_from_hf(tied).tie_word_embeddings
    assert Idefics3Config.from_dict(tied).tie_word_embeddings


def _raw(**changes) -> dict:
    config = Idefics3Config(
        text_config={"model_type": "llama", "vocab_size": 64},
        vision_config=IDEFICS3_VISION,
        image_token_id=9,
    )
    return {**config.to_dict(), **changes}


def test_configs_that_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="scale_factor=3 must divide"):
        model_config_from_hf(_raw(scale_factor=3))  # 4 patches a side
    with pytest.raises(ValueError, match="224 makes 7 patches of 32 per side"):
        model_config_from_hf(_raw(vision_config={}))  # transformers' default tower
    with pytest.raises(ValueError, match="scale_factor"):
        model_config_from_hf(_raw(scale_factor=0))
    with pytest.raises(ValueError, match="image_token_id must be an integer from 0 to 63"):
        model_config_from_hf(_raw(image_token_id=64))
    gemma = {"model_type": "gemma", "vocab_size": 64}
    with pytest.raises(UnsupportedModelError, match="Idefics3 with a 'gemma' text model"):
        model_config_from_hf(_raw(text_config=gemma))
    relu2 = dict(IDEFICS3_VISION, hidden_act="relu2")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu2' in a Idefics3 config"):
        model_config_from_hf(_raw(vision_config=relu2))


def test_processors_and_tokenizers_that_do_not_fit_are_refused(idefics3, tmp_path) -> None:
    _, folder, tok, _ = idefics3
    cfg = read_hf_config(folder)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    # 24-pixel tiles: 3 patches a side, which a 2 x 2 shuffle does not divide.
    idefics3_processor(max_image_size={"longest_edge": 24}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="24x24 tiles.*max_image_size"):
        ImagePrompts.from_model(tmp_path, cfg, Tokenizer(tok))
    # A tokenizer without Idefics3's tokens, and a folder without a tokenizer.
    with pytest.raises(ValueError, match=r"<image> \[.*image_token_id \[321\]"):
        ImagePrompts.from_model(folder, cfg, Tokenizer(tiny_tokenizer()))
    idefics3_processor().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer cannot be loaded.*needs it"):
        ImagePrompts.from_model(tmp_path, cfg)


def test_pixel_values_that_do_not_fit_are_refused(idefics3) -> None:
    ours = idefics3[3]
    good = processed(sample_images()[:1])[0]
    odd = torch.zeros(1, 1, 3, 24, 24)  # 3 patches a side: no 2 x 2 shuffle
    with pytest.raises(ValueError, match=r"image 1: pixel_values of shape \(1, 1, 3, 24, 24\)"):
        ours.encode_images([good, {"pixel_values": odd}])
    mask = good["pixel_attention_mask"][:, :1]
    with pytest.raises(ValueError, match="image 0: pixel_attention_mask of shape"):
        ours.encode_images([{**good, "pixel_attention_mask": mask}])
