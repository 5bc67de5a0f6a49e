"""Qwen2.5-VL against HF transformers on a tiny random checkpoint: the vision transformer's rows
of real photographs of several sizes through the family's own image processor (windows cut at
the image's edge, several images in one sequence), its window layout and 2-D positions, M-RoPE
(the rope of 3-D positions, a prompt's positions and delta as get_rope_index computes them),
the expansion of <|image_pad|> as HF's processor makes it, whole prompts' logits, both
checkpoint layouts and the config.json reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model.causal_lm import ImageEmbeds
from batchpage.model.config import UnsupportedModelError
from batchpage.model.hf_checks import check_weights, read_shapes
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model, read_hf_config, safetensors_files
from batchpage.model.image_prompt import ImagePrompts
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.model.mrope import prompt_positions
from batchpage.model.qwen2_5_vision import window_layout
from batchpage.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as OurQwen
from batchpage.model.rope import RotaryEmbedding
from batchpage.model.tokenizer import Tokenizer
from batchpage.ops.layer_ops import LayerOps, apply_rope
from batchpage.ops.linear_method import TORCH_LINEARS
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs
from batchpage.ops.select import ModelOps
from tests.model_factory import hf_logits, new_kv_cache, prefill_logits, prefill_meta
from tests.qwen_vl_factory import (
    MROPE_SECTION,
    VISION,
    hf_prompt_ids,
    qwen_folder,
    qwen_inputs,
    qwen_processor,
)
from tests.vision_factory import sample_images

ATOL = 1e-4
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(HF model, its saved folder, the tokenizer, our model loaded from the folder)."""
    folder, hf, tok = qwen_folder(tmp_path_factory.mktemp("qwen2_5_vl"))
    return hf, folder, tok, load_hf_model(folder, torch.float32, "cpu")[0]


def processed(images: list) -> list[dict[str, torch.Tensor]]:
    """Each image alone through the family's image processor, as ImagePrompts runs it."""
    return [dict(qwen_processor()(images=image, return_tensors="pt")) for image in images]


