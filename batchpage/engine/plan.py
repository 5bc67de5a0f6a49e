"""plan_engine: what an engine will be (device, dtype, max_model_len, KV blocks), from the config
and the model's config alone. LLM(...) and the job both call it, so a bad setting or a pool too
small fails here, before any weight is read, and both agree on every figure."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.config import EngineConfig
from batchpage.engine.pooled_states import resolve_task
from batchpage.host_memory import available_host_memory
from batchpage.model.config import ModelConfig
from batchpage.model.gguf_file import read_gguf_header
from batchpage.model.gguf_loader import int_schemes
from batchpage.model.loader import ModelSource, resolve_dtype
from batchpage.model.shard import shard_config
from batchpage.ops.select import check_batch_invariant
from batchpage.quant.scheme import QuantScheme


class PoolTooSmall(ValueError):
    pass


@dataclass(frozen=True)
class EnginePlan:
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # positions per sequence, prompt and completion together
    num_blocks: int  # KV blocks in the pool
    kv_cache_bytes: int  # the budget the blocks were cut from
    task: str = "generate"  # EngineConfig.task resolved against the checkpoint's head


def plan_engine(cfg: EngineConfig, source: ModelSource) -> EnginePlan:
    """Raises ValueError (PoolTooSmall for the pool) naming the setting to change. With
    max_model_len unset and a pool too small for the model's whole context, max_model_len is
    capped to what the pool holds, with a warning, rather than refused."""
    model_cfg = source.config
    task = resolve_task(cfg.task, model_cfg.head, cfg.classifier_from_token is not None)
    device = cfg.resolved_device()
    dtype = resolve_dtype(cfg.dtype, model_cfg, device)
    limit = model_cfg.max_model_len  # positions the model's rope supports
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit} "
            "positions (max_position_embeddings, extended by its rope scaling): lower "
            "max_model_len"
        )
    if cfg.batch_invariant:  # refused here, not once the weights are bound
        check_batch_invariant(cfg.linear_backend, dtype, device)
    world = cfg.tensor_parallel_size
    check_tensor_parallel(cfg, source, dtype)
    # Each rank holds every block for its share of the K/V heads; ranks on one host (a CPU)
    # share its memory, ranks on their own devices each have a device's.
    rank_cfg = shard_config(model_cfg, world)
    per_block = bytes_per_block(
        model_cfg.num_layers, cfg.block_size, rank_cfg.num_kv_heads, model_cfg.head_dim, dtype
    )
    ranks_here = world if device.type == "cpu" else 1
    weight_bytes = source.num_weights * dtype.itemsize * ranks_here // world
    budget = kv_cache_bytes(cfg.kv_cache_memory, device, weight_bytes)
    num_blocks = budget // (per_block * ranks_here)
    max_model_len = cfg.max_model_len or limit
    needed = -(-max_model_len // cfg.block_size)
    if num_blocks < needed and cfg.max_model_len is None and num_blocks > 0:
        max_model_len = _capped_length(num_blocks * cfg.block_size, cfg.block_size)
        warnings.warn(
            f"the KV pool ({budget / 2**20:.1f} MiB = {num_blocks} blocks of {cfg.block_size} "
            f"tokens) cannot hold one sequence of the model's full context ({limit} tokens): "
            f"max_model_len is set to {max_model_len}; raise kv_cache_memory for longer "
            "sequences, or set max_model_len to choose",
            stacklevel=1,  # one place whoever calls (the job plans twice): shown once per process
        )
    elif num_blocks < needed:
        raise PoolTooSmall(
            f"the KV pool ({budget / 2**20:.1f} MiB = {num_blocks} blocks of {cfg.block_size} "
            f"tokens) cannot hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed} blocks, {needed * per_block / 2**20:.1f} MiB): raise kv_cache_memory or "
            "lower max_model_len"
        )
    return EnginePlan(device, dtype, max_model_len, num_blocks, budget, task)


# What a worker process holds besides its share of the weights (the interpreter, torch, the
# loaders): a worker's resident memory with the tests' tiny model, rounded up.
WORKER_BASE_BYTES = 512 << 20


def check_tensor_parallel(cfg: EngineConfig, source: ModelSource, dtype: torch.dtype) -> None:
    """What tensor parallelism cannot run (yet, or here), refused before any worker starts or
    weight loads, every reason in one message."""
    world = cfg.tensor_parallel_size
    if world == 1:
        return
    problems = []
    if source.config.vision is not None:
        problems.append(
            "a vision-language model runs on one device for now: use tensor_parallel_size=1 "
            "(and replicas, executor=ray, for more devices)"
        )
    # Only where every weight must stay quantized: else a share that is not whole groups loads
    # dense (model/quant_layout.py rank_holds).
    quant = source.config.quant
    if quant is not None and cfg.quantized_weights is True:
        problems += _quantized_split(quant, source.config, world)
    if source.kind == "gguf" and cfg.quantized_weights is True:
        schemes = int_schemes(read_gguf_header(source.path), source.config).values()
        if schemes:  # its widest groups decide where the inputs may be cut
            problems += _quantized_split(max(schemes, key=lambda q: q.group_size or 0),
                                         source.config, world)  # fmt: skip
    try:
        shard_config(source.config, world)
    except ValueError as e:
        problems.append(str(e).removeprefix(f"tensor_parallel_size={world} "))
    device = cfg.resolved_device()
    if device.type == "cuda":
        first = device.index or 0
        if first + world > torch.cuda.device_count():
            problems.append(
                f"it needs CUDA devices {first}..{first + world - 1}, and this machine has "
                f"{torch.cuda.device_count()}: lower tensor_parallel_size"
            )
    elif cfg.distributed_executor_backend == "mp":  # Ray places its ranks where there is room
        problems += _host_room_for_ranks(world, source.num_weights * dtype.itemsize)
    if problems:
        raise ValueError(f"tensor_parallel_size={world}: " + "; and ".join(problems))


def _quantized_split(quant: QuantScheme, config: ModelConfig, world: int) -> list[str]:
    """What keeps a quantized checkpoint from splitting over `world` ranks. Column-parallel
    linears (q/k/v, gate/up, the head) split their output rows, which any scheme allows; the
    row-parallel ones (o_proj, down_proj) split their inputs, which must fall on whole groups
    (or FP8 blocks) of `group_size` inputs, unless they are held dense: under GPTQ's act order
    (desc_act), whose groups follow g_idx across the whole input (model/quant_layout.py)."""
    group = quant.group_size
    if group is None or quant.act_order:
        return []
    inputs = {"o_proj": config.num_heads * config.head_dim, "down_proj": config.intermediate_size}
    return [
        f"{name}'s {k} inputs in groups of {group} ({k // group} groups) do not split into "
        f"{world} shares of whole groups under quantized_weights=true: use a "
        f"tensor_parallel_size that divides {k // group}, or quantized_weights=auto (those "
        "shares then load dense)"
        for name, k in inputs.items()
        if k % (world * group)
    ]


def ranks_over_cores(world: int) -> str | None:
    """What to tell the user when `world` ranks on this host's CPU outnumber its cores (the
    process's affinity): they still run (each rank gets one thread at least), only slower than
    fewer. None when they do not. The ranks' starter logs it, once per engine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cores or world <= cores:
        return None
    return (
        f"tensor_parallel_size={world} puts {world} ranks on {cores} cores: they share them, "
        f"which runs slower than tensor_parallel_size<={cores} on this CPU"
    )


