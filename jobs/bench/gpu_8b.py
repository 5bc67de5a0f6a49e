"""(d) of jobs.bench.gpu: a Llama-3.1-8B shape (random weights) at 1000 tokens in / 1000 out,
beside TensorRT-LLM's published Llama-3.1-8B throughput on the same GPU kind.

    python -m jobs.bench.gpu --parts d --e2e-formats fp8,bf16 --e2e-requests 224

TensorRT-LLM's figure is FP8 at 1000/1000 (its performance overview: 15,220 output tokens/s on
an H100, 17,744 on an H200); the row's `ratio_to_trtllm` is ours over it, on the GPU this runs
on (none where the GPU is neither). The weights are drawn on the GPU at run time
(random_models.write_llama with device=cuda) and written once per format to a temporary
folder, which the engine then loads: the draw, the write and the load are timed apart from the
run. Every prompt is `prompt_len` random token ids and every request generates exactly
`max_tokens` (ignore_eos), as TensorRT-LLM's fixed-length benchmark does.

Request count (gpu_run.sh's sizing): K/V of one token over the 32 layers are 2 x 32 x 8 x 128 x
2 bytes (bf16) = 128 KiB, so a request at 2000 tokens holds 250 MiB; the engine's pool is 0.9
of the memory left after the weights (FP8: ~9 GiB with the bf16 embeddings and head; bf16:
15 GiB). One wave of all the requests running at once measures the steady batch with no queue
tail: 224 requests (56 GiB of K/V) fit an H100's ~78 GiB beside either format's weights, 256 an
H200's. Such a wave is 1000 decode steps after its prefill, whatever the request count.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from jobs.bench import report
from jobs.bench.gpu import Row, measure_engine, quantized_configs, table_cell, write_random_llama

# Llama-3.1-8B's shapes (8.03B parameters, untied head); positions as far as the runs reach.
LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip
# The smoke run's stand-in: the same structure (untied head, GQA), tiny.
LLAMA_8B_TINY = dict(
    LLAMA_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
)  # fmt: skip
# TensorRT-LLM's published Llama-3.1-8B FP8 output tokens/s at 1000 in / 1000 out, by GPU kind.
TRTLLM_FP8_OUT_TOK_S = {"H200": 17744.0, "H100": 15220.0}
FORMATS = ("fp8", "bf16")


def trtllm_figure(device_name: str) -> float | None:
    """TensorRT-LLM's figure for this GPU (its name as torch gives it), or None."""
    for kind, figure in TRTLLM_FP8_OUT_TOK_S.items():
        if kind in device_name:
            return figure
    return None


def bench_8b(
    device: torch.device,
    smoke: bool,
    formats: list[str],
    num_requests: int,
    prompt_len: int,
    max_tokens: int,
    peak_tbps: float,
    max_num_seqs: int = 256,
    budget_s: float | None = None,
    weights_dir: str | None = None,
) -> list[Row]:
    """One row per format in `formats` (fp8: 128 x 128 blocks, kept quantized, the Triton int
    kernel; bf16: dense), each with measure_engine's columns, the draw-and-write and load
    times, and the ratio to TensorRT-LLM's figure, logged as it ends (a later kill keeps it
    in the log). With `budget_s`, a format after the first starts only where 1.5 times the
    previous one's seconds still fit in what is left of it (bf16 writes and reads more than
    FP8), else its row says it was skipped."""
    from batchpage import SamplingParams

    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"--e2e-formats: {sorted(unknown)} not among {FORMATS}")
    shape = LLAMA_8B_TINY if smoke else LLAMA_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    figure = trtllm_figure(name)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # A few short requests compile the kernels (the real run's steps differ only in batch).
    warmup = SamplingParams(max_tokens=min(4, max_tokens), temperature=0.0, ignore_eos=True)
    memory = dict(kv_cache_memory=2**24) if device.type == "cpu" else {}
    fp8 = quantized_configs(32 if smoke else 128)["FP8 block"]
    rows: list[Row] = []
    start = time.perf_counter()
    last_s = 0.0  # the previous format's seconds, all in
    for fmt in formats:
        spent = time.perf_counter() - start
        if rows and budget_s is not None and spent + 1.5 * last_s > budget_s:
            why = f"{spent:.0f} s spent + 1.5 x {last_s:.0f} s > budget {budget_s:.0f} s"
            rows.append(dict(config=f"8B {fmt}", format=fmt, skipped=why))
            continue
        quant = fp8 if fmt == "fp8" else None
        with tempfile.TemporaryDirectory(dir=weights_dir) as tmp:
            t0 = time.perf_counter()
            folder = write_random_llama(Path(tmp) / fmt, shape, dtype, quant, device)
            write_s = time.perf_counter() - t0
            if device.type == "cuda":  # the draw's cached blocks: the engine sizes its pool
                torch.cuda.empty_cache()  # by the GPU's free memory
            llm_kwargs: dict[str, Any] = dict(
                dtype=str(dtype).removeprefix("torch."), attention_backend="triton",
                prefix_caching=False, seed=0, max_model_len=prompt_len + max_tokens + 16,
                max_num_seqs=max_num_seqs, quantized_weights=quant is not None, **memory,
            )  # fmt: skip
            row, _ = measure_engine(
                f"8B {fmt}, paged, CUDA graphs", folder, llm_kwargs, prompts, params, shape,
                peak_tbps, prompts[:2], warmup,
            )  # fmt: skip
        # The comparison's columns first, then measure_engine's (the dict keeps head's order).
        head: Row = dict(config=row["config"], format=fmt, input_len=prompt_len,
                         output_len=max_tokens, prompts=num_requests)  # fmt: skip
        if "output_tokens_per_s" in row:
            ours = row["output_tokens_per_s"]
            head |= dict(output_tokens_per_s=ours, trtllm_fp8_out_tok_s=figure,
                         ratio_to_trtllm=None if figure is None else ours / figure)  # fmt: skip
        rows.append(head | row | dict(write_s=write_s))
        report.log(", ".join(f"{k} {table_cell(v)}" for k, v in rows[-1].items()))
        last_s = time.perf_counter() - start - spent
    return rows
