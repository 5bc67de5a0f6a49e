"""The C++ paged-decode kernel (kernels/cpu_paged_decode.cpp and its launcher) against the torch
reference, the CPU backend against the torch backend, and the engine with attention_backend="cpu"
against "torch".

The kernel is built once per machine and source (compiled the first time) into torch's
extension folder.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.attention.cpu_backend import CpuPagedAttention
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.cache.kv_cache import KVCache
from batchpage.host_memory import keep_freed_memory
from batchpage.kernels import cpu_paged_decode
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from batchpage.kernels.reference import ref_paged_attention
from batchpage.kernels.testing import (
    PagedCase,
    hide_outside_windows,
    make_paged_case,
    tolerances,
)
from tests.attention.case_inputs import case_metadata, hidden_pool, mixed_step_lens, two_layer_pool
from tests.kernels.bench_smoke import run_bench_smoke
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer


@pytest.fixture(scope="session")
def kernel() -> CpuPagedDecode:
    return CpuPagedDecode.build()


def _decode(kernel: CpuPagedDecode, case: PagedCase, scale: float) -> torch.Tensor:
    return kernel(case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, scale)


def _reference(case: PagedCase, scale: float) -> torch.Tensor:
    return ref_paged_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table,
        scale,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # The bf16 PV on AVX512-BF16 takes a kv head's query heads in batches of up to 4 (2 at
    # head_dim 128): groups of 1, 2, 3, 4 + 4 and 4 + 1 at 64, and of 2 at 128.
    [(4, 4, 64), (6, 3, 64), (8, 1, 64), (10, 2, 64), (9, 3, 64), (8, 2, 80), (4, 2, 128)],
)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(kernel, dtype, heads, kv_heads, head_dim, block_size):
    # Lengths 1, exactly one block, one past a block, and long; the pool is NaN everywhere a
    # sequence does not own, so reading one slot too far poisons the output.
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 200]
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, block_size, dtype, seed=3
    )
    scale = head_dim**-0.5
    out = _decode(kernel, case, scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, _reference(case, scale), **tolerances(dtype))


@pytest.mark.parametrize(
    ("dtype", "head_dim", "window", "softcap"),
    [
        pytest.param(torch.float32, 64, 5, None, id="f32-vector-window-lt-block"),
        pytest.param(torch.float32, 80, 20, 5.0, id="f32-plain-window-in-block-cap"),
        pytest.param(torch.bfloat16, 64, 1, None, id="bf16-window-1"),
        pytest.param(torch.float32, 128, None, 5.0, id="f32-vector-cap-only"),
        pytest.param(torch.float16, 80, 37, 10.0, id="f16-window-over-shared-cap"),
    ],
)
def test_window_and_softcap_match_reference(kernel, dtype, head_dim, window, softcap):
    """Windows shorter than a block, ending inside one and reaching back into the two shared
    prefix blocks; every slot before a window is NaN, so reading one fails the test."""
    block_size = 16
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 97, 200]
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), 6, 2, head_dim, block_size, dtype, shared_blocks=2, seed=5
    )
    scale = 1.0 if softcap else head_dim**-0.5  # large scores, so the cap bends them
    ref = ref_paged_attention(
        case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens, case.block_table,
        scale, sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    if window:
        case = hide_outside_windows(case, window)
    out = kernel(
        case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, **tolerances(dtype))


def test_decode_shared_blocks_and_strided_rows(kernel):
    # Sequences whose tables start with the same physical blocks (prefix caching, forks), and q
    # rows taken from a wider tensor (the row stride is not heads * head_dim).
    case = make_paged_case(
        [40, 41, 57, 33], [1, 1, 1, 1], 6, 2, 64, 16, torch.float32, shared_blocks=2
    )
    assert (case.block_table[:, :2] == case.block_table[0, :2]).all()
    wide = torch.randn(4, 2, 6, 64)
    wide[:, 1] = case.q
    q = wide[:, 1]
    out = kernel(q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, 0.125)
    torch.testing.assert_close(out, _reference(case, 0.125), **tolerances(torch.float32))


def test_library_name_follows_the_sources() -> None:
    # Torch's loader reuses a library of the same name: an edited kernel, or an edited header
    # that it includes, must get a new name.
    from batchpage.kernels.cpu_build import HEADERS, extension_name

    source, header = cpu_paged_decode.SOURCE.read_bytes(), HEADERS[0].read_bytes()
    name = extension_name("k", [source, header])
    assert name == extension_name("k", [source, header])
    assert name != extension_name("k", [source + b"\n// edited\n", header])
    assert name != extension_name("k", [source, header + b"\n// edited\n"])
    assert name != extension_name("other", [source, header])


def test_launcher_rejects_bad_inputs(kernel):
    case = make_paged_case([20, 5], [1, 1], 4, 2, 64, 8, torch.float32)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, 0.1)
    too_long = case.seq_lens.clone()
    too_long[0] = case.block_table.shape[1] * 8 + 1
    with pytest.raises(AssertionError):
        kernel(*args[:4], too_long, 0.1)
    with pytest.raises(AssertionError):
        kernel(*args[:3], case.block_table.long(), *args[4:])
    with pytest.raises(AssertionError):
        kernel(case.q.half(), *args[1:])
    bad_table = case.block_table.clone()
    bad_table[1, 0] = case.k_cache.shape[0]
    with pytest.raises(AssertionError):
        kernel(*args[:3], bad_table, *args[4:])


@pytest.fixture(scope="session")
def prefill() -> CpuPagedPrefill:
    return CpuPagedPrefill.build()


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        pytest.param([16, 9, 33, 70], [1, 1, 1, 1], id="decode"),
        pytest.param([12, 21, 9, 40], [12, 1, 5, 1], id="mixed-prefill-decode"),
        pytest.param([12, 21, 9, 40], [12, 21, 5, 17], id="prompts-and-chunks"),
    ],
)
def test_backend_matches_torch_backend(kernel, prefill, seq_lens, query_lens):
    block_size, heads, kv_heads, head_dim = 8, 6, 2, 64
    case = make_paged_case(
        seq_lens, query_lens, heads, kv_heads, head_dim, block_size, torch.float32,
        shared_blocks=1, write_new=False,
    )  # fmt: skip
    meta = case_metadata(case)
    pools = [two_layer_pool(case), two_layer_pool(case)]
    scale = head_dim**-0.5
    args = (case.q, case.k_new, case.v_new)
    step = CpuPagedAttention(kernel, prefill).plan(meta)
    out = step(1, *args, pools[0], meta, scale)
    ref = TorchPagedAttention().plan(meta)(1, *args, pools[1], meta, scale)
    torch.testing.assert_close(out, ref, **tolerances(torch.float32))
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="call backend.plan\\(meta\\) for each step"):
        step(1, *args, pools[0], case_metadata(case), scale)


def test_backend_in_bf16_matches_torch_backend_in_float32(kernel, prefill):
    """Prompts, a chunk and decodes in a bf16 pool, against the torch backend over the same
    bf16 values held in float32."""
    seq_lens, query_lens = [12, 21, 9, 40, 30], [12, 21, 5, 17, 1]
    case = make_paged_case(
        seq_lens, query_lens, 6, 2, 64, 8, torch.bfloat16, shared_blocks=1, write_new=False
    )
    meta = case_metadata(case)
    pool = two_layer_pool(case)
    ref_pool = KVCache(k=[t.float() for t in pool.k], v=[t.float() for t in pool.v])
    args = (case.q, case.k_new, case.v_new)
    out = CpuPagedAttention(kernel, prefill).plan(meta)(1, *args, pool, meta, 0.125)
    ref_args = tuple(t.float() for t in args)
    ref = TorchPagedAttention().plan(meta)(1, *ref_args, ref_pool, meta, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **tolerances(torch.bfloat16))


@pytest.mark.parametrize(
    ("window", "softcap"), [(None, 5.0), (3, None), (6, 8.0), (21, None)], ids=str
)
def test_backend_windows_match_torch_backend(kernel, prefill, window, softcap):
    """A step of decodes over shared prefix blocks, a prompt and a chunk (kernel and torch parts
    together), then its decodes alone (kernel only), with the blocks wholly before every window
    NaN: both backends read only inside the windows and agree."""
    seq_lens, query_lens = mixed_step_lens(4)
    decode = [b for b, n in enumerate(query_lens) if n == 1]
    steps = [(seq_lens, query_lens), ([seq_lens[b] for b in decode], [1] * len(decode))]
    for lens, q_lens in steps:
        case = make_paged_case(
            lens, q_lens, 6, 2, 64, 4, torch.float32, shared_blocks=2, write_new=False
        )
        meta = case_metadata(case)
        pools = [hidden_pool(case, window), hidden_pool(case, window)]
        scale = 1.0 if softcap else 0.125
        args = (case.q, case.k_new, case.v_new)
        extra = dict(sliding_window=window, logit_softcap=softcap)
        step = CpuPagedAttention(kernel, prefill).plan(meta)
        out = step(1, *args, pools[0], meta, scale, **extra)
        ref = TorchPagedAttention().plan(meta)(1, *args, pools[1], meta, scale, **extra)
        assert out.isfinite().all()
        torch.testing.assert_close(out, ref, **tolerances(torch.float32))


def test_plan_sends_decodes_to_the_decode_kernel_and_prompts_and_chunks_to_the_prefill_kernel(
    kernel, prefill
):
    case = make_paged_case([4096, 300, 100_000, 7], [512, 300, 1, 1], 4, 2, 8, 16, torch.float32)
    meta = case_metadata(case)
    step = CpuPagedAttention(kernel, prefill).plan(meta)
    assert not step.all_in_kernel
    assert step.decode_rows.tolist() == [812, 813]
    assert step.decode_lens.tolist() == [100_000, 7]
    assert torch.equal(step.decode_tables, meta.block_tables[[2, 3]])
    assert step.prefill_seqs.tolist() == [0, 1]
    decodes = CpuPagedAttention(kernel, prefill).plan(case_metadata(make_paged_case(
        [40, 7], [1, 1], 4, 2, 8, 16, torch.float32
    )))  # fmt: skip
    assert decodes.all_in_kernel and decodes.decode_lens.tolist() == [40, 7]


@pytest.mark.parametrize("variant", ["llama_hd80_mqa", "qwen2_bias_gqa"])
def test_engine_cpu_backend_same_greedy_tokens(kernel, variant: str, tmp_path: Path) -> None:
    folder = save_hf_folder(build_hf_model(variant), tmp_path / variant, tiny_tokenizer())
    rng = random.Random(1)
    shared = [rng.randrange(3, 320) for _ in range(16)]
    prompts = [
        [rng.randrange(3, 320) for _ in range(5)],
        shared + [rng.randrange(3, 320) for _ in range(9)],
        shared + [rng.randrange(3, 320) for _ in range(1)],
        [rng.randrange(3, 320) for _ in range(24)],
        [rng.randrange(3, 320) for _ in range(61)],
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            model=str(folder), attention_backend=backend, dtype="float32", block_size=8,
            kv_cache_memory=2**22, seed=0, max_num_batched_tokens=32,
        )  # fmt: skip
        name = type(llm.engine.runner.attention).__name__
        assert name == {"torch": "TorchPagedAttention", "cpu": "CpuPagedAttention"}[backend]
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu"] == tokens["torch"]


def test_auto_backend_on_cpu_is_the_kernel(kernel, tmp_path: Path) -> None:
    folder = save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path / "m", tiny_tokenizer())
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=2**22)
    assert isinstance(llm.engine.runner.attention, CpuPagedAttention)


def test_keep_freed_memory_applies_on_glibc() -> None:
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent


def test_advise_huge_pages_takes_large_cpu_tensors_only() -> None:
    import platform

    if platform.system() != "Linux":
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    from batchpage.host_memory import advise_huge_pages

    big = torch.empty(3 * 2**20)  # 12 MiB: holds whole 2 MiB pages whatever its alignment
    assert advise_huge_pages(big) is True
    big.zero_()
    assert not big.any()
    assert advise_huge_pages(torch.empty(1024)) is False  # smaller than two huge pages


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch) -> None:
    from batchpage.engine.model_runner import make_attention_backend

    def fail(cls, verbose: bool = False):
        raise cpu_paged_decode.KernelBuildError("no compiler here")

    monkeypatch.setattr(cpu_paged_decode.CpuPagedDecode, "build", classmethod(fail))
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match="no compiler here.*attention_backend='torch'"):
        assert isinstance(make_attention_backend("auto", cpu), TorchPagedAttention)
    with pytest.raises(cpu_paged_decode.KernelBuildError, match="no compiler here"):
        make_attention_backend("cpu", cpu)
    assert isinstance(make_attention_backend("torch", cpu), TorchPagedAttention)


def test_config_names_the_backends() -> None:
    from batchpage.engine.config import EngineConfig

    assert EngineConfig(attention_backend="cpu").attention_backend == "cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton"):
        EngineConfig(attention_backend="gpu")
    with pytest.raises(ValueError, match="attention_backend='cpu' runs the C\\+\\+ kernel"):
        EngineConfig(attention_backend="cpu", device="cuda")


def test_attention_benchmark_smoke(kernel, tmp_path: Path) -> None:
    """The benchmark runs, here with --baseline naming this kernel's own source (the build is
    then the cached one): every decode case gains the baseline's column, and in float32 the
    prefill kernel gives the torch backend's outputs."""
    from batchpage.kernels.cpu_paged_decode import SOURCE

    stdout, results = run_bench_smoke(
        "jobs.bench.cpu_attention", tmp_path / "attention.json", "--baseline", str(SOURCE)
    )
    assert "| decode rows x context |" in stdout and "| kernel vs baseline |" in stdout
    assert "| new rows | torch ms | cpu kernel ms |" in stdout
    decode = [r for r in results if r["kind"] == "decode"]
    assert [r["case"] for r in decode] == [
        "8 x 40", "8 x 10..60, longest first", "4 x 40, first 32 shared (cached)",
    ]  # fmt: skip
    assert all(r["cpu_ms"] > 0 and r["torch_ms"] > 0 and r["baseline_ms"] > 0 for r in decode)
    assert all(r["copies"] >= 1 for r in decode)
    prefill = [r for r in results if r["kind"] == "prefill"]
    assert [r["case"] for r in prefill] == ["2 prompts of 20", "chunk of 8 after 40"]
    assert all(r["cpu_ms"] > 0 and r["torch_ms"] > 0 for r in prefill)
    assert all(r["max_abs_diff"] < 1e-4 for r in prefill)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_torch(kernel, dtype) -> None:
    """New K/V rows, taken as the Attention layer takes them (slices of the qkv rows), land in
    their slots as torch's write_kv puts them; every other slot keeps its value."""
    from batchpage.attention.torch_backend import write_kv

    gen = torch.Generator().manual_seed(3)
    pools = [torch.randn(12, 4, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    qkv = torch.randn(5, 6 * 16, generator=gen).to(dtype)
    k, v = qkv[:, 2 * 16 : 4 * 16].view(5, 2, 16), qkv[:, 4 * 16 :].view(5, 2, 16)
    slots = torch.tensor([47, 0, 13, 22, 5])
    ours = [p.clone() for p in pools]
    kernel.write_kv(k, v, ours[0], ours[1], slots)
    write_kv(k, v, pools[0], pools[1], slots)
    assert torch.equal(ours[0], pools[0]) and torch.equal(ours[1], pools[1])
    with pytest.raises(AssertionError):
        kernel.write_kv(k, v, ours[0], ours[1], torch.tensor([48, 0, 1, 2, 3]))  # past the pool
    with pytest.raises(AssertionError):
        kernel.write_kv(k, v, ours[0], ours[1], slots.int())
