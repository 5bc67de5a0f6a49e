"""GPU benchmark of the paged attention kernels (issue 5).

    python -m jobs.bench.gpu                          # (a) + (b) + (c) on the CUDA device
    python -m jobs.bench.gpu --parts b --peak-tbps 4.8 --out bench.json
    python -m jobs.bench.gpu --smoke                  # CPU: tiny shapes, Triton interpreter

(a) correctness: each kernel (KV write, decode single-pass / split-KV / auto, extend) against the
    torch references of batchpage.kernels.reference at real model shapes, ragged contexts,
    shuffled block tables, shared prefix blocks.
(b) decode attention over batch x context: median time, achieved bandwidth (bytes of K/V read /
    time) as a fraction of --peak-tbps, and the ratio to torch's scaled_dot_product_attention on
    the same K/V stored contiguously. Targets: >= 70% of peak and <= 1.2x SDPA at large batch and
    long context.
(c) end-to-end engine throughput (batchpage.LLM) on a randomly initialised 1B-class Llama
    (Llama-3.2-1B shapes), paged KV (kv_allocator="paged") with and without CUDA graphs of
    decode steps (enforce_eager), and contiguous per-sequence reservations
    (kv_allocator="static"), all with the Triton attention backend; each with its step time,
    the parts of a step, and the step against the roofline of reading its weights and K/V.
    `--engine-max-seqs 512` measures the engine at 512 running.

Results print as Markdown tables (ready for BENCHMARKS.md); --out also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
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
from batchpage.kernels.extend_attention import extend_attention
from batchpage.kernels.kv_write import write_kv
from batchpage.kernels.paged_decode_attention import (
    choose_num_splits,
    device_num_sms,
    paged_decode_attention,
)
from batchpage.kernels.reference import ref_paged_attention, ref_write_kv
from batchpage.kernels.testing import make_paged_case, tolerances
from batchpage.metrics import STEP_PARTS
from jobs.bench.report import log, markdown_table, write_json

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
# (a) correctness at real shapes


def check_kernels(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[Row]:
    rng = random.Random(0)
    rows: list[Row] = []
    # (heads, kv_heads, head_dim): Llama-3-8B, Llama-3.2-1B, a head_dim-80 model, MQA
    shapes = [(32, 8, 128), (32, 8, 64), (32, 32, 80), (16, 1, 128)]
    block_sizes = [16, 32]
    batch, max_ctx, max_new = (32, 4096, 512) if not smoke else (3, 40, 9)
    if smoke:
        shapes, block_sizes = [(4, 2, 80)], [8]
    tol = tolerances(dtype)

    def record(kernel: str, shape: tuple[int, ...], bs: int, err: float, ok: bool) -> None:
        h, kvh, d = shape
        rows.append(dict(kernel=kernel, heads=h, kv_heads=kvh, head_dim=d, block_size=bs,
                         max_abs_err=err, ok=ok))  # fmt: skip

    for shape in shapes:
        for bs in block_sizes:
            h, kvh, d = shape
            # decode: ragged contexts incl. page boundaries, shared first pages
            seq_lens = [rng.randint(1, max_ctx) for _ in range(batch - 2)] + [2 * bs, 2 * bs + 1]
            case = make_paged_case(
                seq_lens, [1] * batch, h, kvh, d, bs, dtype, device=device, shared_blocks=1,
                seed=rng.randrange(1 << 30),
            )  # fmt: skip
            args = (case.q, case.k_cache, case.v_cache, case.seq_lens, case.block_table)
            ref = ref_paged_attention(
                case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                case.block_table,
            )  # fmt: skip
            for name, splits in (("decode-single", 1), ("decode-split8", 8), ("decode-auto", 0)):
                out = paged_decode_attention(*args, num_splits=splits)
                err = (out.float() - ref.float()).abs().max().item()
                record(name, shape, bs, err, _close(out, ref, tol))

            # extend: new tokens after cached prefixes (some empty), one decode row mixed in
            q_lens = [rng.randint(1, max_new) for _ in range(max(2, batch // 4))] + [1]
            prefixes = [rng.choice([0, bs, rng.randint(0, max_ctx)]) for _ in q_lens]
            seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
            case = make_paged_case(
                seq_lens, q_lens, h, kvh, d, bs, dtype, device=device,
                shared_blocks=1, write_new=False, seed=rng.randrange(1 << 30),
            )  # fmt: skip
            k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
            ref_write_kv(case.k_new, case.v_new, k_ref, v_ref, case.slot_mapping)
            write_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, case.slot_mapping)
            same = torch.equal(k_ref.nan_to_num(), case.k_cache.nan_to_num()) and torch.equal(
                v_ref.nan_to_num(), case.v_cache.nan_to_num()
            )
            record("kv-write", shape, bs, 0.0 if same else float("nan"), same)
            args = (
                case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seq_lens,
                case.block_table,
            )  # fmt: skip
            out = extend_attention(*args, case.max_seqlen_q)
            ref = ref_paged_attention(*args)
            err = (out.float() - ref.float()).abs().max().item()
            record("extend", shape, bs, err, _close(out, ref, tol))
            del case, k_ref, v_ref
    return rows


def _close(out: torch.Tensor, ref: torch.Tensor, tol: dict[str, float]) -> bool:
    try:
        torch.testing.assert_close(out, ref, **tol)
    except AssertionError:
        return False
    return True


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
            log(", ".join(f"{k} {_cell(v)}" for k, v in rows[-1].items()))
            del q, k, v, k_cache, v_cache, table, seq_lens, out, sdpa
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def decode_verdict(rows: list[Row], min_batch: int, min_ctx: int) -> Row:
    """The issue's targets over the large-batch, long-context corner of the sweep."""
    big = [r for r in rows if "paged_ms" in r and r["batch"] >= min_batch and r["ctx"] >= min_ctx]
    if not big:
        return dict(checked=0)
    worst_pct = min(r["pct_peak"] for r in big)
    worst_ratio = max(r["ratio_to_sdpa"] for r in big)
    return dict(
        checked=len(big),
        worst_pct_peak=worst_pct,
        worst_ratio_to_sdpa=worst_ratio,
        meets_70pct_peak=worst_pct >= 70.0,
        meets_1_2x_sdpa=worst_ratio <= 1.2,
    )


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


