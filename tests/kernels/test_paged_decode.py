"""Paged decode attention (single-pass and split-KV) against the torch reference.

Without a GPU the kernels run in Triton's interpreter (batchpage.kernels turns it on at import),
so shapes stay small and the parameters are a covering set rather than the full product: every
GQA ratio (1, 4, 8), head dim (64, 80, 128), dtype, block size (8, 16, 32, 128), both kernels and
tiles smaller and larger than a page each appear, with contexts that end exactly on a page
boundary, one token past it, a single token, and ragged lengths.
"""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.paged_decode_attention import choose_num_splits, paged_decode_attention
from batchpage.kernels.reference import ref_decode_attention
from batchpage.kernels.testing import (
    hide_outside_windows,
    interpreter_skip_reason,
    make_paged_case,
    tolerances,
)

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _seq_lens(block_size: int) -> list[int]:
    # page boundary, one past it, a lone token, ragged, and one that spans several tiles
    return [2 * block_size, 2 * block_size + 1, 1, 3 * block_size - 5, 5 * block_size + 3]


CASES = [
    # heads, kv_heads, head_dim, block_size, dtype, num_splits, tile_n
    pytest.param(4, 4, 64, 8, torch.float32, 1, None, id="gqa1-d64-bs8-f32-single"),
    pytest.param(8, 2, 80, 16, torch.float16, 1, 16, id="gqa4-d80-bs16-f16-single"),
    pytest.param(8, 1, 128, 32, torch.float32, 3, 16, id="mqa8-d128-bs32-f32-split3"),
    pytest.param(4, 4, 80, 32, torch.float16, 4, None, id="gqa1-d80-bs32-f16-split4"),
    pytest.param(16, 2, 64, 16, torch.float32, 2, 32, id="gqa8-d64-bs16-f32-split2"),
    pytest.param(8, 2, 128, 8, torch.float16, 5, 16, id="gqa4-d128-bs8-f16-split5"),
    pytest.param(4, 1, 64, 128, torch.float16, 2, 32, id="gqa4-d64-bs128-f16-split2"),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype", "splits", "tile"), CASES
)
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size, dtype, splits, tile):
    seq_lens = _seq_lens(block_size)
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, block_size, dtype,
        device=DEVICE, shared_blocks=1, seed=block_size + head_dim,
    )  # fmt: skip
    out = paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table,
        num_splits=splits, tile_n=tile,
    )  # fmt: skip
    ref = ref_decode_attention(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


WINDOW_CASES = [
    # heads, kv_heads, block_size, dtype, num_splits, tile_n, window, softcap
    pytest.param(8, 2, 8, torch.float32, 1, 16, 5, None, id="window-lt-block-single"),
    pytest.param(4, 4, 16, torch.float16, 1, None, 20, 30.0, id="window-in-block-cap-f16"),
    pytest.param(8, 1, 8, torch.float32, 3, 16, 29, None, id="window-split3"),
    pytest.param(8, 2, 8, torch.float32, 1, 16, None, 5.0, id="cap-only"),
    pytest.param(4, 2, 16, torch.float32, 2, 16, 40, 10.0, id="window-cap-split2"),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "dtype", "splits", "tile", "window", "softcap"),
    WINDOW_CASES,
)
def test_window_and_softcap_match_reference(
    heads, kv_heads, block_size, dtype, splits, tile, window, softcap
):
    """Windows shorter than a block, ending inside one and reaching into the shared prefix
    block; every slot before a window is NaN, so a kernel that reads one fails."""
    seq_lens = _seq_lens(block_size)
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), heads, kv_heads, 64, block_size, dtype, device=DEVICE,
        shared_blocks=1, seed=window or 7,
    )  # fmt: skip
    scale = 1.0 if softcap else None  # large scores, so the cap bends them
    ref = ref_decode_attention(
        case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    if window:
        case = hide_outside_windows(case, window)
    out = paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, scale,
        num_splits=splits, tile_n=tile, sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **tolerances(dtype))
    if softcap:  # the cap changed the answer: the test would see it ignored
        plain = paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, scale,
            num_splits=splits, tile_n=tile, sliding_window=window,
        )  # fmt: skip
        assert (plain - ref).abs().max() > 0.1


