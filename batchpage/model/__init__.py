"""The model families (shared layers + one file per family), their HF/GGUF loaders and the
tokenizer."""

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig, UnsupportedModelError
from batchpage.model.llama import LlamaForCausalLM
from batchpage.model.loader import (
    BUNDLED_MODELS,
    LoadedModel,
    ModelSource,
    load_model,
    resolve_dtype,
    resolve_model_source,
)
from batchpage.model.tokenizer import Tokenizer

__all__ = [
    "BUNDLED_MODELS",
    "CausalLM",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelSource",
    "Tokenizer",
    "UnsupportedModelError",
    "load_model",
    "resolve_dtype",
    "resolve_model_source",
]