@torch.no_grad()
def hf_features(hf, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """HF's rows of the images, all in one call of its tower."""
    pixels = torch.cat([one["pixel_values"] for one in inputs])
    grids = torch.cat([one["image_grid_thw"] for one in inputs])
    return list(
        hf.model.get_image_features(pixel_values=pixels, image_grid_thw=grids).pooler_output
    )


def test_tower_matches_transformers(qwen) -> None:
    hf, _, _, ours = qwen
    assert isinstance(ours, OurQwen)
    inputs = processed(sample_images())
    grids = {tuple(one["image_grid_thw"][0].tolist()) for one in inputs}
    assert len(grids) >= 3  # pictures of several sizes
    units = VISION["window_size"] // 12  # merged rows a window side
    assert any((h // 2) % units or (w // 2) % units for _, h, w in grids)  # edge windows
    got, want = ours.encode_images(inputs), hf_features(hf, inputs)
    for g, w, one in zip(got, want, inputs, strict=True):
        assert g.shape == (one["pixel_values"].shape[0] // 4, 64) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    for i, one in enumerate(inputs):  # alone: the same rows
        torch.testing.assert_close(ours.encode_images([one])[0], want[i], atol=ATOL, rtol=0)
    assert not torch.allclose(got[1][:4], got[2][:4], atol=1e-3)  # the pictures differ


@pytest.mark.parametrize(
    "grids", [[(1, 12, 12)], [(1, 10, 16), (1, 4, 6)], [(2, 8, 14)], [(1, 2, 2), (1, 14, 6)]]
)
@pytest.mark.parametrize("window", [24, 36, 60])
def test_window_layout_is_transformers(grids, window: int) -> None:
    """The blocked order of the patches, the windows and the 2-D positions against
    transformers' get_vision_window_index and get_vision_position_ids (frames of a two-frame
    grid each their own segment, as transformers' cu_seqlens)."""
    grid_thw = torch.tensor(grids)
    units, bounds = get_vision_window_index(grid_thw, 2, window, 6)
    layout = window_layout(grids, 2, window // 12)
    want_order = (units[:, None] * 4 + torch.arange(4)).reshape(-1)
    assert torch.equal(layout.order, want_order)
    assert layout.windows == torch.diff(bounds).tolist()
    assert torch.equal(layout.unorder, torch.argsort(units))
    assert torch.equal(layout.rows, get_vision_position_ids(grid_thw, 2)[want_order])
    assert layout.frames == [h * w for t, h, w in grids for _ in range(t)]


def test_mrope_matches_transformers(qwen) -> None:
    """RotaryEmbedding's cos / sin of 3-D positions, applied by apply_rope, against
    transformers' Qwen2.5-VL rotary embedding (its mrope sections' recomposition) and
    apply_rotary_pos_emb; positions [T] are the three axes alike."""
    hf, _, _, ours = qwen
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 300, (3, 37), generator=g)
    q = torch.randn(37, 4, 16, generator=g)
    hf_rotary = Qwen2_5_VLRotaryEmbedding(hf.config.text_config)
    cos, sin = hf_rotary(q, positions[:, None, :])
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    rotary = RotaryEmbedding(ours.config, 512, torch.device("cpu"))
    assert ours.config.mrope_section == tuple(MROPE_SECTION)
    got = apply_rope(q, *rotary(positions, prefill_meta(37)))
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-5, rtol=0)
    flat = apply_rope(q, *rotary(positions[1], prefill_meta(37)))
    alike = apply_rope(q, *rotary(positions[1].expand(3, -1), prefill_meta(37)))
    torch.testing.assert_close(flat, alike, atol=0, rtol=0)
    assert not torch.allclose(flat, got, atol=1e-3)


PROMPTS = [
    f"{IMAGE}what is this",
    f"the cat {IMAGE} and {IMAGE} together?",
    f"look{IMAGE}{IMAGE}",
    "no image at all",
]


def _images_for(text: str) -> list:
    photos = sample_images()
    return [photos[(1 + 2 * i) % len(photos)] for i in range(text.count(IMAGE))]


def test_expansion_and_positions_are_transformers(qwen) -> None:
    """place() on a prompt's ids equals HF's processor's input_ids, its image positions are the
    <|image_pad|> tokens, and prompt_positions equals get_rope_index's positions and delta."""
    hf, folder, tok, _ = qwen
    prompts = ImagePrompts.from_model(folder, read_hf_config(folder))
    pad = hf.config.image_token_id
    for text in PROMPTS:
        images = _images_for(text)
        ids, placed = prompts.place(Tokenizer(tok).encode(text), images)
        assert ids == hf_prompt_ids(tok, text, images), text
        assert [p for im in placed for p in im.positions] == [
            i for i, t in enumerate(ids) if t == pad
        ]
        ours = prompt_positions(len(ids), placed, 2)
        if not images:
            assert ours.delta == 0 and (ours.positions == torch.arange(len(ids)).numpy()).all()
            continue
        want, delta = hf.model.get_rope_index(
            torch.tensor([ids]),
            (torch.tensor([ids]) == pad).int(),
            image_grid_thw=qwen_inputs(images)["image_grid_thw"],
        )
        assert (ours.positions == want[:, 0].numpy()).all(), text
        assert ours.delta == int(delta) < 0


@torch.no_grad()
def test_prompt_with_images_matches_transformers(qwen) -> None:
    """Two images of different sizes in place of their placeholders' embeddings, at their
    3-D positions: the logits of the whole prompt equal HF's forward; with 1-D positions they
    do not (M-RoPE counts)."""
    hf, folder, tok, ours = qwen
    prompts = ImagePrompts.from_model(folder, read_hf_config(folder))
    text = PROMPTS[1]
    images = _images_for(text)
    ids, placed = prompts.place(Tokenizer(tok).encode(text), images)
    assert len({len(im.positions) for im in placed}) == 2
    pad = hf.config.image_token_id
    want = hf(
        input_ids=torch.tensor([ids]),
        mm_token_type_ids=(torch.tensor([ids]) == pad).int(),
        **qwen_inputs(images),
    ).logits[0]
    rows = ours.encode_images([image.inputs for image in placed])
    index = torch.tensor([p for image in placed for p in image.positions])
    embeds = ImageEmbeds(index, torch.cat(rows))
    meta = prefill_meta(len(ids), 8)
    attention = TorchPagedAttention().plan(meta)

    def logits(positions: torch.Tensor) -> torch.Tensor:
        kv = new_kv_cache(ours.config, -(-len(ids) // 8), 8)
        hidden = ours(torch.tensor(ids), positions, meta, kv, attention, embeds=embeds)
        return ours.compute_logits(hidden)

    three = torch.from_numpy(prompt_positions(len(ids), placed, 2).positions)
    torch.testing.assert_close(logits(three), want, atol=ATOL, rtol=0)
    assert not torch.allclose(logits(torch.arange(len(ids))), want, atol=1e-3)


def test_text_logits_match_transformers(qwen) -> None:
    hf, _, _, ours = qwen
    ids = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


def _flat_config(raw: dict) -> dict:
    """A transformers 4.x config.json of the same model: the text model's keys at the top
    level, its rope as rope_theta + rope_scaling {"type": "mrope"}."""
    text = dict(raw["text_config"])
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    flat = {k: v for k, v in raw.items() if k != "text_config"}
    sections = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    return {**flat, **text, "rope_theta": rope["rope_theta"], "rope_scaling": sections}


def test_older_checkpoint_layout_loads_alike(qwen, tmp_path: Path) -> None:
    """A transformers 4.x folder (model.* for the language model, visual.*, a flat config.json)
    loads into the same model."""
    _, folder, _, ours = qwen
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(_flat_config(raw)))
    tensors = load_file(folder / "model.safetensors")
    renamed = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
        for name, t in tensors.items()
    }
    assert any(n.startswith("visual.") for n in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    qwen_processor().save_pretrained(tmp_path)
    older, cfg = load_hf_model(tmp_path, torch.float32, "cpu")
    assert cfg == ours.config
    for name, p in ours.state_dict().items():
        assert torch.equal(older.state_dict()[name], p), name


def test_bound_tower_keeps_its_numbers(qwen) -> None:
    """bind makes the tower's linears with the engine's method (oneDNN's packed ones where this
    torch has them) like every other linear; the rows stay HF's."""
    hf, folder, _, _ = qwen
    ours = load_hf_model(folder, torch.float32, "cpu")[0]
    vision = [m for m in ours.vision.modules() if isinstance(m, LoadedLinear)]
    assert len(vision) == 4 * VISION["depth"] + 3
    packs = onednn_packs(torch.float32, torch.device("cpu"))
    report = ours.bind(ModelOps(LayerOps(), ONEDNN_LINEARS if packs else TORCH_LINEARS))
    assert report.linears == len(vision) + 4 * ours.config.num_layers + 1
    assert not any(isinstance(m, LoadedLinear) for m in ours.modules())
    inputs = processed(sample_images()[:3])
    for got, want in zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_folder_reads_as_qwen2_5_vl(qwen) -> None:
    """The folder's config and the checks before loading accept it, counting the parameters
    the loaded model holds."""
    hf, folder, tok, ours = qwen
    cfg = read_hf_config(Path(folder))
    assert cfg.family == "qwen2_5_vl" and ours.config.vision == cfg.vision
    v = cfg.vision
    assert v is not None and v.kind == "qwen2_5_vl" and v.full_attention_layers == (1,)
    assert v.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.attention_bias and not cfg.o_proj_bias  # Qwen2's
    count = check_weights(folder, cfg, read_shapes(safetensors_files(folder)))
    assert count == sum(p.numel() for p in ours.parameters())


@pytest.mark.parametrize("layout", ["nested", "flat"])
@pytest.mark.parametrize(
    "text", [{}, {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4}]
)
def test_absent_keys_take_transformers_defaults(layout: str, text: dict) -> None:
    """A config.json that states little reads as transformers' config class resolves it."""
    raw: dict = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}
    if layout == "nested":
        raw["text_config"] = text
    else:
        raw.update(text)
    ref = Qwen2_5_VLConfig.from_dict(raw)
    t, vision = ref.text_config, ref.vision_config
    if vision.out_hidden_size != t.hidden_size:
        with pytest.raises(ValueError, match="out_hidden_size=3584 must be the language"):
            model_config_from_hf(raw)
        return
    cfg = model_config_from_hf(raw)
    assert cfg.family == "qwen2_5_vl" and cfg.vision is not None
    got = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads)
    want = (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers)
    assert got == (*want, t.num_attention_heads)
    assert (cfg.num_kv_heads, cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        t.num_key_value_heads,
        t.max_position_embeddings,
        t.rms_norm_eps,
    )
    assert cfg.rope_theta == t.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert cfg.mrope_section == (16, 24, 24) and cfg.layer_windows == ()
    assert cfg.eos_token_ids == (t.eos_token_id,) and cfg.bos_token_id == t.bos_token_id
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    v = cfg.vision
    assert (v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads) == (
        vision.hidden_size,
        vision.intermediate_size,
        vision.depth,
        vision.num_heads,
    )
    assert (v.patch_size, v.num_channels, v.hidden_act, v.window_size) == (
        vision.patch_size,
        vision.in_channels,
        vision.hidden_act,
        vision.window_size,
    )
    assert (v.spatial_merge_size, v.temporal_patch_size) == (
        vision.spatial_merge_size,
        vision.temporal_patch_size,
    )
    assert v.full_attention_layers == tuple(vision.fullatt_block_indexes)
    assert v.rope_theta == vision.rope_parameters["rope_theta"]
    assert v.image_token_id == ref.image_token_id


def test_either_level_ties_the_head() -> None:
    """transformers 5 ties by the top level, and forwards a 4.x text_config's tie to it."""
    base = {"model_type": "qwen2_5_vl", "vision_config": {"out_hidden_size": 8192}}
    for top, inner in [(False, False), (True, False), (False, True)]:
        raw = {**base, "tie_word_embeddings": top, "text_config": {"tie_word_embeddings": inner}}
        want = Qwen2_5_VLConfig.from_dict(raw).tie_word_embeddings
        assert model_config_from_hf(raw).tie_word_embeddings == want == (top or inner)


def _raw(**changes) -> dict:
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"vocab_size": 64, "num_hidden_layers": 2}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    raw = {"model_type": "qwen2_5_vl", "image_token_id": 9, "text_config": text}
    return {**raw, "vision_config": VISION, **changes}


def test_configs_that_cannot_run_are_refused() -> None:
    assert model_config_from_hf(_raw()).mrope_section == (2, 3, 3)
    with pytest.raises(ValueError, match="out_hidden_size=32 must be the language"):
        model_config_from_hf(_raw(vision_config={**VISION, "out_hidden_size": 32}))
    with pytest.raises(ValueError, match="window_size=6 is less than one merged unit"):
        model_config_from_hf(_raw(vision_config={**VISION, "window_size": 6}))
    with pytest.raises(ValueError, match="a multiple of 4"):
        model_config_from_hf(_raw(vision_config={**VISION, "num_heads": 16}))
    with pytest.raises(ValueError, match="image_token_id must be an integer from 0 to 63"):
        model_config_from_hf(_raw(image_token_id=64))
    text = _raw()["text_config"]
    odd = {**text, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 4]}}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 4\] must be positive sizes"):
        model_config_from_hf(_raw(text_config=odd))
    dynamic = {**text, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="'dynamic' with M-RoPE"):
        model_config_from_hf(_raw(text_config=dynamic))
    with pytest.raises(UnsupportedModelError, match="quantized Qwen2.5-VL"):
        model_config_from_hf(_raw(quantization_config={"quant_method": "gptq", "bits": 4}))
    gelu2 = {**VISION, "hidden_act": "relu2"}
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu2' in a Qwen2.5-VL"):
        model_config_from_hf(_raw(vision_config=gelu2))


def test_processors_and_pixel_values_that_do_not_fit_are_refused(qwen, tmp_path) -> None:
    _, folder, _, ours = qwen
    cfg = read_hf_config(folder)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    qwen_processor(patch_size=4).save_pretrained(tmp_path)  # patches of 3 x 2 x 4 x 4 values
    with pytest.raises(ValueError, match="patches of 216 values.*must match config.json"):
        ImagePrompts.from_model(tmp_path, cfg)
    good = processed(sample_images()[:1])[0]
    half = {**good, "pixel_values": good["pixel_values"][:8]}
    with pytest.raises(ValueError, match=r"image 1: pixel_values of shape \(8, 216\)"):
        ours.encode_images([good, half])
    odd = {"pixel_values": torch.zeros(6, 216), "image_grid_thw": torch.tensor([[1, 2, 3]])}
    with pytest.raises(ValueError, match="image 0: .*spatial_merge_size=2"):
        ours.encode_images([odd])
