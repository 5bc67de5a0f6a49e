"""Kernels over the paged KV pool, shipped as batchpage.kernels.

Modules: kv_write (store new K/V at their slots), paged_decode_attention (single-pass and split-KV
decode), extend_attention (varlen prefill over a paged prefix), reference (torch references),
testing (random paged inputs for the tests and jobs/bench/gpu.py), all Triton; and for CPUs, the
launchers of six C++ extensions (their .cpp files and cpu_vec.h ship as package data, built by
cpu_build on first use): cpu_paged_decode (decode attention and the K/V write), cpu_paged_prefill
(attention for the rows of prompts and chunks), cpu_layer_ops (RMSNorm, residual add +
RMSNorm, SiLU(gate) * up, rope, the greedy argmax), cpu_bf16_linear (bf16 linears on
AVX512-BF16), cpu_int_linear (integer weight-only linears: W4A16, W8A16) and cpu_a8_linear
(integer weights times int8 activations on AVX512-VNNI: W8A8, W4A8).

Triton decides at decoration time, when a kernel module is first imported, whether @triton.jit
compiles for a GPU or runs in its numpy interpreter. Without CUDA nothing could compile, so this
package turns the interpreter on first (unless TRITON_INTERPRET is already set either way): the
same kernels then run, slowly, on CPU tensors, and the import order of tests does not matter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
