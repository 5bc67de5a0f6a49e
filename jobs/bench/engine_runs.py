"""Timed llm.generate calls, measured the same way by every benchmark.

An engine is loaded in float32 (the fidelity reference, and the dtype of the HF baseline) and
warmed up before anything is timed; a run is the wall clock around one whole generate call,
with the engine's stats of that call and every completion's token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchpage import LLM, SamplingParams
from jobs.bench.report import log, timed
from jobs.bench.workloads import WorkloadRequest

# Plain text without a chat template shares no block-sized prefix with the templated workloads,
# so nothing a warm-up caches can be hit by a timed run.
WARM_UP_TEXTS = ("Warm-up: count from one to ten.", "Another warm-up line about the weather.")


def warm_up_llm(llm: LLM) -> None:
    """Two short requests, so one-time costs (allocator, first kernels, thread pools) stay out
    of the timing."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([llm.tokenizer.encode(t) for t in WARM_UP_TEXTS], params, use_tqdm=False)


def load_llm(model: str, label: str, **engine_args: Any) -> LLM:
    """LLM(model, dtype="float32", **engine_args), loaded (the time is logged) and warmed up."""
    llm, seconds = timed(lambda: LLM(model, **{"dtype": "float32", **engine_args}))
    log(f"{label}: engine loaded in {seconds:.1f} s")
    warm_up_llm(llm)
    return llm


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


def timed_generate(llm: LLM, prompts: list[list[int]], params: Any, label: str) -> GenerateRun:
    """Run and time one generate call; a request that failed raises, since a benchmark over
    partly failed requests would measure the wrong work."""
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    for i, out in enumerate(outs):
        if out.error or not out.outputs:
            raise RuntimeError(f"{label}: request {i} failed: {out.error}")
    outputs = [[list(c.token_ids) for c in out.outputs] for out in outs]
    return GenerateRun(label, seconds, dict(llm.stats), outputs)


def run_workload(llm: LLM, requests: list[WorkloadRequest], label: str) -> GenerateRun:
    """Greedy with ignore_eos: each request generates exactly its target length, so every
    system and configuration produces the same number of tokens."""
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    run = timed_generate(llm, [r.prompt_token_ids for r in requests], params, label)
    got = [len(samples[0]) for samples in run.outputs]
    if got != [r.output_len for r in requests]:
        raise RuntimeError(f"{label}: generated lengths differ from the targets")
    log(f"{label}: {run.wall_s:.1f} s, {run.generated_tok_s:.1f} generated tok/s, peak running "
        f"{run.stats['peak_running']}, waste {run.stats['kv_waste']:.1%}")  # fmt: skip
    return run


def same_outputs(a: GenerateRun, b: GenerateRun) -> tuple[int, int]:
    """(requests whose completions are identical in both runs, requests compared). A greedy
    mismatch can be a float near-tie flipped by a different batch, not necessarily a bug."""
    pairs = list(zip(a.outputs, b.outputs, strict=True))
    return sum(x == y for x, y in pairs), len(pairs)
