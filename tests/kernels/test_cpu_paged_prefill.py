"""The C++ paged-prefill kernel (kernels/cpu_paged_prefill.cpp and its launcher) against the
torch reference: prompts, chunks behind a cached context, shared prefix blocks, sliding windows,
soft-caps, every dtype and the head sizes of each code path (64 and 128 in vectors, others in
plain loops).

The kernel is built once per machine and source (compiled the first time) into torch's
extension folder.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from batchpage.kernels.reference import ref_paged_attention
from batchpage.kernels.testing import PagedCase, hide_outside_windows, make_paged_case, tolerances


@pytest.fixture(scope="session")
def prefill() -> CpuPagedPrefill:
    return CpuPagedPrefill.build()


def _run(
    prefill: CpuPagedPrefill,
    case: PagedCase,
    scale: float,
    seqs: list[int] | None = None,
    out: torch.Tensor | None = None,
    **extra: object,
) -> torch.Tensor:
    if seqs is None:
        seqs = list(range(case.seq_lens.shape[0]))
    if out is None:
        out = torch.full_like(case.q, float("nan"))
    return prefill(
        case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, case.cu_seqlens_q,
        torch.tensor(seqs, dtype=torch.int32), scale, out, **extra,
    )  # fmt: skip


def _reference(case: PagedCase, scale: float, **extra: object) -> torch.Tensor:
    return ref_paged_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table,
        scale, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 64), (8, 1, 64), (9, 3, 64), (8, 2, 80), (4, 2, 128), (32, 8, 128)],
)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_matches_reference(prefill, dtype, heads, kv_heads, head_dim, block_size):
    # A decode, a whole short prompt, a prompt of exactly a block and one of a block and one,
    # chunks behind cached contexts (one longer than a tile of rows), a long fresh prompt. The
    # pool is NaN everywhere a sequence does not own, so a read past a context poisons it.
    seq_lens = [1, 7, block_size, block_size + 1, 97, 200, 130, 150]
    query_lens = [1, 7, block_size, block_size + 1, 40, 70, 3, 150]
    case = make_paged_case(
        seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, shared_blocks=1,
        seed=3,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = _run(prefill, case, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _reference(case, scale), **tolerances(dtype))


@pytest.mark.parametrize(("heads", "kv_heads"), [(72, 1), (130, 2)])
def test_more_query_heads_per_kv_head_than_a_tile_holds(prefill, heads, kv_heads):
    """A kv head with more than 64 query heads (Falcon-7B's multi-query attention has 71) is
    split over several tiles."""
    case = make_paged_case([40, 25], [12, 25], heads, kv_heads, 64, 16, torch.bfloat16, seed=9)
    out = _run(prefill, case, 0.125)
    torch.testing.assert_close(out, _reference(case, 0.125), **tolerances(torch.bfloat16))


@pytest.mark.parametrize(
    ("dtype", "head_dim", "window", "softcap"),
    [
        pytest.param(torch.float32, 64, 5, None, id="f32-vector-window-lt-block"),
        pytest.param(torch.bfloat16, 64, 1, None, id="bf16-window-1"),
        pytest.param(torch.bfloat16, 128, 37, 10.0, id="bf16-window-cap"),
        pytest.param(torch.float32, 80, 20, 5.0, id="f32-plain-window-cap"),
        pytest.param(torch.float16, 64, None, 5.0, id="f16-cap-only"),
    ],
)
def test_windows_and_softcaps_match_reference(prefill, dtype, head_dim, window, softcap):
    """Every slot that no row's window covers is NaN: the kernel must not read it at all."""
    case = make_paged_case([90, 200, 33], [40, 70, 33], 6, 2, head_dim, 16, dtype, seed=5)
    scale = 1.0 if softcap else head_dim**-0.5
    extra = {"sliding_window": window, "logit_softcap": softcap}
    seen = hide_outside_windows(case, window) if window else case
    out = _run(prefill, seen, scale, **extra)
    assert out.isfinite().all()
    torch.testing.assert_close(out, _reference(case, scale, **extra), **tolerances(dtype))


def test_only_the_given_sequences_are_written_and_q_may_be_strided(prefill):
    case = make_paged_case([50, 30, 64], [20, 30, 1], 6, 2, 64, 16, torch.bfloat16, seed=7)
    # q as the first heads of a wider row, as the model's fused qkv projection leaves it
    wide = torch.cat([case.q, torch.randn_like(case.q[:, :2])], dim=1)
    q = wide[:, :6]
    assert not q.is_contiguous()
    strided = replace(case, q=q)
    out = torch.full_like(case.q, 7.0)
    _run(prefill, strided, 0.125, seqs=[1], out=out)
    ref = _reference(case, 0.125)
    torch.testing.assert_close(out[20:50], ref[20:50], **tolerances(torch.bfloat16))
    assert bool((out[:20] == 7).all()) and bool((out[50:] == 7).all())


def test_bad_inputs_are_refused(prefill):
    case = make_paged_case([40, 20], [10, 20], 4, 2, 64, 16, torch.float32)
    with pytest.raises(AssertionError):
        _run(prefill, replace(case, q=case.q.half()), 0.125)
    bad_table = case.block_table.clone()
    bad_table[0, 0] = case.k_cache.shape[0]
    with pytest.raises(AssertionError):
        _run(prefill, replace(case, block_table=bad_table), 0.125)
    with pytest.raises(AssertionError):
        _run(prefill, case, 0.125, seqs=[2])
    with pytest.raises(AssertionError):
        _run(prefill, case, 0.125, out=torch.empty(5, 4, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_rows_output_does_not_depend_on_its_chunk(prefill, dtype, window, block_size):
    """The engine's batch-invariant mode: a prompt's rows computed in one piece, in chunks that
    start anywhere (a window's first key then starts at odd and even positions, mid-block),
    and one at a time (decodes) are the same bits."""
    n = 120
    case = make_paged_case([n], [n], 4, 2, 64, block_size, dtype, seed=11)
    scale = 0.125
    whole = _run(prefill, case, scale, sliding_window=window)
    for size in (1, 5, 9, 16, 33):
        for start in range(0, n, size):
            end = min(n, start + size)
            chunk = replace(
                case,
                q=case.q[start:end],
                seq_lens=torch.tensor([end], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            )
            got = _run(prefill, chunk, scale, sliding_window=window)
            assert torch.equal(got, whole[start:end]), (size, start)
