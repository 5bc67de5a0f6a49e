"""LLaVA against HF transformers on tiny random checkpoints: the image features of real and
generated images through CLIP's own image processor, the language model's logits, both
checkpoint layouts, and the config.json reading (transformers' defaults, refusals)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPImageProcessorPil,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipVisionConfig,
)

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model.causal_lm import ImageEmbeds
from batchpage.model.config import UnsupportedModelError
from batchpage.model.hf_checks import check_weights, read_shapes
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model, read_hf_config, safetensors_files
from batchpage.model.llava import LlavaForConditionalGeneration as OurLlava
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear_method import TORCH_LINEARS
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs
from batchpage.ops.select import ModelOps
from tests.extras import require
from tests.model_factory import (
    hf_logits,
    new_kv_cache,
    prefill_logits,
    prefill_meta,
    save_hf_folder,
    tiny_tokenizer,
)
from tests.vision_factory import VISION, text_config
from tests.vision_factory import build_llava as build_hf_llava

Image = require("PIL.Image", "dev")
skimage_data = require("skimage.data", "dev")

ATOL = 1e-5
VOCAB, IMAGE_TOKEN = 320, 319
TEXT = text_config(VOCAB, 1, 2)


def build_llava(feature_layer: int | list[int] = -2, select: str = "default", seed: int = 0):
    """A float32 HF LLaVA of the tiny shapes, every parameter random (vision_factory)."""
    return build_hf_llava(
        TEXT,
        IMAGE_TOKEN,
        seed,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select,
    )


def processor() -> CLIPImageProcessorPil:
    """CLIP's image processor (its PIL variant: no torchvision) sized for the tiny tower."""
    return CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})


