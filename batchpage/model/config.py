"""ModelConfig: the architecture numbers of a decoder, and the one table that says which model
family runs each checkpoint type.

A ModelConfig is read from a HF config.json (hf_config.py) or a GGUF header (gguf_loader.py)
without touching any weight, so an unsupported checkpoint is refused before loading starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from batchpage.errors import UnsupportedModelError
from batchpage.model.vision_config import VisionConfig

if TYPE_CHECKING:
    from batchpage.quant.scheme import QuantScheme

# The one table: checkpoint type -> model family (the family's class is in families.py).
# Keys are ("hf", config.json model_type) or ("gguf", general.architecture).
FAMILIES: dict[tuple[Literal["hf", "gguf"], str], str] = {
    ("hf", "llama"): "llama",
    ("hf", "mistral"): "llama",
    ("hf", "qwen2"): "llama",
    ("hf", "qwen3"): "qwen3",
    ("hf", "phi3"): "phi3",
    ("hf", "qwen3_moe"): "qwen3_moe",
    ("hf", "mixtral"): "mixtral",
    ("hf", "gemma2"): "gemma2",
    ("hf", "gemma3_text"): "gemma3",
    # the multimodal folder, images too; without a vision_config its text model alone, as
    # "gemma3" (gemma3_vl_config.py)
    ("hf", "gemma3"): "gemma3_vl",
    ("hf", "llava"): "llava",  # a CLIP tower + projector before a llama/mistral/qwen2 model
    ("hf", "idefics3"): "idefics3",  # a SigLIP tower + pixel shuffle before a llama model
    ("hf", "smolvlm"): "idefics3",  # Idefics3's layout and numbers under another name
    # A windowed vision transformer + patch merger before a qwen2 model with M-RoPE positions
    ("hf", "qwen2_5_vl"): "qwen2_5_vl",
    ("gguf", "llama"): "llama",
    ("gguf", "qwen2"): "llama",
    ("gguf", "qwen3"): "qwen3",
    ("gguf", "gemma2"): "gemma2",
    ("gguf", "gemma3"): "gemma3",
}


def family_for(kind: Literal["hf", "gguf"], name: str | None) -> str:
    """The family that runs checkpoint type `name`; raises UnsupportedModelError naming the
    supported ones."""
    family = FAMILIES.get((kind, str(name)))
    if family is None:
        what = (
            f"model_type {name!r} in config.json" if kind == "hf" else f"GGUF architecture {name!r}"
        )
        known = ", ".join(n for k, n in FAMILIES if k == kind)
        raise UnsupportedModelError(
            f"unsupported {what}: batchpage runs {known}; use a checkpoint of one of these "
            "architectures"
        )
    return family


@dataclass(frozen=True)
class HeadConfig:
    """What runs on the final norm's output, from config.json's `architectures`:

    lm      the vocabulary's logits (a causal LM: *ForCausalLM and the rest)
    none    nothing: the hidden states are the output (an embedding checkpoint, *Model)
    linear  `score`, hidden -> num_labels without bias (*ForSequenceClassification)
    mlp     `score.0` (hidden -> hidden), ReLU, `score.2` (hidden -> num_labels), with biases
            (*ForRewardModel, Qwen2.5-Math-RM's layout)
    """

    kind: str = "lm"
    num_labels: int = 0
    labels: tuple[str, ...] = ()  # id2label in id order; () when the config names none
    # Matryoshka embeddings (`is_matryoshka`, `matryoshka_dimensions`): the output sizes that
    # keep their meaning when truncated; () with matryoshka=True allows any.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    @property
    def pools(self) -> bool:
        """Whether the checkpoint is a pooling model (its outputs are not next-token logits)."""
        return self.kind != "lm"


@dataclass(frozen=True)
class RopeScaling:
    """A rope variant beyond plain RoPE, with every default already resolved.

    kind: linear | dynamic | yarn | llama3 | longrope | freq_factors (a GGUF's rope_freqs tensor,
    which llama.cpp stores in place of llama3's parameters). `original_max_position_embeddings`
    is the pretraining length the variant scales from (for dynamic: max_position_embeddings).
    """

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn, longrope: None = the variant's default
    short_factor: tuple[float, ...] = ()  # longrope, per frequency
    long_factor: tuple[float, ...] = ()  # longrope
    freq_factors: tuple[float, ...] = ()  # freq_factors: inv_freq is divided by these


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool  # renormalize the top-k router probabilities to sum to 1
    # Per layer: True routes to experts; False runs a dense MLP of ModelConfig.intermediate_size.
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: str = "llama"  # a key of families.MODEL_CLASSES
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_dim: int = 0  # leading dimensions of each head that rope rotates; 0: all of them
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window size per layer (None: full attention); () when no layer has a window.
    # Every attention backend applies it (attention/backend.py), so windows cap no length.
    layer_windows: tuple[int | None, ...] = ()
    moe: MoEConfig | None = None
    attn_scale: float | None = None  # multiplies q.k; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # the same on the output logits
    # Rope base of the layers with a sliding window, which also skip rope_scaling (Gemma 3's
    # local layers); None: every layer uses rope_theta and rope_scaling.
    local_rope_theta: float | None = None
    model_type: str = "llama"  # the checkpoint's own name for its architecture
    torch_dtype: str | None = None  # the checkpoint's own dtype name, used by dtype="auto"
    # The checkpoint's quantization_config (batchpage/quant/scheme.py); None: float weights.
    quant: QuantScheme | None = None
    head: HeadConfig = HeadConfig()
    # A vision-language checkpoint's image side; None: a text model.
    vision: VisionConfig | None = None
    # M-RoPE (Qwen2.5-VL): positions are 3-D (temporal, height, width; model/mrope.py), and the
    # rotary half-dimensions go to the axes in sections of these sizes, in turn (summing to
    # rotary_dim / 2); (): plain 1-D positions.
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)  # frozen: set once, here
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        bad = [f"{n}={getattr(self, n)}" for n in sizes if getattr(self, n) <= 0]
        if bad:
            raise ValueError(f"model sizes must be positive: {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary dimension {self.rotary_dim} must be even, positive and at most "
                f"head_dim={self.head_dim}"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if self.mrope_section and (
            sum(self.mrope_section) != self.rotary_dim // 2 or min(self.mrope_section) <= 0
        ):
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must be positive sizes that sum to "
                f"half the rotary dimension, {self.rotary_dim // 2}"
            )
        if self.moe and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(
                f"{len(self.moe.sparse_layers)} MoE flags for {self.num_layers} layers"
            )

    @property
    def sliding_window(self) -> int | None:
        """The smallest window of any layer, or None when every layer attends to everything."""
        return min((w for w in self.layer_windows if w), default=None)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def context_limit(self) -> int:
        """Positions the rope supports: max_position_embeddings, extended by linear, dynamic and
        yarn scaling (llama3 and longrope checkpoints state their extended length themselves)."""
        s = self.rope_scaling
        if s is None or s.kind not in ("linear", "dynamic", "yarn"):
            return self.max_position_embeddings
        scaled = int(
            (s.original_max_position_embeddings or self.max_position_embeddings) * s.factor
        )
        return max(self.max_position_embeddings, scaled)

    @property
    def max_model_len(self) -> int:
        """The longest context this checkpoint supports without leaving its trained regime."""
        return self.context_limit


__all__ = [
    "FAMILIES",
    "HeadConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "UnsupportedModelError",
    "VisionConfig",
    "family_for",
]
