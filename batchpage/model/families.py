"""Family name -> the class that runs it. Which checkpoint types belong to which family is the
table in config.py; this only names each family's class."""

from __future__ import annotations

import torch

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from batchpage.model.gemma3_vl import Gemma3ForConditionalGeneration
from batchpage.model.idefics3 import Idefics3ForConditionalGeneration
from batchpage.model.llama import LlamaForCausalLM
from batchpage.model.llava import LlavaForConditionalGeneration
from batchpage.model.mixtral import MixtralForCausalLM
from batchpage.model.phi3 import Phi3ForCausalLM
from batchpage.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from batchpage.model.qwen3 import Qwen3ForCausalLM
from batchpage.model.qwen3_moe import Qwen3MoeForCausalLM
from batchpage.model.shard import TensorShard, shard_config

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    cls.family: cls
    for cls in (
        LlamaForCausalLM,
        Qwen3ForCausalLM,
        Phi3ForCausalLM,
        Qwen3MoeForCausalLM,
        MixtralForCausalLM,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        LlavaForConditionalGeneration,
        Idefics3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Gemma3ForConditionalGeneration,
    )
}


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    shard: TensorShard | None = None,
) -> CausalLM:
    """The family's model for `cfg` (with `shard`, one tensor-parallel rank's share of it),
    parameters uninitialized until `load_weights`."""
    shard = shard or TensorShard()
    return MODEL_CLASSES[cfg.family](
        shard_config(cfg, shard.world),
        dtype=dtype,
        device=device,
        max_positions=max_positions,
        shard=shard,
    )
