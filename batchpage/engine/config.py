"""EngineConfig: the LLM(...) arguments, validated; also the schema of Hydra's `engine` group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchpage.cache.radix_cache import EVICTION_POLICIES
from batchpage.data.images import DEFAULT_MAX_PIXELS, ImageLimits
from batchpage.engine.pooled_states import POOLING_TYPES, TASKS
from batchpage.engine.reasoning import REASONING_PARSERS
from batchpage.ops.select import LINEAR_BACKENDS
from batchpage.speculative.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    dtype: str = "auto"
    block_size: int = 16
    # Bytes (> 1) or a fraction of the memory available after the model loads (<= 1). None: 0.9 of
    # free GPU memory, or 0.1 of available RAM on the CPU.
    kv_cache_memory: float | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # None: 512 on a CPU, 2048 on a GPU (batched_tokens)
    enable_chunked_prefill: bool = True
    prefix_caching: bool = True
    eviction_policy: str = "lru"
    attention_backend: str = "auto"
    # CPU matmuls (batchpage/ops/select.py): "auto" times every implementation that runs here
    # on each linear shape at bind and binds the fastest (cached on disk per CPU, torch and
    # kernel); "avx512_bf16", "cpu_f32", "onednn" and "triton" (batch-invariant; a GPU's) force
    # theirs; "torch" keeps F.linear. Quantized linears are measured among the int
    # implementations under every choice but "torch".
    linear_backend: str = "auto"
    # Every row's logits the same bits whatever else its step holds (the other rows, how its
    # prompt was chunked, a prefix-cache hit, a preemption): linears and attention on kernels
    # that sum in an order fixed by position (ops/select.py, attention/cpu_backend.py; on a GPU
    # the Triton matmul, norms and extend attention: ops/triton_linear.py, triton_backend.py),
    # at some cost in speed (BENCHMARKS.md).
    batch_invariant: bool = False
    # A quantized checkpoint (AWQ, GPTQ, compressed-tensors, a GGUF file's Q4_0/Q4_1/Q8_0/K-quant
    # linears): True keeps its integer weights and runs them quantized (batchpage/quant), the
    # memory first; False dequantizes them all once, at bind, into the engine's dtype; "auto"
    # keeps them quantized but, under linear_backend="auto", holds a layer dense where that is
    # measured faster and the model's dense copy is small beside the memory left
    # (engine/model_runner.py dense_copy_fits), the speed first.
    quantized_weights: bool | str = "auto"
    # Those integer linears quantize each input row to int8 with its own scale (W4A8; a W8A8
    # checkpoint always does): on CPUs with AVX512-VNNI twice the multiply-adds an instruction
    # where many rows run, at the cost of rounding activations, so results differ from bf16's.
    int8_activations: bool = False
    kv_allocator: str = "paged"
    schedule: str = "prefix"
    preemption_mode: str = "recompute"
    seed: int = 0
    device: str = "auto"
    # Ranks the model is split over (model/shard.py): rank 0 in this process, the others where
    # distributed_executor_backend says.
    tensor_parallel_size: int = 1
    # Where ranks 1.. run (vLLM's option of the same name): "mp", processes of this host, one
    # per CUDA device from `device` on, or sharing the host's cores; "ray", Ray actors on the
    # bundles of a placement group (the replica's own under executor=ray, which always uses
    # it; else one the engine makes), on any node of the cluster.
    distributed_executor_backend: str = "mp"
    # Layers split into stages: only 1 (pipeline parallelism is not implemented yet).
    pipeline_parallel_size: int = 1
    # On CUDA, decode steps replay CUDA graphs captured at a ladder of batch sizes up to
    # max_num_seqs (batchpage/engine/decode_graphs.py); True runs every step eagerly (vLLM's
    # option of the same name). Elsewhere steps always run eagerly.
    enforce_eager: bool = False
    # A chat template replacing the model's: a .jinja file or the template text. Read and checked
    # by the tokenizer (batchpage.model.tokenizer.resolve_chat_template); the engine ignores it.
    chat_template: str | None = None
    # A reasoning model's thinking apart from its answer (batchpage/engine/reasoning.py):
    # "qwen3", "deepseek_r1", "mistral", "auto" (from the tokenizer's markers) or None / "none"
    # (the completion holds both, as before).
    reasoning_parser: str | None = None
    # What the model runs for (engine/pooled_states.py TASKS): "auto" is the checkpoint's own
    # (generate for a causal LM, embed for a *Model, classify for *ForSequenceClassification,
    # reward for *ForRewardModel). A pooling task reads each prompt's hidden states at
    # `pooling_type`: last (the last token), mean (all of them), or cls (the first).
    task: str = "auto"
    pooling_type: str = "last"
    # A causal LM as a classifier over some of its tokens (vLLM's classifier_from_token, e.g.
    # Qwen3-Reranker's ["no", "yes"]): two tokens give one label whose logit is their logits'
    # difference (its sigmoid: the second's softmax probability against the first); more
    # give one label each.
    classifier_from_token: list[str] | None = None
    # LoRA adapters per request (vLLM's options): up to max_loras adapters, each of rank up to
    # max_lora_rank, resident at once and run in the same steps as the base model's rows
    # (batchpage/lora). Off: a request with an adapter is refused.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Speculative decoding in vLLM's shape (batchpage/speculative/config.py, engine/drafts.py):
    # {"method": "ngram" | "suffix", "num_speculative_tokens": k, ...}; None: off. Drafts come
    # from the sequence's own tokens (ngram) or the job's earlier outputs too (suffix), and are
    # verified in the one forward, so greedy and seeded rows take the tokens they take without.
    # Typed Any: Hydra cannot set a mapping on an empty typed one (as storage.s3).
    speculative_config: Any = None
    # A vision-language model's encoder rows kept by image content between steps (engine/
    # encoder_cache.py), in GiB: an image used again (more questions about it, more samples,
    # a recomputed prompt) is encoded once while its rows fit.
    encoder_cache_gb: float = 1.0
    # A folder that keeps those rows across runs (engine/encoder_files.py), per vision tower and
    # image: a rerun or a resumed job encodes no picture it encoded before. None: memory only.
    encoder_cache_dir: str | None = None
    # Images the API is given as paths, URLs or bytes (batchpage/prompt_images.py): at most
    # this many pixels each (checked before decoding), and http(s) URLs fetched only when
    # allowed (vLLM fetches them; an offline job should not reach the network unasked).
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    allow_image_http: bool = False

    def __post_init__(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")

        def at_least(name: str, low: int) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")

        choice("dtype", ("auto", *DTYPES))
        choice("eviction_policy", EVICTION_POLICIES)
        choice("attention_backend", ("auto", "torch", "triton", "cpu"))
        choice("linear_backend", LINEAR_BACKENDS)
        choice("kv_allocator", ("paged", "static"))
        choice("schedule", ("prefix", "fcfs"))
        choice("preemption_mode", ("recompute", "swap"))
        choice("distributed_executor_backend", ("mp", "ray"))
        if self.reasoning_parser is not None:
            choice("reasoning_parser", REASONING_PARSERS)
        choice("task", TASKS)
        choice("pooling_type", POOLING_TYPES)
        tokens = self.classifier_from_token
        if tokens is not None and (len(tokens) < 2 or not all(isinstance(t, str) for t in tokens)):
            raise ValueError(
                "classifier_from_token must list two or more tokens (e.g. [no, yes]); got "
                f"{tokens!r}"
            )
        if self.batch_invariant and self.attention_backend == "torch":
            raise ValueError(
                "batch_invariant=True runs on the C++ (CPU) or Triton (GPU) attention kernels, "
                "not attention_backend='torch': use attention_backend='auto'"
            )
        at_least("block_size", 1)
        at_least("max_image_pixels", 1)
        if not self.encoder_cache_gb >= 0:
            raise ValueError(f"encoder_cache_gb must be >= 0; got {self.encoder_cache_gb!r}")
        at_least("max_num_seqs", 1)
        at_least("max_model_len", 1)
        at_least("max_num_batched_tokens", 1)
        at_least("tensor_parallel_size", 1)
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size}: pipeline parallelism is "
                "not supported yet; split the model with tensor_parallel_size instead"
            )
        if self.tensor_parallel_size > 1 and self.classifier_from_token is not None:
            raise ValueError(
                "classifier_from_token reads the whole lm_head, which tensor parallelism splits: "
                "use tensor_parallel_size=1"
            )
        at_least("max_loras", 1)
        at_least("max_lora_rank", 1)
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora with tensor_parallel_size > 1 is not supported yet: use "
                "tensor_parallel_size=1, or executor=ray replicas to use more devices"
            )
        if self.enable_lora and self.batch_invariant:
            raise ValueError(
                "enable_lora with batch_invariant=True is not supported yet: an adapter's rows "
                "are multiplied in groups whose size depends on the batch; drop one of them"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                "kv_cache_memory must be a byte count (> 1) or a fraction of free memory in "
                f"(0, 1]; got {self.kv_cache_memory!r}"
            )
        if self.quantized_weights not in (True, False, "auto"):
            raise ValueError(
                f"quantized_weights must be true, false or auto; got {self.quantized_weights!r}"
            )
        if self.int8_activations and self.quantized_weights is False:
            raise ValueError(
                "int8_activations applies to quantized weights: set quantized_weights=True, or "
                "drop int8_activations"
            )
        if self.speculative_config:
            self.speculative()  # a bad option is a ValueError naming it
            if self.kv_allocator == "static":
                raise ValueError(
                    "speculative_config needs kv_allocator='paged' (a row's drafts take slots "
                    "past its reservation)"
                )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if self.attention_backend == "cpu" and self.device.startswith("cuda"):
            raise ValueError(
                "attention_backend='cpu' runs the C++ kernel on CPU tensors; with "
                f"device={self.device!r} use attention_backend='auto' or 'triton'"
            )

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, checked (None: off)."""
        options = self.speculative_config
        return SpeculativeConfig.from_dict(dict(options)) if options else None

    @property
    def num_speculative_tokens(self) -> int:
        """The drafts a row may run after its newest token (0: speculative decoding is off)."""
        spec = self.speculative()
        return 0 if spec is None else spec.num_speculative_tokens

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def image_limits(self) -> ImageLimits:
        """What an image given to the API may be (batchpage/data/images.py)."""
        return ImageLimits(max_pixels=self.max_image_pixels, allow_http=self.allow_image_http)

    def batched_tokens(self, device: torch.device) -> int:
        """The step's token budget. Every running decode waits for the whole step, prompt chunks
        included: a CPU computes prompt tokens slowly enough that 2048 of them would make each
        step, and so each decoded token, take seconds, and progress would seem frozen; 512
        keeps a CPU step short at nearly the same matmul efficiency, while a GPU takes 2048 in
        a step of milliseconds."""
        default = 512 if device.type == "cpu" else 2048
        return self.max_num_batched_tokens or max(default, self.max_num_seqs)
