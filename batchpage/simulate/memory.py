"""The memory a job takes on a device, in parts, and the KV pool the engine would cut there.

On this machine the pool is the engine plan's (plan_engine: the very blocks LLM(...) allocates)
and the weights are what the checkpoint's headers count at the dtype (or, once a calibration
has loaded the model, what the loaded model holds). On a named GPU the pool is what plan_engine
would cut from the datasheet's memory: kv_cache_memory's bytes as given, or its fraction (0.9
unset) of what the weights leave. A CPU pool's pages are resident as its blocks are first
written, each of its tensors (a K and a V per layer) in whole 2 MiB pages where huge pages are
advised (host_memory.py). The step's working memory is measured on a calibrated CPU (what the engine
held beyond its weights and K/V pages after the calibration's steps: activations the allocator
keeps, kernel buffers and libraries: simulate/calibrate.py), and modelled where it is not: the
largest step's hidden states through one layer at a time (the residual, the normed copy,
q/k/v, the attention output, the MLP's gate/up and activation) and the logits of the rows that
sample (float32).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.config import EngineConfig
from batchpage.engine.plan import WORKER_BASE_BYTES, EnginePlan, _capped_length
from batchpage.host_memory import huge_pages_advisable
from batchpage.model.config import ModelConfig
from batchpage.model.loader import ModelSource, resolve_dtype
from batchpage.model.shard import shard_config
from batchpage.simulate.devices import DeviceSpec

# What a CUDA process holds on its device before the engine allocates (the context, cuBLAS's
# workspace): an allowance, in the order of what such a context takes.
CUDA_CONTEXT_BYTES = 768 << 20
_HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels


@dataclass(frozen=True)
class Pool:
    """The KV pool an engine gets on a device, per rank."""

    num_blocks: int
    block_bytes: int  # one block's K/V on one rank
    max_model_len: int
    batched_tokens: int  # max_num_batched_tokens there
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class Memory:
    """Bytes at the job's peak, per device (a rank's share on a GPU; the host's on a CPU)."""

    weights: int
    kv_pool: int
    activations: int
    workers: int  # tensor-parallel worker processes on the host (CPU ranks)
    runtime: int  # the process itself (interpreter, torch, tokenizer), or a CUDA context
    device_memory: int  # what the device has

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.activations + self.workers + self.runtime

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def weight_bytes(source: ModelSource, dtype: torch.dtype) -> int:
    """The weights at the dtype, from the checkpoint's headers (what plan_engine sizes with)."""
    return source.num_weights * dtype.itemsize


def activation_bytes(cfg: ModelConfig, tokens: int, rows: int, dtype: torch.dtype, tp: int) -> int:
    """The largest step's activations on one rank (see the module's docstring)."""
    rank = shard_config(cfg, tp)
    per_token = (
        3 * cfg.hidden_size
        + (rank.num_heads + 2 * rank.num_kv_heads) * cfg.head_dim
        + 3 * rank.intermediate_size
    )
    return tokens * per_token * dtype.itemsize + rows * cfg.vocab_size * 4


def plan_pool(plan: EnginePlan, cfg: EngineConfig, model: ModelConfig) -> Pool:
    """This machine's pool: the engine plan's."""
    rank = shard_config(model, cfg.tensor_parallel_size)
    block = bytes_per_block(model.num_layers, cfg.block_size, rank.num_kv_heads, model.head_dim,
                            plan.dtype)  # fmt: skip
    return Pool(plan.num_blocks, block, plan.max_model_len, cfg.batched_tokens(plan.device),
                plan.dtype)  # fmt: skip


