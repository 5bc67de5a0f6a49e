"""VisionConfig: the numbers of a vision-language checkpoint's image side (its vision tower, the
projector into the language model, and how many placeholder tokens an image takes), read from
config.json with the language model's ModelConfig (llava_config.py, idefics3_config.py,
gemma3_vl_config.py) before any weight."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language checkpoint's vision tower, projector and placeholder numbers."""

    # "clip": LLaVA's CLIP tower; "idefics3": Idefics3's / SmolVLM's SigLIP tower, pixel shuffle
    # and one linear; "qwen2_5_vl": Qwen2.5-VL's windowed vision transformer and patch merger;
    # "gemma3": Gemma 3's SigLIP tower, average pooling, norm and projection
    kind: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP activation (CLIP: quick_gelu)
    # LLaVA's projector_hidden_act (gelu); Idefics3: "linear" (transformers' name for none: its
    # projection is one linear)
    projector_act: str
    projector_bias: bool  # LLaVA's multimodal_projector_bias (default True); Idefics3: False
    # LLaVA's vision_feature_layer as the config states it (an int becomes a 1-tuple): indices
    # into the tower's hidden states (0: the embeddings after the pre-norm, i: after layer i,
    # negative from the end); several are concatenated on the hidden dimension. Idefics3: (-1,),
    # after the tower's final LayerNorm.
    feature_layer: tuple[int, ...]
    feature_select: str  # "default" (the CLS row dropped) | "full" (Idefics3: no CLS row)
    image_token_id: int  # the placeholder token (config's image_token_id / image_token_index)
    # Placeholder rows one image takes in the prompt. Idefics3: one tile's (image_seq_len), of an
    # image_size tile; an image is one or several tiles. Qwen2.5-VL: one merged unit's (1); an
    # image takes as many as its size makes (its grid t * h * w / spatial_merge_size**2).
    tokens_per_image: int
    # Idefics3's pixel shuffle: each row the projection takes is scale_factor x scale_factor
    # neighbouring patches side by side (1: none, LLaVA).
    scale_factor: int = 1
    # Qwen2.5-VL: spatial_merge_size x spatial_merge_size neighbouring patches make one row of
    # the merger's output (1: none); a patch spans temporal_patch_size frames (an image is
    # repeated over them); rows attend within windows of window_size pixels a side, except in
    # the full_attention_layers (fullatt_block_indexes); the 2-D rotary base is rope_theta.
    spatial_merge_size: int = 1
    temporal_patch_size: int = 1
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # Gemma 3: the placeholder (image_token_id, <start_of_image>) stays in the prompt, followed
    # by tokens_per_image `soft_token_id` tokens (<image_soft_token>), which take the encoder
    # rows, and `end_token_id` (<end_of_image>). None: the placeholders take the rows.
    soft_token_id: int | None = None
    end_token_id: int | None = None

    @property
    def selected_layers(self) -> tuple[int, ...]:
        """feature_layer as counts of encoder layers run (0 .. num_layers), in its order."""
        return tuple(i % (self.num_layers + 1) for i in self.feature_layer)


__all__ = ["VisionConfig"]
