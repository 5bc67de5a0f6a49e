"""The Triton paged-attention kernels and the engine on a CUDA device.

    python -m jobs.bench.gpu                          # (b) + (c) + (d) on the CUDA device
    python -m jobs.bench.gpu --parts b --dtype bfloat16 \
        --out jobs/bench/results/gpu_h200_kernels.json
    python -m jobs.bench.gpu --parts d --e2e-formats fp8 --e2e-requests 224  # 8B, 1000/1000
    python -m jobs.bench.gpu --smoke                  # CPU: tiny shapes, Triton interpreter

The kernels' correctness on CUDA is the test suite's (tests/kernels, tests/attention).
(b) decode attention over batch x context: median time, achieved bandwidth (bytes of K/V read /
    time) as a fraction of --peak-tbps, and the ratio to torch's scaled_dot_product_attention on
    the same K/V stored contiguously (the largest difference of their outputs too).
(c) end-to-end engine throughput (batchpage.LLM) on a randomly initialised 1B-class Llama
    (Llama-3.2-1B shapes), paged KV (kv_allocator="paged") with and without CUDA graphs of
    decode steps (enforce_eager), and contiguous per-sequence reservations
    (kv_allocator="static"), paged with batch_invariant (the Triton matmul, norms and extend
    attention), and the same shape as GPTQ int4 and FP8 checkpoints kept quantized (the Triton
    int kernel), all with the Triton attention backend; each with its step time, the parts of
    a step, the step against the roofline of reading its weights and K/V, and (on the same
    weights) whether its greedy tokens are the first configuration's.
    `--engine-max-seqs 512` measures the engine at 512 running.
(d) a Llama-3.1-8B shape (random weights drawn on the GPU, FP8 blocks and bf16) at 1000 tokens
    in / 1000 out beside TensorRT-LLM's published figure on the same GPU kind
    (jobs/bench/gpu_8b.py, which says how the request count is sized); --smoke: a tiny stand-in.

Results print as Markdown tables (ready for BENCHMARKS.md); --out also writes them as JSON.
The exit status is 1 when the paged kernel's output differs from SDPA's by more than 0.05.
"""

from __future__ import annotations

import gc
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Importing batchpage.kernels on a machine without CUDA turns on Triton's interpreter.
from batchpage.engine.config import DTYPES
from batchpage.kernels.paged_decode_attention import (
    choose_num_splits,
    device_num_sms,
    paged_decode_attention,
)
from batchpage.metrics import STEP_PARTS
from jobs.bench import report
from jobs.bench.random_models import write_llama

Row = dict[str, Any]


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call: CUDA events via triton's do_bench (which also flushes L2
    between calls, so K/V come from HBM as in a real step); wall clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


# ---------------------------------------------------------------------------------------------
# (b) decode bandwidth and the ratio to SDPA on contiguous K/V


def decode_inputs(
    batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The same K/V twice: contiguous [B, kv_heads, ctx, d] for SDPA and paged through a shuffled
    block table for the kernel (filled one sequence at a time to bound the temporary memory)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, ctx, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, head_dim, generator=gen, device=device, dtype=dtype)
    nblk = ctx // block_size
    table = torch.randperm(batch * nblk, device=device).view(batch, nblk)
    shape = (batch * nblk, block_size, kv_heads, head_dim)
    k_cache = torch.empty(shape, device=device, dtype=dtype)
    v_cache = torch.empty(shape, device=device, dtype=dtype)
    for b in range(batch):
        # [kvh, ctx, d] -> [nblk, block_size, kvh, d], page i of sequence b -> block table[b, i]
        k_cache[table[b]] = k[b].view(kv_heads, nblk, block_size, head_dim).permute(1, 2, 0, 3)
        v_cache[table[b]] = v[b].view(kv_heads, nblk, block_size, head_dim).permute(1, 2, 0, 3)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, k, v, k_cache, v_cache, table.to(torch.int32), seq_lens


def sdpa_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA over contiguous K/V with native GQA (no repeated K/V): [B, H, 1, d] x [B, kvh, L, d].
    Pinned to the flash backend where it accepts the shape, so that the baseline is the fast
    kernel and not the math fallback (which would materialise repeated K/V); returns its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q.unsqueeze(2)
    for backend in (SDPBackend.FLASH_ATTENTION, None):

        def run(backend: SDPBackend | None = backend) -> torch.Tensor:
            if backend is None:
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        try:
            run()
        except RuntimeError:
            continue
        return run, "flash" if backend is not None else "default"
    raise RuntimeError("scaled_dot_product_attention rejected the decode shape")


