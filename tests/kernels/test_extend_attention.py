"""Extend (prefill) attention over a paged prefix against the torch reference.

Each case mixes the shapes a step can hold: a whole prompt, new tokens after a cached prefix that
ends exactly on a page boundary and one token past it, a lone decode row, and a long chunk spanning
several q and kv tiles. Parameters are a covering set (interpreter time), see
test_kernels_decode.py.
"""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.extend_attention import extend_attention
from batchpage.kernels.reference import ref_paged_attention
from batchpage.kernels.testing import (
    hide_outside_windows,
    interpreter_skip_reason,
    make_paged_case,
    tolerances,
)

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lens(block_size: int) -> tuple[list[int], list[int]]:
    seq_lens = [
        block_size + 3,  # whole prompt, no cache
        2 * block_size + 4,  # cached prefix of exactly 2 pages, then 4 new tokens
        2 * block_size + 1 + 2,  # cached prefix one token past 2 pages
        block_size + 1,  # decode row: its context ends one past a page
        3 * block_size,  # chunk ending exactly on a page boundary
    ]
    query_lens = [block_size + 3, 4, 2, 1, 2 * block_size - 3]
    return seq_lens, query_lens


CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, (block_m, block_n)
    pytest.param(4, 4, 64, 8, torch.float16, (16, 16), id="gqa1-d64-bs8-f16"),
    pytest.param(8, 2, 80, 16, torch.float32, (16, 32), id="gqa4-d80-bs16-f32"),
    pytest.param(8, 1, 128, 32, torch.float16, (32, 16), id="mqa8-d128-bs32-f16"),
    pytest.param(2, 2, 128, 16, torch.float32, (None, None), id="gqa1-d128-bs16-f32-default"),
    pytest.param(8, 1, 64, 32, torch.float32, (16, 16), id="gqa8-d64-bs32-f32"),
    pytest.param(4, 1, 80, 8, torch.float16, (16, 64), id="gqa4-d80-bs8-f16"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "dtype", "tiles"), CASES)
def test_extend_matches_reference(heads, kv_heads, head_dim, block_size, dtype, tiles):
    seq_lens, query_lens = _lens(block_size)
    case = make_paged_case(
        seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, device=DEVICE,
        shared_blocks=2, seed=head_dim + block_size,
    )  # fmt: skip
    out = extend_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table,
        case.max_seqlen_q, block_m=tiles[0], block_n=tiles[1],
    )  # fmt: skip
    ref = ref_paged_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table
    )
    torch.testing.assert_close(out, ref, **tolerances(dtype))


WINDOW_CASES = [
    # heads, kv_heads, block_size, dtype, (block_m, block_n), window, softcap
    pytest.param(4, 2, 8, torch.float32, (16, 16), 5, None, id="window-lt-block"),
    pytest.param(8, 1, 16, torch.float16, (16, 32), 21, 30.0, id="window-in-block-cap-f16"),
    pytest.param(4, 4, 8, torch.float32, (16, 16), 19, None, id="window-over-shared-prefix"),
    pytest.param(4, 2, 8, torch.float32, (32, 16), None, 5.0, id="cap-only"),
    pytest.param(8, 2, 16, torch.float32, (16, 16), 1, 8.0, id="window-1-cap"),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "dtype", "tiles", "window", "softcap"), WINDOW_CASES
)
def test_window_and_softcap_match_reference(
    heads, kv_heads, block_size, dtype, tiles, window, softcap
):
    """Prompts, chunks after a cached (shared) prefix and a decode row with windows smaller
    than a block, ending inside one and reaching back into the shared blocks. Slots no row's
    window covers hold NaN, so reading one of them fails the test."""
    seq_lens, query_lens = _lens(block_size)
    seq_lens.append(6 * block_size + 5)  # a chunk long enough that its first windows end early
    query_lens.append(3 * block_size + 2)
    case = make_paged_case(
        seq_lens, query_lens, heads, kv_heads, 64, block_size, dtype, device=DEVICE,
        shared_blocks=2, seed=window or 3,
    )  # fmt: skip
    scale = 1.0 if softcap else None  # large scores, so the cap bends them
    args = (case.cu_seqlens_q, case.seq_lens, case.block_table)
    ref = ref_paged_attention(
        case.q, case.k_cache, case.v_cache, *args, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    if window:
        case = hide_outside_windows(case, window)
    out = extend_attention(
        case.q, case.k_cache, case.v_cache, *args, case.max_seqlen_q, scale,
        block_m=tiles[0], block_n=tiles[1], sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **tolerances(dtype))


def test_non_causal_and_scale():
    """causal=False: every q row sees the whole context (flash-attn's flag), custom scale."""
    case = make_paged_case([20, 9], [6, 9], 4, 2, 64, 8, torch.float32, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    out = extend_attention(*args, case.max_seqlen_q, softmax_scale=0.2, causal=False, block_m=16)
    ref = ref_paged_attention(*args, softmax_scale=0.2, causal=False)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


def test_decode_rows_match_decode_kernel():
    """A decode-only batch through the extend kernel gives the decode kernel's answer."""
    from batchpage.kernels.paged_decode_attention import paged_decode_attention

    case = make_paged_case([17, 8, 30], [1, 1, 1], 8, 2, 64, 8, torch.float32, device=DEVICE)
    ext = extend_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table, 1,
        block_m=16, block_n=16,
    )  # fmt: skip
    dec = paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, tile_n=16
    )
    torch.testing.assert_close(ext, dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (21, None), (None, 30.0)])
def test_a_row_is_the_same_bits_however_its_prompt_is_split(dtype, window, softcap):
    """batch_invariant's attention: every position of a 70-token prompt gives the same bits
    computed in one piece, in chunks that start mid-tile (as a chunked prefill or a prefix-cache
    hit leaves them), and as decode rows of one token each beside other sequences."""
    n, heads, kv_heads, head_dim, block_size = 70, 4, 2, 64, 8
    case = make_paged_case([n], [n], heads, kv_heads, head_dim, block_size, dtype, device=DEVICE)
    kw = {"sliding_window": window, "logit_softcap": softcap}

    def rows(starts: list[int], ends: list[int]) -> torch.Tensor:
        """Positions [s, e) of each piece, as sequences of one batch sharing the block table."""
        q = torch.cat([case.q[s:e] for s, e in zip(starts, ends, strict=True)])
        lens = [e - s for s, e in zip(starts, ends, strict=True)]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        table = case.block_table.expand(len(lens), -1).contiguous()
        seq_lens = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
        return extend_attention(
            q, case.k_cache, case.v_cache, cu.to(DEVICE), seq_lens, table, max(lens), **kw
        )

    whole = rows([0], [n])
    assert torch.equal(rows([0, 7, 23, 40], [7, 23, 40, n]), whole)
    assert torch.equal(rows([0, 33], [33, n]), whole)
    decodes = [3, 16, 17, 38, 69]
    assert torch.equal(rows(decodes, [p + 1 for p in decodes]), whole[decodes])
