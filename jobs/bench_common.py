"""Shared helpers for the benchmarks in jobs/: workloads, timing, the machine's ceiling, tables.

Small functions with no batchpage engine state, so every benchmark script measures the same way:

- `sample_sharegpt`: a seeded sample of ShareGPT first-turn prompts (chat-templated token ids)
  with their real reply lengths as target output lengths, both capped.
- `timed`, `environment`, `command_line`, `write_json`: what a result needs to be reproducible.
- `measure_matmul_ceiling` / `Ceiling`: this CPU's matmul GFLOP/s at a Llama model's shapes,
  turned into an upper bound on tokens/s.
- `markdown_table`: results ready to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F

T = TypeVar("T")


# --- workload ----------------------------------------------------------------------------------


class ChatTokenizer(Protocol):
    """The two tokenizer operations a workload needs (batchpage's Tokenizer has both)."""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate: the real reply's length, clamped to the caps
    reply_len: int  # the real reply's uncapped token length (for the record)


def sample_sharegpt(
    tokenizer: ChatTokenizer,
    n: int,
    seed: int = 0,
    max_prompt_tokens: int = 256,
    max_output_tokens: int = 128,
    min_output_tokens: int = 4,
    chat_template: bool = True,
) -> list[WorkloadRequest]:
    """n ShareGPT V3 first turns in a seeded random order (the order is the workload's order).

    Prompts longer than max_prompt_tokens (after the chat template) are skipped rather than
    truncated: a cut would drop the template's closing turn markers and change the task. Rows
    without a reply are skipped too, since the reply is what sets the output length.
    """
    import pyarrow.parquet as pq

    from batchpage.data.presets import resolve_preset

    table = pq.read_table(resolve_preset("sharegpt").path, columns=["id", "prompt", "reply"])
    ids, prompts, replies = (table.column(c).to_pylist() for c in ("id", "prompt", "reply"))
    order = list(range(len(ids)))
    random.Random(seed).shuffle(order)
    picked: list[WorkloadRequest] = []
    for row in order:
        if len(picked) == n:
            break
        prompt, reply = prompts[row], replies[row]
        if not prompt or not reply:
            continue
        if chat_template:
            prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            prompt_ids = tokenizer.encode(prompt)
        if len(prompt_ids) > max_prompt_tokens:
            continue
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        output_len = max(min_output_tokens, min(reply_len, max_output_tokens))
        picked.append(WorkloadRequest(str(ids[row]), list(prompt_ids), output_len, reply_len))
    if len(picked) < n:
        raise ValueError(
            f"only {len(picked)} ShareGPT prompts fit max_prompt_tokens={max_prompt_tokens}; "
            f"asked for {n}: raise the cap or lower n"
        )
    return picked


def workload_summary(requests: Sequence[WorkloadRequest]) -> dict[str, float | int]:
    prompt = [len(r.prompt_token_ids) for r in requests]
    output = [r.output_len for r in requests]
    return {
        "requests": len(requests),
        "prompt_tokens": sum(prompt),
        "prompt_tokens_mean": sum(prompt) / len(prompt),
        "prompt_tokens_max": max(prompt),
        "output_tokens": sum(output),
        "output_tokens_mean": sum(output) / len(output),
        "output_tokens_min": min(output),
        "output_tokens_max": max(output),
    }


# --- timing and provenance ---------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn's result, wall-clock seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def command_line() -> str:
    """The exact command that produced a result, ready to paste into a shell."""
    return shlex.join(["python", *sys.argv])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    import transformers

    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# --- the machine's ceiling ---------------------------------------------------------------------


@dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    count: int = 1  # how many linears of this shape per layer (k and v; gate and up)

    @property
    def flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features * self.count


def llama_shapes(cfg: Any) -> tuple[list[LinearShape], LinearShape]:
    """(the per-layer linears, lm_head) of a Llama-family config (batchpage's ModelConfig)."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    layer = [
        LinearShape("q_proj", hidden, q),
        LinearShape("k_proj+v_proj", hidden, kv, count=2),
        LinearShape("o_proj", q, hidden),
        LinearShape("gate_proj+up_proj", hidden, inter, count=2),
        LinearShape("down_proj", inter, hidden),
    ]
    return layer, LinearShape("lm_head", hidden, cfg.vocab_size)


def matmul_gflops(
    tokens: int, in_features: int, out_features: int, dtype: torch.dtype, min_time_s: float
) -> float:
    """Best observed GFLOP/s of F.linear([tokens, in] x [out, in]^T): the best call, not the
    mean, because a ceiling should not include other processes' interference."""
    x = torch.randn(tokens, in_features, dtype=dtype)
    w = torch.randn(out_features, in_features, dtype=dtype)
    flops = 2 * tokens * in_features * out_features
    best = float("inf")
    with torch.inference_mode():
        F.linear(x, w)  # warm-up: first-call allocation and kernel selection
        deadline = time.perf_counter() + min_time_s
        calls = 0
        while calls < 3 or time.perf_counter() < deadline:
            _, seconds = timed(lambda: F.linear(x, w))
            best = min(best, seconds)
            calls += 1
    return flops / best / 1e9


@dataclass(frozen=True)
class Ceiling:
    """Matmul-bound time per token for one model on this machine. It counts only the linears at
    their best measured rate (and attention at the layers' mean rate), so it is an upper bound
    that no real engine reaches: norms, RoPE, sampling and Python overheads are all left out."""

    layer_s_per_token: float  # all layers' linears for one token through the model
    logits_s_per_token: float  # lm_head for one sampled position
    attn_s_per_flop: float
    attn_flops_per_key: int  # per token, per attended key, all layers: QK^T and PV

    def decode_tokens_per_s(self, context: float) -> float:
        """Large-batch decode bound: every generated token costs the layers, the lm_head and
        attention over `context` keys."""
        attn = self.attn_flops_per_key * context * self.attn_s_per_flop
        return 1.0 / (self.layer_s_per_token + self.logits_s_per_token + attn)

    def workload_seconds(self, requests: Iterable[WorkloadRequest]) -> float:
        """Least time for the whole workload: each request runs its prompt and all but its last
        output token through the layers, samples output_len positions, and attends causally.
        Every prompt token is counted (a prefix cache could skip some)."""
        total = 0.0
        for r in requests:
            positions = len(r.prompt_token_ids) + r.output_len - 1
            keys = positions * (positions + 1) / 2  # causal: token i attends i keys
            total += positions * self.layer_s_per_token + r.output_len * self.logits_s_per_token
            total += keys * self.attn_flops_per_key * self.attn_s_per_flop
        return total


def measure_matmul_ceiling(
    cfg: Any,
    token_counts: Sequence[int] = (256, 512, 1024),
    dtype: torch.dtype = torch.float32,
    min_time_s: float = 0.3,
) -> tuple[Ceiling, list[dict[str, Any]]]:
    """Measure each linear shape of the model at each token count (the M of the matmul, i.e. the
    tokens in one step at large batch) and take the best rate per shape. Returns the ceiling and
    one row per (shape, tokens) measurement."""
    layer, lm_head = llama_shapes(cfg)
    rows: list[dict[str, Any]] = []
    best: dict[str, float] = {}
    for shape in [*layer, lm_head]:
        for m in token_counts:
            rate = matmul_gflops(m, shape.in_features, shape.out_features, dtype, min_time_s)
            rows.append(
                {"shape": shape.name, "in": shape.in_features, "out": shape.out_features,
                 "tokens": m, "gflops": rate}
            )  # fmt: skip
            best[shape.name] = max(best.get(shape.name, 0.0), rate)
    layer_s = cfg.num_layers * sum(s.flops_per_token / (best[s.name] * 1e9) for s in layer)
    mean_layer_rate = sum(best[s.name] for s in layer) / len(layer)
    ceiling = Ceiling(
        layer_s_per_token=layer_s,
        logits_s_per_token=lm_head.flops_per_token / (best[lm_head.name] * 1e9),
        attn_s_per_flop=1.0 / (mean_layer_rate * 1e9),
        attn_flops_per_key=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
    )
    return ceiling, rows


def model_flops_per_token(cfg: Any, with_logits: bool = True) -> int:
    """Linear FLOPs for one token through the model (2 x non-embedding linear params, plus the
    lm_head when that token's logits are computed)."""
    layer, lm_head = llama_shapes(cfg)
    flops = cfg.num_layers * sum(s.flops_per_token for s in layer)
    return flops + (lm_head.flops_per_token if with_logits else 0)


# --- tables ------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers as a table shows them: thousands separators, fixed decimals; None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are formatted with `fmt`, numbers right-aligned."""
    body = [[fmt(c) for c in row] for row in rows]
    align = [
        bool(body) and all(_looks_numeric(row[i]) for row in body) for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if a else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _looks_numeric(cell: str) -> bool:
    stripped = cell.replace(",", "").replace("%", "").replace("x", "").strip()
    if stripped in ("", "-"):
        return True
    try:
        float(stripped)
    except ValueError:
        return False
    return True


# --- helpers for the prefix-cache and KV-allocation benchmarks ---------------------------------


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the clean Markdown report."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def args_json(args: Any) -> dict[str, Any]:
    """An argparse Namespace as JSON-ready values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def sharegpt_records(seed: int = 0) -> list[tuple[str, str, str]]:
    """(id, first-turn prompt, first reply) of every ShareGPT row with both, in a seeded order."""
    import pyarrow.parquet as pq

    from batchpage.data.presets import resolve_preset

    table = pq.read_table(resolve_preset("sharegpt").path, columns=["id", "prompt", "reply"])
    ids, prompts, replies = (table.column(c).to_pylist() for c in ("id", "prompt", "reply"))
    rows = [(str(i), p, r) for i, p, r in zip(ids, prompts, replies, strict=True) if p and r]
    random.Random(seed).shuffle(rows)
    return rows


def short_sharegpt_questions(
    tokenizer: ChatTokenizer, n: int, seed: int = 0, max_tokens: int = 48, min_tokens: int = 4
) -> list[str]:
    """n distinct ShareGPT first-turn prompts of min_tokens..max_tokens tokens (plain encoding):
    the short, distinct user turns that follow a shared system prompt or document."""
    picked: list[str] = []
    seen: set[str] = set()
    for _, prompt, _ in sharegpt_records(seed):
        text = prompt.strip()
        if text in seen:
            continue
        if min_tokens <= len(tokenizer.encode(text, add_special_tokens=False)) <= max_tokens:
            picked.append(text)
            seen.add(text)
            if len(picked) == n:
                return picked
    raise ValueError(f"only {len(picked)} ShareGPT prompts have {min_tokens}..{max_tokens} tokens")


def text_of_tokens(tokenizer: Any, text: str, num_tokens: int) -> str:
    """The start of `text` cut to num_tokens tokens (plain encoding), as text again."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, {num_tokens} asked for")
    return tokenizer.decode(ids[:num_tokens])


def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix that every sequence starts with."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


def kv_bytes_per_token(cfg: Any, dtype: torch.dtype = torch.float32) -> int:
    """K and V of one token over all layers (batchpage's ModelConfig): kv_cache_memory for a pool
    of T tokens is T times this."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def warm_up_llm(llm: Any) -> None:
    """Two short plain-text requests, so one-time costs (allocator, first kernels, thread pools)
    stay out of the timing. Plain text without a chat template shares no block-sized prefix with
    the templated workloads, so nothing it caches can be hit by a timed run."""
    from batchpage import SamplingParams

    texts = ("Warm-up: count from one to ten.", "Another warm-up line about the weather.")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([llm.tokenizer.encode(t) for t in texts], params, use_tqdm=False)


@dataclass
class GenerateRun:
    """One timed llm.generate call: wall seconds around the whole call, the engine's stats of
    that call, and each request's completions as token ids."""

    label: str
    wall_s: float
    stats: dict[str, Any]
    outputs: list[list[list[int]]]  # [request][sample] -> token ids

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for samples in self.outputs for ids in samples)

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "wall_s": self.wall_s,
            "generated_tokens": self.generated_tokens,
            "generated_tok_s": self.generated_tok_s,
            "engine_stats": self.stats,
        }


def timed_generate(llm: Any, prompts: list[list[int]], params: Any, label: str) -> GenerateRun:
    """Run and time one generate call; a request that failed raises, since a benchmark over
    partly failed requests would measure the wrong work."""
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    for i, out in enumerate(outs):
        if out.error or not out.outputs:
            raise RuntimeError(f"{label}: request {i} failed: {out.error}")
    outputs = [[list(c.token_ids) for c in out.outputs] for out in outs]
    return GenerateRun(label, seconds, dict(llm.stats), outputs)


def same_outputs(a: GenerateRun, b: GenerateRun) -> tuple[int, int]:
    """(requests whose completions are identical in both runs, requests compared). A greedy
    mismatch can be a float near-tie flipped by a different batch, not necessarily a bug."""
    pairs = list(zip(a.outputs, b.outputs, strict=True))
    return sum(x == y for x, y in pairs), len(pairs)


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer without its weights, so that workloads exist before any engine
    loads."""
    from batchpage.model.loader import load_tokenizer as load

    return load(model)