def _host_room_for_ranks(world: int, weight_bytes: int) -> list[str]:
    """On a CPU the ranks share the host: refused when the workers and the weights do not fit
    its available memory (more ranks than cores only run slower: `ranks_over_cores`)."""
    need = (world - 1) * WORKER_BASE_BYTES + weight_bytes
    free = available_host_memory()
    if need <= free:
        return []
    fits = max(1, (free - weight_bytes) // WORKER_BASE_BYTES + 1)
    return [
        f"its {world - 1} worker processes and the weights need about {need / 2**30:.1f} GiB "
        f"and this machine has {free / 2**30:.1f} GiB available: use tensor_parallel_size <= "
        f"{fits} here (or 1: on one CPU a single rank uses every core)"
    ]


def _capped_length(tokens: int, block_size: int) -> int:
    """The longest sequence a pool of `tokens` slots holds, rounded down to a power of two (at
    least one block): a rerun on a machine with a little more or less memory free then plans
    the same length, and the job's fingerprint, which holds it, still matches."""
    return max(block_size, 1 << (tokens.bit_length() - 1))


def available_memory(device: torch.device) -> int:
    """Bytes free for the engine on `device`: the GPU's free memory, or the host's available
    memory (host_memory.available_host_memory: MemAvailable, not MemFree)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def kv_cache_bytes(
    kv_cache_memory: float | None, device: torch.device, weight_bytes: int = 0
) -> int:
    """The KV pool's budget. Bytes (> 1) as given; a fraction: that share of the memory left
    once the model's weights (`weight_bytes`, not loaded yet) are counted out of the available
    memory; None: 0.9 of it on a GPU, 0.1 on the CPU. Raises ValueError naming the fix when the
    weights alone, or the weights and the bytes given, exceed the available memory."""
    available = available_memory(device)
    where = "GPU memory free" if device.type == "cuda" else "memory available (MemAvailable)"
    if weight_bytes > available:
        raise ValueError(
            f"the model's weights take {_mib(weight_bytes)} at this dtype, more than the "
            f"{_mib(available)} of {where}: use a smaller model or dtype, or free memory"
        )
    left = available - weight_bytes
    if kv_cache_memory is not None and kv_cache_memory > 1:
        if kv_cache_memory > left:
            raise PoolTooSmall(
                f"kv_cache_memory={int(kv_cache_memory)} bytes ({_mib(kv_cache_memory)}) and "
                f"the weights ({_mib(weight_bytes)}) exceed the {_mib(available)} of {where}: "
                "lower kv_cache_memory (or give a fraction, e.g. 0.5)"
            )
        return int(kv_cache_memory)
    fraction = (
        kv_cache_memory if kv_cache_memory is not None else (0.9 if device.type == "cuda" else 0.1)
    )
    return int(left * fraction)


def _mib(size: float) -> str:
    return f"{size / 2**20:,.1f} MiB"
