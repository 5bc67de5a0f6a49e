"""Sliding windows and logit soft-caps in the torch backend, against dense masked-softmax
attention whose mask is HF transformers' own (masking_utils.sliding_window_causal_mask_function),
over contiguous copies of each sequence's K/V."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from batchpage.attention.parts import plan_parts
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.kernels.reference import gather_sequence
from batchpage.kernels.testing import make_paged_case
from tests.attention.case_inputs import case_metadata, hidden_pool, mixed_step_lens


def dense_reference(
    q: torch.Tensor,  # [n, H, d]: the last n positions of the context
    k: torch.Tensor,  # [L, kvh, d]
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [n, H, d] float32
    seq_len, kvh, _ = k.shape
    n = q.shape[0]
    group = q.shape[1] // kvh
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if softcap is not None:  # Gemma 2's eager attention: divide, tanh, multiply, then mask
        scores = torch.tanh(scores / softcap) * softcap
    mask_fn = (
        causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    )
    q_idx = torch.arange(seq_len - n, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = mask_fn(0, 0, q_idx, kv_idx)
    scores = scores.masked_fill(~allowed[None], -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def run_step(block_size, heads, kv_heads, window, softcap, seed=0, layer_windows=None):
    """The mixed step through the torch backend; returns (out, reference, meta)."""
    seq_lens, query_lens = mixed_step_lens(block_size)
    args = (seq_lens, query_lens, heads, kv_heads, 16, block_size, torch.float32)
    case = make_paged_case(*args, shared_blocks=2, write_new=False, seed=seed)
    full = make_paged_case(*args, shared_blocks=2, write_new=True, seed=seed)  # same numbers
    meta = case_metadata(case)
    scale = 1.0 if softcap else 16**-0.5  # large scores, so the cap bends them
    step = TorchPagedAttention().plan(meta)
    kv = hidden_pool(case, window)
    for w in layer_windows or ():  # other layers of the step, planned with other windows first
        step(0, case.q, case.k_new, case.v_new, kv, meta, scale, sliding_window=w)
    out = step(
        1, case.q, case.k_new, case.v_new, kv, meta, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    refs = []
    starts = case.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens):
        k = gather_sequence(full.k_cache, full.block_table[b], seq_len)
        v = gather_sequence(full.v_cache, full.block_table[b], seq_len)
        q = case.q[starts[b] : starts[b + 1]]
        refs.append(dense_reference(q, k, v, scale, window, softcap))
    return out, torch.cat(refs), meta


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 3, 6, 21, 1000], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
def test_torch_backend_matches_dense(block_size, window, softcap):
    """Windows smaller than a block, ending inside one, reaching into the shared prefix blocks
    and longer than every context; decode, prompt and chunk rows in one step. The blocks wholly
    before every window are NaN: gathering one of them fails the test."""
    out, ref, _ = run_step(block_size, 6, 2, window, softcap, seed=block_size)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_layers_with_different_windows_share_one_step():
    """Gemma's pattern: layers of one step alternate windows; each gets its own parts."""
    out, ref, meta = run_step(4, 4, 4, 6, 8.0, layer_windows=[None, 6, 3])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_windowed_parts_read_only_blocks_inside_the_window():
    seq_lens, query_lens = mixed_step_lens(4)
    case = make_paged_case(seq_lens, query_lens, 4, 2, 16, 4, torch.float32, shared_blocks=2)
    meta = case_metadata(case)
    window = 6
    read = {int(b) for part in plan_parts(meta, window=window) for b in part.blocks}
    wanted = set()
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        first = max(0, seq_len - q_len - window + 1) // 4
        wanted |= set(case.block_table[b, first : -(-seq_len // 4)].tolist())
    assert read == wanted
    assert all(p.prefix_blocks is None for p in plan_parts(meta, window=window))
    assert any(p.prefix_blocks is not None for p in plan_parts(meta))  # cascades without one
    # A window that covers every context is full attention, cascades included.
    assert len(plan_parts(meta, window=max(seq_lens))) == len(plan_parts(meta))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sliding_window=0), "sliding_window must be a positive number"),
        (dict(sliding_window=2.5), "sliding_window must be a positive number"),
        (dict(logit_softcap=0.0), "logit_softcap must be positive"),
    ],
)
def test_bad_window_or_cap_is_refused(kwargs, match):
    case = make_paged_case([9], [1], 4, 2, 16, 4, torch.float32, write_new=False)
    meta = case_metadata(case)
    step = TorchPagedAttention().plan(meta)
    with pytest.raises(ValueError, match=match):
        step(1, case.q, case.k_new, case.v_new, hidden_pool(case, None), meta, 0.3, **kwargs)
