"""Pieces shared by the paged attention kernels: the K/V tile gather, the online-softmax step, and
the launchers' argument checks.

Scores are kept in base-2 units (s * scale * log2(e)) so the kernels can use exp2, which is one
hardware instruction; the log-sum-exp values that leave a kernel (split-KV partials) are base-2
too, and the merge kernel reads them as such.

Triton decides at decoration time, when a kernel is defined, whether @triton.jit compiles for a
GPU or runs in its numpy interpreter. Without CUDA nothing could compile, so this module, which
every Triton kernel module imports before triton, turns the interpreter on (unless
TRITON_INTERPRET is already set either way): the same kernels then run, slowly, on CPU tensors.
Triton's own standard library is decorated when triton is first imported, so where another
library imported it first (transformers does) TRITON_INTERPRET=1 must be in the environment
(the tests' conftest sets it); check_runnable says so. (batchpage.kernels has no __init__.py: the
checkout's top-level kernels/ folder must not be a regular package, or run from the checkout's
root it would be found under the name of Hugging Face's `kernels`, which transformers imports.)
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the interpreter switch above)
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
# Whether the kernels run in Triton's interpreter (see `dot`): fixed when the module loads, as
# Triton's own choice is.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# Smallest tile edge tl.dot accepts on NVIDIA GPUs (M, N and K must each be >= 16).
MIN_DOT = 16
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def padded_dim(n: int) -> int:
    """A tl.arange length that covers n and is a legal tl.dot edge."""
    return max(MIN_DOT, next_pow2(n))


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through TF32 on Ampere+ (10-bit mantissa), which does not
    # match the float32 torch reference; half types ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_runnable(kernel: object, device: torch.device) -> None:
    """Fail with the fix in the message instead of an obscure driver error."""
    if device.type == "cuda":
        return
    fix = "set TRITON_INTERPRET=1 in the environment, before anything imports triton"
    if type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); on CPU they run only under the "
            f"interpreter: {fix}"
        )
    if type(tl.standard.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "Triton was imported (by transformers, or another library) before batchpage turned "
            f"its interpreter on, so its standard library cannot run on a CPU: {fix}"
        )


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Both pools [num_blocks, block_size, num_kv_heads, head_dim], same layout, unit head_dim
    stride (the kernels compute the last dimension's offsets as plain arange)."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    assert k_cache.dim() == 4, f"k_cache must be {layout}, got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"{tuple(k_cache.shape)} != {tuple(v_cache.shape)}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES, k_cache.dtype
    assert k_cache.device == v_cache.device
    # One set of offsets serves K and V, and the head_dim offsets are a plain arange.
    assert k_cache.stride() == v_cache.stride(), f"{k_cache.stride()} != {v_cache.stride()}"
    assert k_cache.stride(-1) == 1, "head_dim must be contiguous"
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_block_table(block_table: torch.Tensor, batch: int, device: torch.device) -> None:
    assert block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}"
    assert block_table.dim() == 2 and block_table.shape[0] == batch, tuple(block_table.shape)
    assert block_table.stride(1) == 1, "block_table rows must be contiguous"
    assert block_table.device == device


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b in float32 ([M, K] @ [K, N]), each output summed over k the same way whatever its
    row's place in the tile: what batch invariance needs of tl.dot. On a GPU that is tl.dot. In
    the interpreter tl.dot is numpy's matmul, whose BLAS may not: OpenBLAS's AVX2 kernels sum
    some rows of a tile in another order than others, so a row alone (a decode row at the tile's
    top) and the same row mid-tile (a chunk of a prompt) came out different in their last bits
    on an AVX2 CPU. There the products are summed over k in order, one row as any other."""
    if INTERPRETED:
        products = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        return tl.sum(products, axis=1)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def paged_token_offsets(
    table_row_ptr,  # int32 [max_blocks]: one sequence's block table row
    offs_n,  # [BLOCK_N] token positions in the sequence
    n_mask,  # [BLOCK_N] positions that exist
    block_size,
    stride_block,
    stride_slot,
):
    """Element offsets ([BLOCK_N] int64) of BLOCK_N tokens in the pool, through the block table.
    A tile may straddle several pages (block_size < BLOCK_N) or cover part of one
    (block_size > BLOCK_N), so the page is looked up per token; the repeated table reads of one
    page hit the cache. K and V share the layout, so one lookup serves both."""
    block_ids = tl.load(table_row_ptr + offs_n // block_size, mask=n_mask, other=0)
    # int64 before the multiply: block_id * stride_block passes 2**31 in a pool of a few GB.
    in_block = (offs_n % block_size).to(tl.int64)
    return block_ids.to(tl.int64) * stride_block + in_block * stride_slot


@triton.jit
def softmax_step(
    acc,  # [M, D_PAD] float32: running sum of p @ v, scaled to the running max
    m_i,  # [M] float32: running max of the base-2 scores
    l_i,  # [M] float32: running sum of exp2(score - m_i)
    s,  # [M, BLOCK_N] float32 base-2 scores, -inf where masked
    v,  # [BLOCK_N, D_PAD] values of the tile
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update (flash-attention). m_i starts at a finite -1e30 rather than -inf,
    so a row whose tile is fully masked gives exp2(-inf - m) = 0 and alpha = 1, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


# No window: a window longer than any context, so `pos - window` stays negative without an int32
# overflow and the kernels need no separate code path for it.
NO_WINDOW = 1 << 30


def kernel_window(sliding_window: int | None) -> int:
    """The launchers' `sliding_window` as the kernels' integer argument (see NO_WINDOW)."""
    assert sliding_window is None or 0 < sliding_window < NO_WINDOW, sliding_window
    return sliding_window or NO_WINDOW


def kernel_softcap(logit_softcap: float | None) -> float:
    """The soft-cap in the kernels' base-2 score units: s2 / (c * LOG2E) == s / c, so capping the
    base-2 score by c * LOG2E is capping the natural one by c, then converting. 0.0: none."""
    assert logit_softcap is None or logit_softcap > 0, logit_softcap
    return logit_softcap * LOG2E if logit_softcap else 0.0


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap) (Gemma 2's attention logit soft-capping), with tanh written through
    exp2 as 1 - 2 / (exp(2x) + 1): exp2 overflowing to inf gives 1 and underflowing to 0 gives
    -1, so large scores saturate rather than turning into NaN."""
    e = tl.exp2(s / cap * (2.0 * 1.4426950408889634))
    return cap * (1.0 - 2.0 / (e + 1.0))
