"""Many adapters' LoRA updates on a GPU: the Triton kernels of cpu_lora.cpp's contract (see
kernels/cpu_lora.py, whose `reference_apply` is the reference of both), in two launches per
target as punica's SGMV does: shrink, h = x[rows] @ A_t[slot].T for each tile of a group's rows,
then expand, y[rows, target] += h @ B_t[slot], each tile of rows against a block of columns.
Sums in float32; y is read, added to and rounded once.
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import check_runnable, dot, dot_precision, padded_dim

# isort: split
import triton
import triton.language as tl

BLOCK_M = 16  # rows of a tile (tl.dot's smallest edge)
BLOCK_K = 64  # input columns a shrink step reads
BLOCK_N = 64  # output columns an expand program writes


@triton.jit
def _tile(tiles_ptr, rows_ptr, tile, BLOCK_M: tl.constexpr):
    """A tile's slot, its positions in rows (offs_m, and which are in it) and their token rows."""
    slot = tl.load(tiles_ptr + tile * 3)
    begin = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    offs_m = begin + tl.arange(0, BLOCK_M)
    in_tile = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=in_tile, other=0)
    return slot, offs_m, in_tile, rows


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, d_in]
    a_ptr,  # [S, targets * R, d_in]
    h_ptr,  # float32 [N, targets * R]
    rows_ptr,  # int64 [N]
    tiles_ptr,  # int64 [n_tiles, 3]: slot, begin, end (into rows)
    active_ptr,  # bool [S, targets]
    d_in,
    n_targets,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_hn,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (n_tiles, targets). One program: h[tile rows, the target's R].
    target = tl.program_id(1)
    slot, offs_m, in_tile, rows = _tile(tiles_ptr, rows_ptr, tl.program_id(0), BLOCK_M)
    if tl.load(active_ptr + slot * n_targets + target).to(tl.int1) == 0:
        return
    offs_r = tl.arange(0, R_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    a_base = a_ptr + slot * stride_as + (target * rank + offs_r)[None, :] * stride_ar
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :],
                    mask=in_tile[:, None] & (k < d_in)[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_base + k[:, None], mask=(k < d_in)[:, None] & (offs_r < rank)[None, :],
                    other=0.0)  # fmt: skip
        acc += dot(x.to(tl.float32), a.to(tl.float32), PRECISION)
    h = h_ptr + offs_m[:, None] * stride_hn + (target * rank + offs_r)[None, :]
    tl.store(h, acc, mask=in_tile[:, None] & (offs_r < rank)[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, d_out]
    h_ptr,  # float32 [N, targets * R]
    b_ptr,  # [S, R, size]: this target's B transposed
    rows_ptr,
    tiles_ptr,
    active_ptr,
    n_targets,
    rank,
    size,
    start,
    stride_yt,
    stride_hn,
    stride_bs,
    stride_br,
    target,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (n_tiles, cdiv(size, BLOCK_N)). One program: y[tile rows, a block of the target].
    slot, offs_m, in_tile, rows = _tile(tiles_ptr, rows_ptr, tl.program_id(0), BLOCK_M)
    if tl.load(active_ptr + slot * n_targets + target).to(tl.int1) == 0:
        return
    offs_r = tl.arange(0, R_PAD)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + offs_m[:, None] * stride_hn + (target * rank + offs_r)[None, :],
                mask=in_tile[:, None] & (offs_r < rank)[None, :], other=0.0)  # fmt: skip
    b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                mask=(offs_r < rank)[:, None] & (offs_n < size)[None, :], other=0.0)  # fmt: skip
    delta = dot(h, b.to(tl.float32), PRECISION)
    y = y_ptr + rows[:, None] * stride_yt + start + offs_n[None, :]
    mask = in_tile[:, None] & (offs_n < size)[None, :]
    old = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (old + delta).to(y_ptr.dtype.element_ty), mask=mask)


def row_tiles(groups: torch.Tensor) -> torch.Tensor:
    """(slot, begin, end) of each BLOCK_M-row tile of each group (int64 [n_tiles, 3])."""
    tiles = [
        (slot, b, min(b + BLOCK_M, end))
        for slot, begin, end in groups.tolist()
        for b in range(begin, end, BLOCK_M)
    ]
    return torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3)


def lora_apply(
    y: torch.Tensor,  # [T, out], updated in place
    x: torch.Tensor,  # [T, in], y's dtype
    a: torch.Tensor,  # [S, targets * R, in]
    bt: list[torch.Tensor],  # per target [S, R, size_t]
    starts: list[int],  # per target: its first column in y
    rows: torch.Tensor,  # int64 [N]: token rows, grouped
    groups: torch.Tensor,  # int64 [G, 3]: (slot, begin, end) into rows, on the host
    active: torch.Tensor,  # bool [S, targets]
    tiles: torch.Tensor | None = None,  # row_tiles(groups) on y's device, if the caller has it
) -> None:
    """cpu_lora.py's contract, on the device of y. A caller that runs many linears with the
    same groups (a step's) passes their `tiles` once made."""
    t, d_in = x.shape
    slots, rank = a.shape[0], bt[0].shape[1]
    device = y.device
    assert y.dim() == 2 and y.shape[0] == t and y.stride(1) == 1, (y.shape, y.stride())
    assert x.dtype == y.dtype and x.stride(1) == 1 and x.device == device
    assert a.dtype == y.dtype and a.is_contiguous() and a.shape == (slots, len(bt) * rank, d_in)
    assert len(bt) == len(starts) and active.shape == (slots, len(bt)) and active.is_contiguous()
    for b, start in zip(bt, starts, strict=True):
        assert b.dtype == y.dtype and b.is_contiguous() and b.shape[:2] == (slots, rank)
        assert start >= 0 and start + b.shape[2] <= y.shape[1], (start, b.shape)
    assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.device == device
    assert groups.dtype == torch.int64 and groups.shape[1:] == (3,) and groups.device.type == "cpu"
    check_runnable(_shrink_kernel, device)
    if tiles is None:
        tiles = row_tiles(groups).to(device)
    assert tiles.dtype == torch.int64 and tiles.shape[1:] == (3,) and tiles.device == device
    if not len(tiles):
        return
    h = torch.zeros(len(rows), len(bt) * rank, dtype=torch.float32, device=device)
    assert active.dtype == torch.bool and active.device == device, (active.dtype, active.device)
    active = active.view(torch.int8)  # the same bytes
    common = dict(R_PAD=padded_dim(rank), BLOCK_M=BLOCK_M, PRECISION=dot_precision(y.dtype))
    _shrink_kernel[(len(tiles), len(bt))](
        x, a, h, rows, tiles, active, d_in, len(bt), rank, x.stride(0), a.stride(0), a.stride(1),
        h.stride(0), BLOCK_K=BLOCK_K, **common,
    )  # fmt: skip
    for target, (b, start) in enumerate(zip(bt, starts, strict=True)):
        size = b.shape[2]
        _expand_kernel[(len(tiles), triton.cdiv(size, BLOCK_N))](
            y, h, b, rows, tiles, active, len(bt), rank, size, start, y.stride(0), h.stride(0),
            b.stride(0), b.stride(1), target, BLOCK_N=BLOCK_N, **common,
        )  # fmt: skip
