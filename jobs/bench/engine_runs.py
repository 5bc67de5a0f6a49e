"""Timed runs of batchpage's engine, measured the same way by every benchmark: whole generate
calls (greedy, each request its own exact output length) and pure decode steps.

It imports nothing but the standard library and batchpage's public API (LLM, SamplingParams),
so jobs/bench/ab.py can also run it as a script in another revision's tree, a worker reading one
JSON command a line on stdin and answering each with one JSON line on stdout:

    {"op": "load", "model": ..., "label": ..., "options": {LLM keyword options}}
    {"op": "generate", "prompts": [[ids]], "max_tokens": [n]}      -> run_greedy's figures
    {"op": "decode", "prompts": [[ids]], "steps": n}                -> decode_steps' figures
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import sys
import time
from typing import Any

from batchpage import LLM, SamplingParams

# Plain text without a chat template shares no block-sized prefix with the templated workloads,
# so nothing a warm-up caches can be hit by a timed run.
WARM_UP_TEXTS = ("Warm-up: count from one to ten.", "Another warm-up line about the weather.")


def parse_options(items: list[str], flag: str) -> dict[str, Any]:
    """KEY=VALUE words as LLM keyword options; a value is JSON where it parses (numbers, true,
    false, null), else a string."""
    words = {"True": True, "False": False, "None": None}
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag}: {item!r} is not KEY=VALUE (e.g. attention_backend=torch)")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = words.get(text, text)
    return options


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the report (or, in a worker, the answers)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def warm_up(llm: LLM) -> None:
    """Two short requests, so that one-time costs (allocator, first kernels, thread pools) stay
    out of the timing."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([llm.tokenizer.encode(t) for t in WARM_UP_TEXTS], params, use_tqdm=False)


def load_llm(model: str, label: str, **options: Any) -> LLM:
    """LLM(model, **options), loaded (the time is logged) and warmed up."""
    start = time.perf_counter()
    llm = LLM(model, **options)
    log(f"{label}: engine loaded in {time.perf_counter() - start:.1f} s")
    warm_up(llm)
    return llm


def timed_generate(llm: LLM, prompts: list[Any], params: Any, **kwargs: Any) -> dict[str, Any]:
    """One generate call: its wall seconds, each request's completions as token ids and the
    engine's stats of the call. A failed request raises: a benchmark over partly failed
    requests would measure the wrong work."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    wall = time.perf_counter() - start
    for i, out in enumerate(outs):
        if out.error or not out.outputs:
            raise RuntimeError(f"request {i} failed: {out.error}")
    outputs = [[list(c.token_ids) for c in out.outputs] for out in outs]
    generated = sum(len(ids) for samples in outputs for ids in samples)
    return {"wall_s": wall, "output_tok_s": generated / wall, "generated_tokens": generated,
            "outputs": outputs, "stats": dict(llm.stats)}  # fmt: skip


def run_greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """Greedy with ignore_eos: each request generates exactly its max_tokens, so every system and
    configuration produces the same number of tokens. `tokens`: each request's completion;
    `decode_parts` and `decode_steps` as timed_steps gives them."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    run = timed_steps(llm, prompts, params)
    run["tokens"] = [samples[0] for samples in run.pop("outputs")]
    if [len(t) for t in run["tokens"]] != list(max_tokens):
        raise RuntimeError("generated lengths differ from the targets")
    return run


def timed_steps(llm: LLM, prompts: list[Any], params: Any) -> dict[str, Any]:
    """timed_generate, and the parts of the steps that computed no prompt token (decode-only: no
    admission's prefill): `decode_parts`, the mean ms a step of each part
    (RunStats.step_time_s), and `decode_steps`, their count."""
    marks: list[tuple[int, dict[str, float]]] = []

    def on_step(stats: Any) -> None:
        marks.append((stats.prefill_tokens_computed, dict(stats.step_time_s)))

    run = timed_generate(llm, prompts, params, on_step=on_step)
    decode = [
        {part: b[part] - a.get(part, 0.0) for part in b}
        for (p0, a), (p1, b) in zip(marks, marks[1:], strict=False)
        if p1 == p0
    ]
    run["decode_steps"] = len(decode)
    run["decode_parts"] = {
        part: 1e3 * sum(d[part] for d in decode) / max(1, len(decode)) for part in marks[-1][1]
    } if marks else {}  # fmt: skip
    return run


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """The wall time of each pure decode step of len(prompts) running sequences: each prompt
    generates steps + 1 tokens, and a step counts when every sequence gained one token and no
    prompt token was computed (so a step that still prefills or runs fewer sequences does
    not). For every prompt in one prefill step, give max_num_batched_tokens room for them all."""
    if "on_step" not in inspect.signature(llm.generate).parameters:
        raise RuntimeError("this batchpage's LLM.generate has no on_step: decode steps cannot be "
                           "timed through its public API")  # fmt: skip
    marks: list[tuple[float, int, int]] = []

    def on_step(stats: Any) -> None:
        marks.append((time.perf_counter(), stats.prefill_tokens_computed, stats.generated_tokens))

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    run = timed_generate(llm, prompts, params, on_step=on_step)
    step_s = [t1 - t0 for (t0, p0, g0), (t1, p1, g1) in zip(marks, marks[1:], strict=False)
              if p1 == p0 and g1 - g0 == len(prompts)]  # fmt: skip
    if not step_s:
        raise RuntimeError(f"no step decoded all {len(prompts)} sequences at once: raise "
                           "max_num_seqs, max_num_batched_tokens or kv_cache_memory")  # fmt: skip
    return {"step_s": step_s, "tokens": [samples[0] for samples in run["outputs"]]}


class Engine:
    """One engine at a time, loaded and asked in turn: a side of jobs/bench/ab.py in this
    process, or what a worker serves."""

    def __init__(self, model: str = "") -> None:
        self.model, self.llm = model, None

    def load(self, label: str, options: dict[str, Any], model: str = "") -> dict[str, Any]:
        self.llm = None
        gc.collect()  # free the last engine's pool before the next allocates its own
        self.llm = load_llm(model or self.model, label, **options)
        return {"ok": True}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        return run_greedy(self.llm, prompts, max_tokens)

    def decode(self, prompts: list[list[int]], steps: int) -> dict[str, Any]:
        return decode_steps(self.llm, prompts, steps)

    def close(self) -> None:
        self.llm = None


def serve() -> None:
    """The worker loop (see the module docstring). Answers go to the real stdout; anything else
    written to it, by Python or by a library's C code, goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import batchpage

    ready = {"batchpage": os.path.realpath(batchpage.__file__), "kernels": _kernels_file()}
    print(json.dumps(ready), file=answers, flush=True)
    engine = Engine()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = getattr(engine, cmd.pop("op"))(**cmd)
        except Exception as exc:  # the parent reports it, naming this side
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=answers, flush=True)


def _kernels_file() -> str | None:
    try:
        import batchpage.kernels.common
    except ImportError:
        return None
    return os.path.realpath(batchpage.kernels.common.__file__)


if __name__ == "__main__":
    serve()