def test_hidden_slots_poison_a_kernel_that_reads_them():
    """The check behind the window tests: one slot past the window is enough to give NaN."""
    case = make_paged_case([40, 3], [1, 1], 4, 2, 64, 8, torch.float32, device=DEVICE)
    hidden = hide_outside_windows(case, 10)
    args = (hidden.q, hidden.k_cache, hidden.v_cache, hidden.seq_lens, hidden.block_table)
    assert paged_decode_attention(*args, tile_n=16, sliding_window=10).isfinite().all()
    wider = paged_decode_attention(*args, tile_n=16, sliding_window=11)
    assert wider[0].isnan().all() and wider[1].isfinite().all()  # row 1 has only 3 tokens


def test_split_equals_single_pass():
    """The log-sum-exp merge reproduces the single pass, with a softmax_scale and a partition
    count that leaves the last partitions of short sequences empty."""
    case = make_paged_case([70, 3, 33], [1, 1, 1], 8, 2, 64, 8, torch.float32, device=DEVICE)
    args = (case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, 0.3)
    single = paged_decode_attention(*args, num_splits=1, tile_n=16)
    split = paged_decode_attention(*args, num_splits=4, tile_n=16)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)
    ref = ref_decode_attention(*args)
    torch.testing.assert_close(split, ref, atol=1e-4, rtol=1e-4)


def test_out_argument_and_strided_q():
    """q as a strided view (a slice of a fused projection) and a caller-provided output."""
    case = make_paged_case([9, 24], [1, 1], 4, 2, 64, 8, torch.float32, device=DEVICE)
    fused = torch.cat([case.q, torch.zeros_like(case.q)], dim=1)  # [B, 2H, d]
    q = fused[:, :4]
    out = torch.full_like(case.q, float("nan"))
    res = paged_decode_attention(
        q, case.k_cache, case.v_cache, case.seq_lens, case.block_table, out=out, tile_n=16
    )
    assert res is out
    ref = ref_decode_attention(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


def test_choose_num_splits():
    sms = 132
    assert choose_num_splits(256, 8, 32768, sms) == 1  # the batch fills the GPU already
    assert choose_num_splits(1, 8, 256, sms) == 1  # too short to be worth splitting
    long_one = choose_num_splits(1, 8, 32768, sms)
    assert 16 <= long_one <= 64  # ~2 programs per SM
    assert choose_num_splits(4, 8, 32768, sms) < long_one


def test_rejects_bad_inputs():
    case = make_paged_case([9], [1], 4, 2, 64, 8, torch.float32, device=DEVICE)
    args = (case.k_cache, case.v_cache, case.seq_lens, case.block_table)
    with pytest.raises(AssertionError):
        paged_decode_attention(case.q.half(), *args)  # dtype differs from the pool
    with pytest.raises(AssertionError):
        paged_decode_attention(case.q[:, :3], *args)  # 3 heads over 2 kv heads
    with pytest.raises(AssertionError):
        paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.seq_lens.long(), case.block_table
        )


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_an_upper_bound_on_the_context_gives_the_same_result(splits: int) -> None:
    """A CUDA graph of a decode step is planned once for max_model_len (decode_graphs.py): the
    kernels must treat max_seqlen_k as a bound only, each row reading its own seq_len."""
    block_size = 8
    seq_lens = _seq_lens(block_size)
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), 8, 2, 64, block_size, torch.float32,
        device=DEVICE, shared_blocks=1, seed=7,
    )  # fmt: skip
    bound = 4 * max(seq_lens)
    # The graph's block table is as wide as max_model_len: columns past each row's blocks hold
    # stale block ids that must never be read.
    extra = torch.randint(0, case.k_cache.shape[0], (len(seq_lens), bound // block_size))
    wide = torch.cat([case.block_table, extra.to(case.block_table)], dim=1)
    out = paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.seq_lens, wide,
        max_seqlen_k=bound, num_splits=splits,
    )  # fmt: skip
    ref = ref_decode_attention(case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's failure mode")
def test_triton_imported_before_the_interpreter_switch_is_named_with_its_fix() -> None:
    """Another library that imports triton first (transformers does) leaves Triton's standard
    library built for a GPU: the launcher says so and how to fix it, not an interpreter error."""
    import os
    import subprocess
    import sys

    code = (
        "import triton, torch\n"
        "from batchpage.kernels.testing import make_paged_case\n"
        "from batchpage.kernels.paged_decode_attention import paged_decode_attention\n"
        "c = make_paged_case([5], [1], 2, 1, 16, 4, torch.float32)\n"
        "paged_decode_attention(c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_table, 0.25)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert "before batchpage turned its interpreter on" in done.stderr, done.stderr[-2000:]
    assert "set TRITON_INTERPRET=1 in the environment" in done.stderr