def device_pool(cfg: EngineConfig, source: ModelSource, spec: DeviceSpec, tp: int) -> Pool | str:
    """The pool plan_engine would cut on `tp` of `spec` (a GPU) for this engine config, or why
    the model does not fit there (its weights at the dtype the engine picks there)."""
    model = source.config
    gpu = torch.device("cuda")
    dtype = resolve_dtype(cfg.dtype, model, gpu)
    weights = weight_bytes(source, dtype)
    try:
        rank = shard_config(model, tp)
    except ValueError as e:
        return str(e)
    block = bytes_per_block(model.num_layers, cfg.block_size, rank.num_kv_heads, model.head_dim,
                            dtype)  # fmt: skip
    left = spec.memory - CUDA_CONTEXT_BYTES - weights // tp
    if left <= 0:
        return f"the weights ({weights / 2**30:.1f} GiB) do not fit {tp} x {spec.name}"
    given = cfg.kv_cache_memory
    budget = int(given) if given is not None and given > 1 else int(left * (given or 0.9))
    if budget > left:
        return f"kv_cache_memory={int(budget)} and the weights exceed a {spec.name}'s memory"
    num_blocks = budget // block
    limit = cfg.max_model_len or model.max_model_len
    needed = -(-limit // cfg.block_size)
    if num_blocks < needed:
        if cfg.max_model_len is not None or num_blocks == 0:
            return f"the pool ({num_blocks} blocks) cannot hold one sequence of {limit} tokens"
        limit = _capped_length(num_blocks * cfg.block_size, cfg.block_size)
    return Pool(num_blocks, block, limit, cfg.batched_tokens(gpu), dtype)


def host_runtime_bytes() -> int:
    """This process's resident memory now (/proc/self/statm): the interpreter, torch and the
    tokenizer that a job's process holds before its weights and pool."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes(status: Path | None = None) -> int | None:
    """This process's peak resident memory so far (VmHWM of /proc/self/status, `status` to read
    another file), None where it cannot be read. Not getrusage's or wait4's ru_maxrss: a process
    started by fork or vfork then exec counts its parent's resident pages before the exec there,
    so a job started from a large process (a test runner, a notebook) would report that
    process's peak as its own."""
    try:
        text = (status or Path("/proc/self/status")).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def touched_pool_bytes(pool: Pool, blocks: int, tensors: int, huge: bool) -> int:
    """The resident bytes of a CPU pool (one rank's) whose first `blocks` blocks were written,
    spread over its `tensors` mappings (a K and a V per layer), each in whole 2 MiB pages where
    `huge` pages are advised."""
    per_tensor = blocks * pool.block_bytes // tensors
    if huge:
        whole = pool.num_blocks * pool.block_bytes // tensors
        per_tensor = min(whole, -(-per_tensor // _HUGE_PAGE) * _HUGE_PAGE)
    return per_tensor * tensors


def job_memory(
    pool: Pool, cfg: EngineConfig, model: ModelConfig, weights: int, spec: DeviceSpec, tp: int,
    runtime: int | None = None, blocks_used: int | None = None, engine: int | None = None,
) -> Memory:  # fmt: skip
    """The peak: on the host (`runtime`: the process's own bytes, for a CPU engine: every
    rank's share, the workers), or on each of `tp` GPUs (None: one rank's share and a CUDA
    context). A CPU pool's pages are backed as its blocks are first written, and the pool
    hands out blocks first in, first out, so a job that allocates `blocks_used` blocks in all
    (None: unknown) holds that many of the pool's, at most all of them. `engine`: the step's
    working memory as a calibration measured it (None: modelled)."""
    rows = cfg.max_num_seqs
    act = activation_bytes(model, pool.batched_tokens, rows, pool.dtype, tp)
    if runtime is not None:
        touched = pool.num_blocks if blocks_used is None else min(pool.num_blocks, blocks_used)
        huge = huge_pages_advisable()
        # CPU ranks share the host: each its heads' share
        kv = touched_pool_bytes(pool, touched, 2 * model.num_layers, huge) * tp
        workers = (tp - 1) * WORKER_BASE_BYTES
        working = act * tp if engine is None else engine
        return Memory(weights, kv, working, workers, runtime, int(spec.memory))
    return Memory(weights // tp, pool.bytes, act, 0, CUDA_CONTEXT_BYTES, int(spec.memory))