def bench_decode(
    device: torch.device,
    dtype: torch.dtype,
    peak_tbps: float,
    batches: list[int],
    contexts: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    max_kv_gib: float,
) -> list[Row]:
    rows: list[Row] = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    sms = device_num_sms(device)
    for ctx in contexts:
        assert ctx % block_size == 0, "contexts are whole pages in this sweep"
        for batch in batches:
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * itemsize  # K and V, read once
            if kv_bytes > max_kv_gib * 2**30:  # two copies live: paged pool + contiguous
                rows.append(dict(batch=batch, ctx=ctx, skipped=f"> {max_kv_gib} GiB of K/V"))
                continue
            q, k, v, k_cache, v_cache, table, seq_lens = decode_inputs(
                batch, ctx, heads, kv_heads, head_dim, block_size, dtype, device
            )
            out = torch.empty_like(q)

            def paged(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, table=table,
                      out=out, ctx=ctx) -> torch.Tensor:  # fmt: skip
                return paged_decode_attention(
                    q, k_cache, v_cache, seq_lens, table, max_seqlen_k=ctx, out=out
                )

            sdpa, sdpa_backend = sdpa_decode(q, k, v)
            err = (paged().float() - sdpa().squeeze(2).float()).abs().max().item()
            t_paged = time_ms(paged, device)
            t_sdpa = time_ms(sdpa, device)
            bw = kv_bytes / (t_paged * 1e-3) / 1e12  # TB/s
            rows.append(
                dict(
                    batch=batch,
                    ctx=ctx,
                    splits=choose_num_splits(batch, kv_heads, ctx, sms),
                    paged_ms=t_paged,
                    sdpa_ms=t_sdpa,
                    sdpa_backend=sdpa_backend,
                    ratio_to_sdpa=t_paged / t_sdpa,
                    tbps=bw,
                    pct_peak=100 * bw / peak_tbps,
                    sdpa_pct_peak=100 * kv_bytes / (t_sdpa * 1e-3) / 1e12 / peak_tbps,
                    max_abs_err_vs_sdpa=err,
                )
            )
            report.log(", ".join(f"{k} {table_cell(v)}" for k, v in rows[-1].items()))
            del q, k, v, k_cache, v_cache, table, seq_lens, out, sdpa
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# (c) engine throughput, paged vs contiguous KV

# Llama-3.2-1B's shapes (1.24B parameters with tied embeddings).
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
    rope_theta=10000.0, tie_word_embeddings=True,
)  # fmt: skip


