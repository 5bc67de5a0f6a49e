"""KV write: store the step's new keys/values into their pool slots (cf. vLLM's
reshape_and_cache_flash). Slot s is block s // block_size, offset s % block_size; a negative slot
marks a padding token whose K/V is dropped.
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import check_kv_cache, check_runnable, next_pow2

# isort: split
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int64 [T]
    num_kv_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    # grid: (T,). One program moves one token's [num_kv_heads, head_dim] K and V.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64, so block * stride cannot overflow
    if slot < 0:
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    t64 = token.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    c_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(key_cache_ptr + c_off, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + c_off, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]; < 0 skips the token
) -> None:
    """key/value may be strided views (e.g. slices of a fused QKV projection) as long as
    head_dim is contiguous; they are cast to the cache dtype on store."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(key_cache, value_cache)
    num_tokens = key.shape[0]
    expect = (num_tokens, num_kv_heads, head_dim)
    assert key.shape == expect and value.shape == expect, f"{tuple(key.shape)} != {expect}"
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,)
    assert slot_mapping.is_contiguous()
    device = key_cache.device
    assert key.device == value.device == slot_mapping.device == device
    check_runnable(_write_kv_kernel, device)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim, block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim), num_warps=4,
    )  # fmt: skip
