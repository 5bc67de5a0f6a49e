"""Bidirectional image spans (AttentionMetadata.key_end) in the torch, CPU and Triton backends,
against dense masked-softmax attention whose mask is HF transformers' own for Gemma 3's images:
OR(causal, blockwise over the spans), AND its sliding window (masking_utils), over contiguous
copies of each sequence's K/V. Spans start in the cached context or in the step, end inside it
or at its last row, are shorter and longer than the window; decodes and text-only prompts share
the step."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers.masking_utils import (
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    or_masks,
    sliding_window_overlay,
)

from batchpage.attention.cpu_backend import CpuPagedAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.attention.triton_backend import TritonPagedAttention
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from batchpage.kernels.reference import gather_sequence
from batchpage.kernels.testing import interpreter_skip_reason, make_paged_case
from tests.attention.case_inputs import case_metadata, two_layer_pool

BS, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 16
# The Triton backend's device (CUDA where there is one, else its interpreter on the CPU); the
# torch and CPU backends, and the dense reference, run on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A decode, a whole prompt, a chunk behind a cached prefix, a text-only prompt, another decode.
SEQ_LENS = [3 * BS + 5, 40, 34, 11, 9]
QUERY_LENS = [1, 40, 13, 11, 1]
# Per sequence, its image spans [a, b): each overlaps the step's rows and ends inside its context.
SPANS: list[list[tuple[int, int]]] = [
    [],
    [(3, 9), (12, 25), (30, 31)],
    [(18, 26), (28, 34)],
    [],
    [],
]


def key_ends() -> tuple[torch.Tensor, tuple[int, ...]]:
    """The step's key_end (each row: its span's end, or its position + 1) and span sequences,
    as step_inputs makes them."""
    ends: list[int] = []
    for length, n, spans in zip(SEQ_LENS, QUERY_LENS, SPANS, strict=True):
        for p in range(length - n, length):
            ends.append(next((b for a, b in spans if a <= p < b), p + 1))
    seqs = tuple(b for b, spans in enumerate(SPANS) if any(e - a > 1 for a, e in spans))
    return torch.tensor(ends, dtype=torch.int32), seqs


def hf_mask(length: int, n: int, spans: list[tuple[int, int]], window: int | None):
    """HF's Gemma 3 mask for the last n rows of a context of `length` (modeling_gemma3's
    create_masks_for_vision_model): bool [n, length]."""
    groups = torch.full((1, length), -1)
    for i, (a, b) in enumerate(spans):
        groups[0, a:b] = i
    mask_fn = or_masks(causal_mask_function, blockwise_overlay(groups))
    if window is not None:
        mask_fn = and_masks(sliding_window_overlay(window), mask_fn)
    q_idx = torch.arange(length - n, length)[:, None]
    kv_idx = torch.arange(length)[None, :]
    return mask_fn(torch.zeros((), dtype=torch.long), 0, q_idx, kv_idx)


def dense_reference(case, window: int | None, softcap: float | None, scale: float):
    starts = case.cu_seqlens_q.tolist()
    refs = []
    for b, (length, n) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        k = gather_sequence(case.k_cache, case.block_table[b], length).float()
        v = gather_sequence(case.v_cache, case.block_table[b], length).float()
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = case.q[starts[b] : starts[b + 1]].float()
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = hf_mask(length, n, SPANS[b], window)
        scores = scores.masked_fill(~allowed[None], -math.inf)
        refs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
    return torch.cat(refs)


def backends() -> list:
    params = [
        pytest.param(lambda: TorchPagedAttention(), id="torch"),
        pytest.param(
            lambda: CpuPagedAttention(CpuPagedDecode.build(), CpuPagedPrefill.build()), id="cpu"
        ),
        pytest.param(
            lambda: CpuPagedAttention(
                CpuPagedDecode.build(), CpuPagedPrefill.build(), batch_invariant=True
            ),
            id="cpu-invariant",
        ),
    ]
    skip = interpreter_skip_reason()
    marks = [pytest.mark.skipif(skip is not None, reason=skip or "")]
    params.append(pytest.param(lambda: TritonPagedAttention(), id="triton", marks=marks))
    return params


def backend_device(backend: object) -> str:
    """Where `backend`'s step runs: the Triton kernels' device, else the CPU."""
    return DEVICE if isinstance(backend, TritonPagedAttention) else "cpu"


def spanned_step(seed: int, device: str = "cpu") -> tuple:
    """(the case with new K/V unwritten, on `device`; the same numbers written, on the CPU for
    the reference; the step's metadata, on `device`)."""
    args = (SEQ_LENS, QUERY_LENS, HEADS, KV_HEADS, HEAD_DIM, BS, torch.float32)
    case = make_paged_case(*args, device=device, shared_blocks=1, write_new=False, seed=seed)
    full = make_paged_case(*args, shared_blocks=1, write_new=True, seed=seed)
    key_end, seqs = key_ends()
    meta: AttentionMetadata = replace(
        case_metadata(case), key_end=key_end.to(device), span_seqs=seqs
    )
    return case, full, meta


@pytest.mark.parametrize("make", backends())
@pytest.mark.parametrize("window", [None, 3, 10, 100], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
def test_span_rows_see_their_span_as_transformers_masks_them(make, window, softcap) -> None:
    backend = make()
    case, full, meta = spanned_step(seed=3, device=backend_device(backend))
    scale = 1.0 if softcap else HEAD_DIM**-0.5
    step = backend.plan(meta)
    device = case.q.device
    kv = two_layer_pool(case)
    for w in (7, None):  # other layers of the step, planned with other windows first
        step(0, case.q, case.k_new, case.v_new, kv, meta, scale, sliding_window=w)
    out = step(
        1, case.q, case.k_new, case.v_new, kv, meta, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    ref = dense_reference(full, window, softcap, scale).to(device)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-5)
    # The spans matter: causal attention differs on the rows that see past themselves only.
    wide = meta.key_end.long() > positions(meta).to(device) + 1
    causal_meta = replace(meta, key_end=None, span_seqs=())
    causal = make().plan(causal_meta)(
        1, case.q, case.k_new, case.v_new, two_layer_pool(case), causal_meta, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    assert (causal - out)[wide].abs().max() > 1e-3
    torch.testing.assert_close(causal[~wide], out[~wide], atol=2e-5, rtol=1e-5)


def positions(meta: AttentionMetadata) -> torch.Tensor:
    """Each step row's position in its sequence."""
    return torch.cat(
        [
            torch.arange(s - n, s)
            for s, n in zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True)
        ]
    )
