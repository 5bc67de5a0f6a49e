"""KV write kernel: new K/V land exactly in their slots and nowhere else."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.kv_write import write_kv
from batchpage.kernels.reference import ref_write_kv
from batchpage.kernels.testing import interpreter_skip_reason, make_paged_case

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaN marks slots nobody owns; they must stay NaN in both pools.
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "block_size", "dtype"),
    [
        (1, 64, 8, torch.float32),
        (3, 80, 16, torch.float16),  # 3 kv heads: SmolLM2's count, not a power of two
        (8, 128, 32, torch.float16),
    ],
)
def test_write_matches_reference(kv_heads, head_dim, block_size, dtype):
    case = make_paged_case(
        [block_size, 2 * block_size + 1, 5], [block_size, 3, 1], 8, kv_heads, head_dim,
        block_size, dtype, device=DEVICE, write_new=False,
    )  # fmt: skip
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    ref_write_kv(case.k_new, case.v_new, k_ref, v_ref, case.slot_mapping)
    write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping)
    assert _same(case.k_cache, k_ref) and _same(case.v_cache, v_ref)


def test_strided_input_padding_slots_and_cast():
    """K/V as slices of a fused QKV output in float32, stored into a float16 pool; slot -1 is a
    padding token and must not be written."""
    kv_heads, head_dim, block_size = 2, 64, 16
    pool = torch.full((6, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float16)
    k_cache, v_cache = pool.clone().to(DEVICE), pool.clone().to(DEVICE)
    qkv = torch.randn(4, 3 * kv_heads, head_dim, device=DEVICE)  # [T, q+k+v heads, d]
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.tensor([5 * block_size + 3, -1, 0, 2 * block_size + 15], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, k_ref, v_ref, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert _same(k_cache, k_ref) and _same(v_cache, v_ref)
    assert int(k_cache.isnan().logical_not().sum()) == 3 * kv_heads * head_dim


def test_rejects_int32_slots():
    case = make_paged_case([9], [1], 4, 2, 64, 8, torch.float32, device=DEVICE, write_new=False)
    with pytest.raises(AssertionError):
        write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping.int())
