"""Index math past 2**31 elements: block ids whose offset (id * block stride) does not fit int32.

A kernel that multiplied in int32 would address the wrong memory, which on CPU is a segfault more
often than a wrong number, so the checks run in a child process (this file run as a script) and
the test reports its exit status and output. The pool is > 2**31 fp16 elements (4 GiB) of virtual
memory per K and V, allocated with torch.empty and never touched except for the few blocks in use,
so it costs a few MB of real memory.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from batchpage.kernels.testing import interpreter_skip_reason, make_paged_case, tolerances

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
BLOCK_SIZE, HEAD_DIM = 16, 64
NUM_BLOCKS = 2**31 // (BLOCK_SIZE * HEAD_DIM) + 64  # one kv head: block stride is 1024 elements


def check_all(device: str) -> None:
    from batchpage.kernels.extend_attention import extend_attention
    from batchpage.kernels.kv_write import write_kv
    from batchpage.kernels.paged_decode_attention import paged_decode_attention
    from batchpage.kernels.reference import ref_paged_attention, ref_write_kv

    case = make_paged_case(
        [40, 17], [7, 1], 4, 1, HEAD_DIM, BLOCK_SIZE, torch.float16, device=device,
        num_blocks=NUM_BLOCKS, lazy_pool=True, write_new=False,
    )  # fmt: skip
    used = case.block_table[case.block_table > 0]  # 0 pads the shorter table
    assert int(used.min()) * case.k_cache.stride(0) > 2**31

    # Write: compare the written slots themselves (the pool is too big to compare whole).
    write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping)
    flat_k = case.k_cache.view(-1, 1, HEAD_DIM)
    assert torch.equal(flat_k[case.slot_mapping], case.k_new)
    assert torch.equal(case.v_cache.view(-1, 1, HEAD_DIM)[case.slot_mapping], case.v_new)
    ref_write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping)

    args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table)
    ref = ref_paged_attention(*args)
    out = extend_attention(*args, case.max_seqlen_q, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **tolerances(torch.float16))

    # Decode over the same pool: the last row of each sequence, one query token each.
    rows = case.cu_seqlens_q[1:].long() - 1
    q = case.q[rows]
    dec_args = (q, case.k_cache, case.v_cache, case.seq_lens, case.block_table)
    dec_ref = ref_paged_attention(
        q, case.k_cache, case.v_cache, torch.arange(3, dtype=torch.int32, device=device),
        case.seq_lens, case.block_table,
    )  # fmt: skip
    for splits in (1, 2):
        dec = paged_decode_attention(*dec_args, num_splits=splits, tile_n=16)
        torch.testing.assert_close(dec, dec_ref, **tolerances(torch.float16))


def test_block_offsets_past_int32():
    if torch.cuda.is_available():
        check_all("cuda")  # a bad address is a CUDA error here, not a crash of the process
        return
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"


if __name__ == "__main__":
    check_all("cpu")
