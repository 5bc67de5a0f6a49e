"""The Triton kernels' rows do not depend on their place in a tile, also as an AVX2 CPU runs them.
Under Triton's interpreter tl.dot is numpy's matmul, and OpenBLAS's AVX2 kernels sum some rows of
a tile in another order than others: a windowed model's row computed alone (a decode row, the
tile's first) and again inside a recomputed prompt (mid-tile) differed in its last bits there
(test_batch_invariant.py's `recompute`), while a Zen 4's OpenBLAS summed every row alike. Run as
an AVX2 CPU (lesser_cpu avx2: OpenBLAS's Haswell kernels), the kernels must agree bit for bit
with themselves: a prompt's windowed attention row by row against the whole prompt, and a matmul
row alone against the same row in each place of a tile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchpage.cpu_info import native_isa_level
from batchpage.kernels.testing import interpreter_skip_reason

ROOT = Path(__file__).resolve().parents[2]
_SKIP = interpreter_skip_reason()
pytestmark = [
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
    pytest.mark.skipif(native_isa_level().name == "portable", reason="a CPU without AVX2"),
]

CHECK = """
import torch
from batchpage.kernels.extend_attention import extend_attention
from batchpage.kernels.invariant_matmul import invariant_matmul, tiles
from batchpage.kernels.testing import make_paged_case

torch.manual_seed(0)
length, window = 75, 21
case = make_paged_case([length], [length], 2, 1, 64, 16, torch.float32, seed=3)
whole = extend_attention(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                         case.block_table, length, sliding_window=window)
differ = []
for p in range(length):  # row p alone: a decode row over the first p + 1 tokens
    one = extend_attention(case.q[p : p + 1].contiguous(), case.k_cache, case.v_cache,
                           torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([p + 1], dtype=torch.int32), case.block_table, 1,
                           sliding_window=window)
    differ += [] if torch.equal(one[0], whole[p]) else [p]
print("attention rows that differ:", differ)

rows = tiles(torch.float32)[0]
x, w = torch.randn(1, 200), torch.randn(96, 200)
alone = invariant_matmul(x, w)[0]
placed = []
for at in range(rows):
    batch = torch.randn(rows, 200)
    batch[at] = x[0]
    placed += [] if torch.equal(invariant_matmul(batch, w)[at], alone) else [at]
print("matmul places that differ:", placed)
"""


def test_a_row_is_the_same_bits_wherever_it_sits_in_the_tile_as_an_avx2_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.kernels.lesser_cpu", "avx2", sys.executable, "-c", CHECK],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "attention rows that differ: []",
        "matmul places that differ: []",
    ], done.stdout