def write_random_llama(
    folder: Path,
    shape: dict[str, Any],
    dtype: torch.dtype,
    quant: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> Path:
    """A HF Llama folder of random weights (jobs/bench/random_models.py; with `quant`, its
    linears GPTQ's or FP8's; drawn on `device`) with a word-level tokenizer over the vocabulary:
    throughput does not depend on the values, prompts are token ids, and nothing needs a
    dataset on the device machine."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, "t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                                   eos_token="t2")  # fmt: skip
    return write_llama(folder, shape, dtype, fast, quant, device)


def quantized_configs(group: int) -> dict[str, dict[str, Any]]:
    """GPTQ int4 and FP8 block checkpoints of the same shape, groups / blocks of `group`."""
    return {
        "GPTQ int4": {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                      "desc_act": False},
        "FP8 block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [group, group]},
    }  # fmt: skip


def bytes_per_token(shape: dict[str, Any], dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    heads, dim, layers = shape["num_key_value_heads"], shape["head_dim"], shape["num_hidden_layers"]
    return 2 * layers * heads * dim * dtype.itemsize


def bench_engine(
    device: torch.device,
    smoke: bool,
    num_prompts: int,
    prompt_len: int,
    max_tokens: int,
    kv_gib: float | None = None,
    max_num_seqs: int = 256,
    peak_tbps: float = 4.8,
) -> list[Row]:
    """Throughput of batchpage.LLM: paged KV with CUDA graphs of decode steps and without
    (enforce_eager), and contiguous (static) KV, Triton attention, all in the same KV memory
    (kv_gib; default: the engine's share of free memory); with the time of a step and of its
    parts, and the step against its roofline (weights and K/V read at peak_tbps). Each
    configuration that fails is reported with its error instead of stopping the script."""
    try:
        from batchpage import SamplingParams
    except ImportError as exc:
        return [dict(config="all", error=f"batchpage.LLM unavailable: {exc}")]

    shape = LLAMA_TINY if smoke else LLAMA_1B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    # Ragged prompt lengths around prompt_len: a contiguous allocator must reserve the maximum.
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(prompt_len // 2, prompt_len))]
        for _ in range(num_prompts)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # On CPU the pool is zero-filled RAM: keep it small (the default is 10% of free memory).
    memory = dict(kv_cache_memory=2**24) if device.type == "cpu" else {}
    if kv_gib is not None:
        memory = dict(kv_cache_memory=int(kv_gib * 2**30))
    rows: list[Row] = []
    first_tokens: list[list[int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # Drawn on the device (a GPU draws them faster than the host), the cache then emptied:
        # the engine sizes its pool by the GPU's free memory.
        dense = write_random_llama(Path(tmp) / "llama", shape, dtype, device=device)
        configs: list[tuple[str, dict[str, Any], Path]] = [
            ("paged, CUDA graphs", dict(kv_allocator="paged"), dense),
            ("paged, eager", dict(kv_allocator="paged", enforce_eager=True), dense),
            ("contiguous, CUDA graphs", dict(kv_allocator="static"), dense),
            ("paged, CUDA graphs, batch_invariant",
             dict(kv_allocator="paged", batch_invariant=True), dense),
        ]  # fmt: skip
        for fmt, quant in quantized_configs(32 if smoke else 128).items():
            folder = write_random_llama(
                Path(tmp) / fmt.replace(" ", "_"), shape, dtype, quant, device
            )
            configs.append((f"paged, CUDA graphs, {fmt}", dict(quantized_weights=True), folder))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for name, kwargs, folder in configs:
            llm_kwargs = dict(
                dtype=str(dtype).removeprefix("torch."), attention_backend="triton",
                prefix_caching=False, seed=0, max_model_len=prompt_len + max_tokens + 16,
                max_num_seqs=max_num_seqs, **kwargs, **memory,
            )  # fmt: skip
            row, tokens = measure_engine(
                name, folder, llm_kwargs, prompts, params, shape, peak_tbps, prompts[:8], params
            )
            rows.append(row)
            if tokens is None:
                continue
            first_tokens = first_tokens or tokens
            if folder == dense:
                row["same_greedy_as_first"] = sum(
                    a == b for a, b in zip(tokens, first_tokens, strict=True)
                )
    return rows


def weight_bytes_of(folder: Path) -> int:
    """The bytes of a folder's safetensors files (one file or shards)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def measure_engine(
    name: str,
    folder: Path,
    llm_kwargs: dict[str, Any],
    prompts: list[list[int]],
    params: Any,
    shape: dict[str, Any],
    peak_tbps: float,
    warmup_prompts: list[list[int]],
    warmup_params: Any,
) -> tuple[Row, list[list[int]] | None]:
    """One configuration of batchpage.LLM over `folder`: (its row, each prompt's greedy tokens),
    or (a row with its error, None) when it fails, so that the caller carries on. The row has
    the throughput, the time of a step and of its parts, the load time, and the step against
    its roofline: a decode step reads every weight once and each running sequence's K/V, at
    the mean context (prompt, then half the output) at `peak_tbps`."""
    from batchpage import LLM

    dtype = getattr(torch, llm_kwargs["dtype"])
    weight_bytes = weight_bytes_of(folder)
    try:
        start = time.perf_counter()
        llm = LLM(model=str(folder), **llm_kwargs)
        load_s = time.perf_counter() - start
        # Warm-up off the clock: the first steps JIT-compile the Triton kernels, which would
        # otherwise be charged to whichever configuration runs first.
        llm.generate(warmup_prompts, warmup_params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    except Exception as exc:  # report and carry on with the other configurations
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    if error is not None:
        release_device_memory()
        return dict(config=name, error=error), None
    tokens = [o.outputs[0].token_ids for o in outs]
    generated = sum(len(t) for t in tokens)
    stats = llm.stats
    steps = max(1, stats["steps"])
    part_ms = {p: 1e3 * stats["step_time_s"][p] / steps for p in STEP_PARTS}
    step_ms = 1e3 * elapsed / steps
    context = sum(len(p) for p in prompts) / len(prompts) + params.max_tokens / 2
    kv_bytes = stats["peak_running"] * context * bytes_per_token(shape, dtype)
    roofline_ms = 1e3 * (weight_bytes + kv_bytes) / (peak_tbps * 1e12)
    row = dict(
        config=name,
        weight_gib=weight_bytes / 2**30,
        load_s=load_s,
        kv_blocks=stats.get("kv_blocks_total"),
        prompts=len(prompts),
        generated_tokens=generated,
        elapsed_s=elapsed,
        output_tokens_per_s=generated / elapsed,
        peak_running=stats.get("peak_running"),
        kv_utilization=stats.get("kv_utilization"),
        preemptions=stats.get("preemptions"),
        steps=stats.get("steps"),
        step_ms=step_ms,
        **{f"{p}_ms": v for p, v in part_ms.items()},
        roofline_ms=roofline_ms,
        step_over_roofline=step_ms / roofline_ms,
    )
    del llm, outs
    release_device_memory()
    return row, tokens


def release_device_memory() -> None:
    """Free a dropped engine's GPU memory before the next one sizes its pool by what is free:
    its objects may hold each other in cycles, which only the collector frees, and the
    caching allocator keeps freed blocks until emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------


def table_cell(v: object) -> str:
    """Three significant digits: errors near 1e-3 and times near 1e-2 ms both stay readable."""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown(title: str, rows: list[Row]) -> str:
    if not rows:
        return f"### {title}\n\n(no rows)\n"
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    table = report.markdown_table(keys, [[table_cell(r.get(k, "")) for k in keys] for r in rows])
    return f"### {title}\n\n{table}\n"


def main(argv: list[str] | None = None) -> int:
    ap = report.parser(__doc__)
    ap.add_argument("--parts", default="b,c,d", help="b (decode), c (the engine), d (8B e2e)")
    ap.add_argument("--dtype", default="float16", choices=DTYPES)
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak, TB/s (H200: 4.8)")
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-kv-gib", type=float, default=40.0, help="skip larger decode shapes")
    ap.add_argument("--engine-prompts", type=int, default=512)
    ap.add_argument("--engine-prompt-len", type=int, default=512)
    ap.add_argument("--engine-max-tokens", type=int, default=256)
    ap.add_argument("--engine-kv-gib", type=float, help="KV memory of both configurations")
    ap.add_argument("--engine-max-seqs", type=int, default=256, help="max_num_seqs of both")
    ap.add_argument("--e2e-formats", default="fp8,bf16", help="(d)'s formats, in order")
    ap.add_argument("--e2e-requests", type=int, default=256)
    ap.add_argument("--e2e-prompt-len", type=int, default=1000)
    ap.add_argument("--e2e-max-tokens", type=int, default=1000)
    ap.add_argument("--e2e-max-seqs", type=int, default=256)
    ap.add_argument("--e2e-budget-s", type=float, help="(d): no format starts after this")
    ap.add_argument("--weights-dir", help="(d)'s temporary weight folders (default: TMPDIR)")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no CUDA device: only --smoke runs on CPU")
    dtype = getattr(torch, args.dtype)
    parts = set(args.parts.split(","))
    if not parts <= {"b", "c", "d"}:
        ap.error(f"--parts: of b, c, d (the kernel checks are tests/kernels'), got {args.parts}")
    if "d" in parts:
        from jobs.bench.gpu_8b import FORMATS  # it imports this module

        if not set(args.e2e_formats.split(",")) <= set(FORMATS):
            ap.error(f"--e2e-formats: a comma list of {', '.join(FORMATS)}, got {args.e2e_formats}")
    if args.smoke:  # tiny everything: the interpreter runs each program in numpy
        args.batches, args.contexts = "1,3", "32,64"
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 80, 16
        args.engine_prompts, args.engine_prompt_len, args.engine_max_tokens = 3, 12, 4
        args.e2e_requests, args.e2e_prompt_len, args.e2e_max_tokens = 3, 12, 4
    results: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=args.dtype,
        peak_tbps=args.peak_tbps,
        smoke=args.smoke,
    )
    tables: list[str] = []
    if "b" in parts:
        rows = bench_decode(
            device, dtype, args.peak_tbps, report.ints(args.batches), report.ints(args.contexts),
            args.heads, args.kv_heads, args.head_dim, args.block_size, args.max_kv_gib,
        )  # fmt: skip
        results["decode"] = rows
        title = (
            f"(b) decode: {args.heads} heads / {args.kv_heads} kv heads, head_dim {args.head_dim},"
            f" block {args.block_size}, {args.dtype}, peak {args.peak_tbps} TB/s"
        )
        tables.append(markdown(title, rows))
    if "c" in parts:
        rows = bench_engine(
            device, args.smoke, args.engine_prompts, args.engine_prompt_len,
            args.engine_max_tokens, args.engine_kv_gib, args.engine_max_seqs, args.peak_tbps,
        )  # fmt: skip
        results["engine"] = rows
        tables.append(markdown("(c) engine throughput, random-init Llama, Triton attention", rows))
    if "d" in parts:
        from jobs.bench.gpu_8b import bench_8b  # it imports this module

        rows = bench_8b(
            device, args.smoke, args.e2e_formats.split(","), args.e2e_requests,
            args.e2e_prompt_len, args.e2e_max_tokens, args.peak_tbps, args.e2e_max_seqs,
            args.e2e_budget_s, args.weights_dir,
        )  # fmt: skip
        results["e2e_8b"] = rows
        title = (
            f"(d) Llama-3.1-8B shape, random weights, {args.e2e_prompt_len} in / "
            f"{args.e2e_max_tokens} out, against TensorRT-LLM's FP8 figure"
        )
        tables.append(markdown(title, rows))

    print(f"Command: `{report.command_line()}`\n\n" + "\n".join(tables))
    if args.out:
        report.write_json(args.out, {"command": report.command_line(), **results})
    # `not <=` so that a NaN error counts as a failure
    bad = [r for r in results.get("decode", []) if not r.get("max_abs_err_vs_sdpa", 0) <= 0.05]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