def write_random_llama(folder: Path, shape: dict[str, Any], dtype: torch.dtype) -> Path:
    """A HF Llama folder (config.json, model.safetensors, tokenizer) with random weights, made
    without transformers' model classes: N(0, 0.02) matrices, unit norms. Throughput does not
    depend on the values; the tokenizer is a word-level one over the vocabulary, prompts are
    token ids anyway."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d, nh, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    vocab = shape["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).to(dtype)

    weights = {
        "model.embed_tokens.weight": mat(vocab, h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": mat(nh * d, h),
            p + "self_attn.k_proj.weight": mat(nkv * d, h),
            p + "self_attn.v_proj.weight": mat(nkv * d, h),
            p + "self_attn.o_proj.weight": mat(h, nh * d),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file(weights, str(folder / "model.safetensors"))
    config = dict(
        shape, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        torch_dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(str(folder))
    return folder


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
        from batchpage import LLM, SamplingParams
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
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_llama(Path(tmp) / "llama", shape, dtype)
        weight_bytes = (folder / "model.safetensors").stat().st_size
        for name, kwargs in (
            ("paged, CUDA graphs", dict(kv_allocator="paged")),
            ("paged, eager", dict(kv_allocator="paged", enforce_eager=True)),
            ("contiguous, CUDA graphs", dict(kv_allocator="static")),
        ):
            try:
                llm = LLM(
                    model=str(folder), dtype=str(dtype).removeprefix("torch."),
                    attention_backend="triton", prefix_caching=False, seed=0,
                    max_model_len=prompt_len + max_tokens + 16, max_num_seqs=max_num_seqs,
                    **kwargs, **memory,
                )  # fmt: skip
                # Warm-up off the clock: the first steps JIT-compile the Triton kernels, which
                # would otherwise be charged to whichever configuration runs first.
                llm.generate(prompts[:8], params, use_tqdm=False)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
            except Exception as exc:  # report and carry on with the other configuration
                rows.append(dict(config=name, error=f"{type(exc).__name__}: {exc}"))
                continue
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            stats = llm.stats
            steps = max(1, stats["steps"])
            part_ms = {p: 1e3 * stats["step_time_s"][p] / steps for p in STEP_PARTS}
            step_ms = 1e3 * elapsed / steps
            # A decode step reads every weight once and each running sequence's K/V: at the
            # mean context (prompt, then half the output) that bounds its time from below.
            context = sum(len(p) for p in prompts) / len(prompts) + max_tokens / 2
            kv_bytes = stats["peak_running"] * context * bytes_per_token(shape, dtype)
            roofline_ms = 1e3 * (weight_bytes + kv_bytes) / (peak_tbps * 1e12)
            rows.append(
                dict(
                    config=name,
                    kv_blocks=stats.get("kv_blocks_total"),
                    prompts=num_prompts,
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
            )
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------


def _cell(v: object) -> str:
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
    table = markdown_table(keys, [[_cell(r.get(k, "")) for k in keys] for r in rows])
    return f"### {title}\n\n{table}\n"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (interpreter)")
    ap.add_argument("--parts", default="a,b,c", help="comma list of a, b, c")
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
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no CUDA device: only --smoke runs on CPU")
    dtype = getattr(torch, args.dtype)
    parts = set(args.parts.split(","))
    if args.smoke:  # tiny everything: the interpreter runs each program in numpy
        args.batches, args.contexts = "1,3", "32,64"
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 80, 16
        args.engine_prompts, args.engine_prompt_len, args.engine_max_tokens = 3, 12, 4
    results: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        dtype=args.dtype,
        peak_tbps=args.peak_tbps,
        smoke=args.smoke,
    )
    report: list[str] = []
    if "a" in parts:
        rows = check_kernels(device, dtype, args.smoke)
        results["correctness"] = rows
        report.append(markdown("(a) kernels vs torch reference", rows))
    if "b" in parts:
        rows = bench_decode(
            device, dtype, args.peak_tbps, _ints(args.batches), _ints(args.contexts), args.heads,
            args.kv_heads, args.head_dim, args.block_size, args.max_kv_gib,
        )  # fmt: skip
        verdict = decode_verdict(rows, min_batch=64, min_ctx=8192)
        results["decode"], results["decode_targets"] = rows, verdict
        title = (
            f"(b) decode: {args.heads} heads / {args.kv_heads} kv heads, head_dim {args.head_dim},"
            f" block {args.block_size}, {args.dtype}, peak {args.peak_tbps} TB/s"
        )
        report.append(markdown(title, rows))
        report.append(markdown("(b) targets at batch >= 64, context >= 8192", [verdict]))
    if "c" in parts:
        rows = bench_engine(
            device, args.smoke, args.engine_prompts, args.engine_prompt_len,
            args.engine_max_tokens, args.engine_kv_gib, args.engine_max_seqs, args.peak_tbps,
        )  # fmt: skip
        results["engine"] = rows
        report.append(markdown("(c) engine throughput, random-init Llama, Triton attention", rows))

    print("\n".join(report))
    if args.out:
        write_json(args.out, results)
    failed = [r for r in results.get("correctness", []) if not r["ok"]]
    # `not <=` so that a NaN error counts as a failure
    bad = [r for r in results.get("decode", []) if not r.get("max_abs_err_vs_sdpa", 0) <= 0.05]
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
