"""TritonPagedAttention (kv write + decode or extend kernel) against TorchPagedAttention through
the AttentionBackend contract: same outputs, same pool contents afterwards."""

from __future__ import annotations

import pytest
import torch

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.attention.triton_backend import TritonPagedAttention
from batchpage.kernels.testing import interpreter_skip_reason, make_paged_case, tolerances
from tests.attention.case_inputs import (
    case_metadata,
    hidden_pool,
    mixed_step_lens,
    two_layer_pool,
)

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "dtype"),
    [
        pytest.param([16, 9, 33], [1, 1, 1], torch.float32, id="decode-f32"),
        pytest.param([16, 9, 33], [1, 1, 1], torch.float16, id="decode-f16"),
        pytest.param([12, 21, 9], [12, 5, 1], torch.float32, id="mixed-prefill-decode-f32"),
    ],
)
@pytest.mark.parametrize("num_splits", [0, 2])
def test_triton_backend_matches_torch_backend(seq_lens, query_lens, dtype, num_splits):
    block_size, heads, kv_heads, head_dim = 8, 6, 2, 64
    case = make_paged_case(
        seq_lens, query_lens, heads, kv_heads, head_dim, block_size, dtype, device=DEVICE,
        shared_blocks=1, write_new=False,
    )  # fmt: skip
    meta = case_metadata(case)
    kv_triton, kv_torch = two_layer_pool(case), two_layer_pool(case)
    scale = head_dim**-0.5
    args = (case.q, case.k_new, case.v_new)
    step = TritonPagedAttention(num_splits=num_splits).plan(meta)
    assert step.kernel == ("decode" if max(query_lens) == 1 else "extend")
    out = step(1, *args, kv_triton, meta, scale)
    ref = TorchPagedAttention().plan(meta)(1, *args, kv_torch, meta, scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, ref, **tolerances(dtype))
    for a, b in zip(kv_triton.k + kv_triton.v, kv_torch.k + kv_torch.v, strict=True):
        assert torch.equal(a, b)
    assert not kv_triton.k[0].any() and not kv_triton.v[0].any()


@pytest.mark.parametrize(("window", "softcap"), [(3, None), (6, 8.0), (None, 5.0)], ids=str)
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_windows_and_softcap_match_torch_backend(window, softcap, decode_only):
    """Decodes over shared prefix blocks with a prompt and a chunk (extend kernel), or the
    decodes alone (decode kernel, split in two), the blocks wholly before every window NaN."""
    seq_lens, query_lens = mixed_step_lens(8)
    if decode_only:
        seq_lens = [s for s, n in zip(seq_lens, query_lens, strict=True) if n == 1]
        query_lens = [1] * len(seq_lens)
    case = make_paged_case(
        seq_lens, query_lens, 4, 2, 64, 8, torch.float32, device=DEVICE, shared_blocks=2,
        write_new=False,
    )  # fmt: skip
    meta = case_metadata(case)
    scale = 1.0 if softcap else 0.125
    args = (case.q, case.k_new, case.v_new)
    extra = dict(sliding_window=window, logit_softcap=softcap)
    step = TritonPagedAttention(num_splits=2).plan(meta)
    out = step(1, *args, hidden_pool(case, window), meta, scale, **extra)
    ref = TorchPagedAttention().plan(meta)(
        1, *args, hidden_pool(case, window), meta, scale, **extra
    )
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))


def test_triton_step_refuses_another_steps_metadata():
    case = make_paged_case([16, 9], [1, 1], 4, 2, 64, 8, torch.float32, device=DEVICE)
    step = TritonPagedAttention().plan(case_metadata(case))
    with pytest.raises(ValueError, match="call backend.plan\\(meta\\) for each step"):
        step(1, case.q, case.k_new, case.v_new, two_layer_pool(case), case_metadata(case), 0.1)
