"""Greedy tokens of two runs on the same prompts compared row by row, for jobs/bench/speculative.py:
where each row first parts, and how close to a tie the two tokens there were (a run that sums in
another order, in another batch shape, can flip a near-tie without a bug; a wide gap is a bug).
"""

from __future__ import annotations

from typing import Any

from batchpage import SamplingParams

TOP = 20  # the logprobs asked for at a first difference: both tokens must be among them


def differences(off: list[list[int]], spec: list[list[int]]) -> list[tuple[int, int]]:
    """(row, first differing position) of each row whose tokens differ."""
    found = []
    for row, (a, b) in enumerate(zip(off, spec, strict=True)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            found.append((row, min(len(a), len(b)) if at is None else at))
    return found


def tie_gaps(
    llm: Any, prompts: list[list[int]], off: list[list[int]], spec: list[list[int]]
) -> list[float | None]:
    """At each row's first difference (differences' order): the logprob of the token the run
    without speculation took there less that of the speculative run's token, as the engine
    without speculation scores that position again. Near zero: a near-tie the batch's shape
    flipped. None where one side had ended there, or its token is outside the top TOP."""
    diffs = differences(off, spec)
    asks = [(row, at) for row, at in diffs if at < min(len(off[row]), len(spec[row]))]
    if not asks:
        return [None] * len(diffs)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    again = [{"prompt_token_ids": prompts[row] + off[row][:at]} for row, at in asks]
    gaps: dict[tuple[int, int], float] = {}
    for (row, at), out in zip(asks, llm.generate(again, params, use_tqdm=False), strict=True):
        top = out.outputs[0].logprobs[0]
        a, b = off[row][at], spec[row][at]
        if a in top and b in top:
            gaps[(row, at)] = top[a] - top[b]
    return [gaps.get(d) for d in diffs]


def report_mismatches(pairs: list[dict[str, Any]], batch_invariant: bool) -> None:
    """Every pair whose greedy tokens parted, each row's first difference and how close to a
    tie it was (tie_gaps)."""
    bad = [p for p in pairs if p["mismatches"]]
    if not bad:
        print("\nGreedy tokens: identical with and without speculation in every pair.")
        return
    why = "a bug: batch_invariant=True promises bitwise equal rows"
    if not batch_invariant:
        why = "batch_invariant=False: a near-tie the batch's other shape flips can part a row"
    print(f"\n**GREEDY MISMATCH** in {len(bad)} pairs ({why}); each row's first differing "
          "token, and the logprob gap there between the two sides' tokens:\n")  # fmt: skip
    for p in bad:
        shown = [f"row {m['row']} at {m['position']} ({gap_text(m['logprob_gap'])})"
                 for m in p["mismatches"][:8]]  # fmt: skip
        more = len(p["mismatches"]) - len(shown)
        gaps = [abs(m["logprob_gap"]) for m in p["mismatches"] if m["logprob_gap"] is not None]
        widest = f"; widest gap {max(gaps):.4f}" if gaps else ""
        print(f"- {p['model']} {p['workload']} {p['running']} running, {p['method']}: "
              f"{', '.join(shown)}{f' and {more} more' if more > 0 else ''}{widest}")  # fmt: skip


def gap_text(gap: float | None) -> str:
    return "gap -" if gap is None else f"gap {gap:.4f}"