def images() -> list:
    """A photograph and a generated non-square image (gradients and seeded noise)."""
    h, w = 47, 71
    ys, xs = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(5).integers(0, 60, (h, w, 3))
    generated = np.stack([xs * 255 // w, ys * 255 // h, (xs + ys) % 256], axis=-1) + noise
    return [
        Image.fromarray(skimage_data.astronaut()),
        Image.fromarray(np.clip(generated, 0, 255).astype(np.uint8)),
    ]


def pixel_inputs() -> list[dict[str, torch.Tensor]]:
    proc = processor()
    return [dict(proc(images=image, return_tensors="pt")) for image in images()]


@torch.no_grad()
def hf_features(hf, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    pixels = torch.cat([i["pixel_values"] for i in inputs])
    return list(hf.get_image_features(pixel_values=pixels).pooler_output)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(HF model, its saved folder, our model loaded from it)."""
    hf = build_llava()
    folder = save_hf_folder(hf, tmp_path_factory.mktemp("llava"))
    return hf, folder, load_hf_model(folder, torch.float32, "cpu")[0]


def test_image_features_match_transformers(llava):
    hf, _, ours = llava
    assert isinstance(ours, OurLlava)
    inputs = pixel_inputs()
    got, want = ours.encode_images(inputs), hf_features(hf, inputs)
    assert len(got) == 2 and got[0].shape == (25, 64) and got[0].dtype == torch.float32
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert not torch.allclose(got[0], got[1], atol=1e-3)  # the two images differ
    one = ours.encode_images(inputs[1:])  # alone or in a batch: the same rows
    torch.testing.assert_close(one[0], got[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("feature_layer", "select", "depth"),
    [(-2, "full", 1), (-1, "default", 2), ([-2, -1], "default", 2), ([0, 1], "full", 1)],
)
def test_feature_layers_and_strategies(tmp_path, feature_layer, select, depth):
    """Single and concatenated layers, with and without the CLS row; the tower keeps only the
    layers up to the deepest selected one (the others' tensors skipped when loading)."""
    hf = build_llava(feature_layer, select, seed=1)
    ours, cfg = load_hf_model(save_hf_folder(hf, tmp_path), torch.float32, "cpu")
    assert len(ours.vision.tower.layers) == depth
    inputs = pixel_inputs()
    got, want = ours.encode_images(inputs), hf_features(hf, inputs)
    assert got[0].shape[0] == cfg.vision.tokens_per_image
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_bound_tower_keeps_its_numbers(llava):
    """bind makes the tower's and projector's linears with the engine's method (oneDNN's
    packed ones where this torch has them) like every other linear; the features stay HF's."""
    hf, folder, _ = llava
    ours = load_hf_model(folder, torch.float32, "cpu")[0]
    vision = [m for m in ours.vision.modules() if isinstance(m, LoadedLinear)]
    assert len(vision) == 4 * len(ours.vision.tower.layers) + 2
    packs = onednn_packs(torch.float32, torch.device("cpu"))
    report = ours.bind(ModelOps(LayerOps(), ONEDNN_LINEARS if packs else TORCH_LINEARS))
    # each text layer: qkv, o, gate_up, down; and the lm_head
    assert report.linears == len(vision) + 4 * ours.config.num_layers + 1
    assert not any(isinstance(m, LoadedLinear) for m in ours.modules())
    inputs = pixel_inputs()
    for got, want in zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_text_logits_match_transformers(llava):
    """The language model loaded from the nested layout: text-only logits equal HF's."""
    hf, _, ours = llava
    ids = torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(4)).tolist()
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


@torch.no_grad()
def test_prompt_with_an_image_matches_transformers(llava):
    """The image's rows in place of its placeholders' embeddings (CausalLM.forward's embeds):
    the logits of the whole prompt equal HF's forward with the pixel values."""
    hf, _, ours = llava
    inputs = pixel_inputs()[:1]
    ids = [1, 40, 41] + [IMAGE_TOKEN] * 25 + [50, 51, 52, 53]
    want = hf(input_ids=torch.tensor([ids]), pixel_values=inputs[0]["pixel_values"]).logits[0]
    index = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN])
    embeds = ImageEmbeds(index, ours.encode_images(inputs)[0])
    meta = prefill_meta(len(ids), 8)
    kv = new_kv_cache(ours.config, -(-len(ids) // 8), 8)
    attention = TorchPagedAttention().plan(meta)
    hidden = ours(torch.tensor(ids), torch.arange(len(ids)), meta, kv, attention, embeds=embeds)
    got = ours.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert not torch.allclose(got, prefill_logits(ours, ids), atol=1e-3)  # the image counts


def _in_memory(name: str) -> str:
    """A checkpoint name as written by save_pretrained -> the HF model's own parameter name."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def _layout_4_52(name: str) -> str:
    """transformers 4.52-4.57: the nested layout, the tower in CLIPVisionModel's vision_model."""
    return name.replace("model.vision_tower.", "model.vision_tower.vision_model.")


def _layout_old(name: str) -> str:
    """transformers < 4.52 (the Hub's llava-hf folders)."""
    for new, old in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(new):
            return old + name.removeprefix(new)
    return name


@pytest.mark.parametrize("layout", [_layout_4_52, _layout_old], ids=["4.52", "old"])
def test_both_checkpoint_layouts_load(llava, tmp_path, layout):
    """The saved tensors renamed to each layout (the old one with the position_ids buffer that
    checkpoints before transformers 4.31 carry): HF reads the folder back to the same model,
    and so do we."""
    hf, folder, _ = llava
    tensors = {layout(_in_memory(k)): v for k, v in load_file(folder / "model.safetensors").items()}
    assert any(".vision_model." in k for k in tensors)
    if layout is _layout_old:
        positions = torch.arange(26).unsqueeze(0)
        tensors["vision_tower.vision_model.embeddings.position_ids"] = positions
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = load_hf_model(tmp_path, torch.float32, "cpu")[0]
    reread, info = LlavaForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    inputs = pixel_inputs()
    for got, want in zip(ours.encode_images(inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for a, b in zip(hf_features(reread.eval(), inputs), hf_features(hf, inputs), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)  # its default attention: sdpa
    ids = list(range(5, 40))
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_unknown_tower_tensors_are_refused(llava, tmp_path):
    """Only the named unread tensors are skipped: a tower layer beyond the config's count is an
    unexpected weight."""
    _, folder, _ = llava
    tensors = load_file(folder / "model.safetensors")
    layer_1 = {k: v for k, v in tensors.items() if k.startswith("vision_tower.encoder.layers.1.")}
    assert layer_1
    tensors.update({k.replace("layers.1.", "layers.7."): v.clone() for k, v in layer_1.items()})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"unexpected weight 'vision\.tower\.layers\.7\."):
        load_hf_model(tmp_path, torch.float32, "cpu")


def _raw(**changes) -> dict:
    config = LlavaConfig(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE_TOKEN)
    return {**config.to_dict(), **changes}


def test_unsupported_vision_tower_is_refused(tmp_path):
    siglip = SiglipVisionConfig(hidden_size=32, num_attention_heads=4, image_size=30).to_dict()
    with pytest.raises(UnsupportedModelError, match="'siglip_vision_model' vision tower.*CLIP"):
        model_config_from_hf(_raw(vision_config=siglip))
    (tmp_path / "config.json").write_text(json.dumps(_raw(vision_config=siglip)))
    with pytest.raises(UnsupportedModelError, match="clip_vision_model"):
        read_hf_config(tmp_path)
    gemma = dict(TEXT, model_type="gemma")
    with pytest.raises(UnsupportedModelError, match="'gemma' text model.*llama, mistral, qwen2"):
        model_config_from_hf(_raw(text_config=gemma))
    with pytest.raises(ValueError, match="vision_feature_layer"):
        model_config_from_hf(_raw(vision_feature_layer=3))  # 2 layers: 3 hidden states


def test_malformed_sizes_are_refused_before_loading(llava):
    """A placeholder outside the vocabulary, and a tower of more layers than the files hold
    tensors (refused before a model of that many layers is built, even on the meta device)."""
    _, folder, _ = llava
    with pytest.raises(ValueError, match="image_token_index must be an integer from 0 to 319"):
        model_config_from_hf(_raw(image_token_index=VOCAB))
    hostile = _raw(vision_config=dict(VISION, num_hidden_layers=10**9))
    cfg = model_config_from_hf(hostile)
    with pytest.raises(ValueError, match="1000000000 vision tower layers"):
        check_weights(folder, cfg, read_shapes(safetensors_files(folder)))


@pytest.mark.parametrize("select", ["default", "full"])
def test_tokens_per_image_as_llava_processor_counts(select):
    """tokens_per_image equals the placeholders HF's LlavaProcessor expands one image into."""
    cfg = model_config_from_hf(_raw(vision_feature_select_strategy=select)).vision
    assert cfg is not None and cfg.feature_select == select
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    llava_processor = LlavaProcessor(
        image_processor=processor(),
        tokenizer=tokenizer,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy=select,
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    ids = llava_processor(text="a <image> b", images=images()[1], return_tensors="pt")["input_ids"]
    placeholders = int((ids == tokenizer.convert_tokens_to_ids("<image>")).sum())
    assert cfg.tokens_per_image == placeholders == 25 + (select == "full")


@pytest.mark.parametrize("text_type", ["llama", "mistral", "qwen2"])
def test_absent_keys_take_transformers_defaults(text_type):
    """A config.json that states little (as llava-1.5's text_config, or none at all for the
    tower) reads as transformers' LlavaConfig resolves it."""
    raw = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {"model_type": text_type, "vocab_size": 32064},
    }
    ref = LlavaConfig.from_dict(raw)
    text, vision = ref.text_config, ref.vision_config
    cfg = model_config_from_hf(raw)
    assert cfg.family == "llava" and cfg.vision is not None
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.max_position_embeddings) == (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.max_position_embeddings,
    )
    assert cfg.rms_norm_eps == text.rms_norm_eps and cfg.vocab_size == 32064
    assert cfg.tie_word_embeddings == ref.tie_word_embeddings
    assert cfg.eos_token_ids == ((text.eos_token_id,) if text.eos_token_id is not None else ())
    window = getattr(text, "sliding_window", None)
    window = window if getattr(text, "use_sliding_window", True) else None
    assert cfg.sliding_window == window
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
    assert (v.projector_act, v.projector_bias, v.feature_layer, v.feature_select) == (
        ref.projector_hidden_act,
        ref.multimodal_projector_bias,
        (ref.vision_feature_layer,),
        ref.vision_feature_select_strategy,
    )
    assert v.image_token_id == ref.image_token_id
    assert v.tokens_per_image == (vision.image_size // vision.patch_size) ** 2


def test_vision_config_object_and_top_level_keys():
    """A vision_config object takes CLIPVisionConfig's defaults for what it omits; the
    image_token_id spelling wins over image_token_index (as transformers maps it); a tie in
    text_config ties the model."""
    raw = {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "tie_word_embeddings": True},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 48},
        "image_token_index": 7,
        "image_token_id": 9,
        "vision_feature_layer": [-3, -1],
        "multimodal_projector_bias": False,
    }
    ref = LlavaConfig.from_dict(raw)
    cfg = model_config_from_hf(raw)
    assert cfg.vision is not None
    assert cfg.vision.image_token_id == ref.image_token_id == 9
    assert cfg.tie_word_embeddings and ref.tie_word_embeddings
    assert (cfg.vision.num_layers, cfg.vision.image_size, cfg.vision.patch_size) == (
        ref.vision_config.num_hidden_layers,
        ref.vision_config.image_size,
        ref.vision_config.patch_size,
    )
    assert cfg.vision.feature_layer == (-3, -1) and cfg.vision.selected_layers == (10, 12)
    assert not cfg.vision.projector_bias


def test_folder_reads_as_llava(llava):
    """The folder's config and the checks before loading (the model on the meta device, loaded
    from the headers' shapes) accept it, counting the parameters the loaded model holds."""
    _, folder, ours = llava
    cfg = read_hf_config(Path(folder))
    assert cfg.family == "llava" and ours.config.vision == cfg.vision
    assert cfg.vision is not None and cfg.vision.image_token_id == IMAGE_TOKEN
    count = check_weights(folder, cfg, read_shapes(safetensors_files(folder)))
    assert count == sum(p.numel() for p in ours.parameters())
