"""A decode-only step runs no Python per sequence: decided, built, executed, sampled, checked and
committed from the input batch's columns. Measured as the lines of Python a step executes
(sys.settrace, everything engine.step runs, the forward included): the same lines, the same
number of times, at 4 and at 32 running sequences. With n-gram speculation on too: the drafts
followed, proposed, run, verified and committed over the batch's columns."""

from __future__ import annotations

import gc
import random
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from batchpage import LLM, SamplingParams
from tests.engine.speculation import WeightBound

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def _lines_of_a_decode_step(
    folder: Path, running: int, block_size: int, sampled: bool, spec: dict | None = None
) -> Counter:
    # Speculating rows run in lockstep only without the prefix cache: rows with one prompt
    # would otherwise wait for the first to cache it.
    speculation = {} if spec is None else {"speculative_config": spec, "prefix_caching": False}
    llm = LLM(
        model=str(folder), dtype="float32", block_size=block_size, max_num_seqs=running,
        max_model_len=128, kv_cache_memory=2**24, max_num_batched_tokens=32 * running,
        linear_backend="torch",  # one linear for every shape (auto measures per batch size)
        **speculation,
    )  # fmt: skip
    engine = llm.engine
    rng = random.Random(running)
    # Prompts of one length: every row is at the same position, so no row needs a new block in
    # the traced step (a row that does asks the KV manager, once every block_size steps).
    prompts = [[rng.randrange(3, 200) for _ in range(20)] for _ in range(running)]
    if spec is not None:
        assert engine.drafts is not None
        engine.drafts.cost = WeightBound()  # type: ignore[assignment]
        # Four prompts, each run greedily by a quarter of the rows in lockstep: the traced
        # step's rows draft, accept and reject alike at any batch size (which branches a step
        # takes depends on its rows' drafts). With these four the tiny model's rows run no
        # draft, drafts all rejected, and drafts accepted (asserted below). A row takes at
        # most 5 tokens a step: the three steps stay inside the rows' second block.
        kinds = random.Random(4)
        four = [[kinds.randrange(3, 200) for _ in range(20)] for _ in range(4)]
        prompts = [four[i % 4] for i in range(running)]
    params = SamplingParams(
        temperature=0.8 if sampled else 0.0, top_p=0.9, top_k=20, max_tokens=30, ignore_eos=True
    )
    engine.add_requests([llm._make_request(i, p, params) for i, p in enumerate(prompts)])
    engine.step()  # every prompt, and the first tokens
    engine.step()  # a decode: the rows' positions are 21 from now on (past it, with drafts)
    batch = engine.batch
    assert len(engine.scheduler.running) == running and not engine.scheduler.waiting
    assert (batch.num_tokens[: len(batch)] - batch.computed[: len(batch)] == 1).all()
    drafted = batch.num_drafts[: len(batch)].copy()
    before = (engine.stats.generated_tokens, engine.stats.draft_tokens,
              engine.stats.accepted_draft_tokens)  # fmt: skip
    lines: Counter = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            lines[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return trace

    gc.collect()  # no finalizer of an earlier test's objects runs inside the traced step
    gc.disable()
    sys.settrace(trace)
    try:
        finished = engine.step()
    finally:
        sys.settrace(None)
        gc.enable()
    assert not finished
    stats = engine.stats
    if spec is None:
        assert stats.generated_tokens == 3 * running and not drafted.any()
        return lines
    # The traced step verified the drafts proposed before it: every kind of row was there.
    accepted = stats.accepted_draft_tokens - before[2]
    assert stats.draft_tokens - before[1] == drafted.sum()
    kinds = f"drafts {drafted.tolist()}, {accepted} accepted: pick four prompts that mix them"
    assert (drafted == 0).any() and 0 < accepted < drafted.sum(), kinds
    assert stats.generated_tokens - before[0] == running + accepted
    return lines


@pytest.mark.parametrize(
    ("block_size", "sampled", "spec"),
    [(16, False, None), (32, False, None), (16, True, None), (16, False, NGRAM)],
    ids=["greedy", "greedy-block32", "sampled", "ngram"],
)
def test_a_decode_step_runs_the_same_python_at_any_batch_size(
    tiny_folder: Path, block_size: int, sampled: bool, spec: dict | None
) -> None:
    """Greedy, and sampled (temperature, top-k, top-p, each row's own seeded draw); and with
    n-gram drafts (engine/drafts.py, speculative/ngram.py) followed, proposed, run as each row's
    short extend, verified and committed. Not the suffix drafter: it follows each row in Python
    (suffix.py's append_many)."""
    few = _lines_of_a_decode_step(tiny_folder, 4, block_size, sampled, spec)
    many = _lines_of_a_decode_step(tiny_folder, 32, block_size, sampled, spec)
    grew = {line: (few[line], n) for line, n in many.items() if n != few[line]}
    assert not grew, f"lines run more often with more rows (line: (4 rows, 32 rows)): {grew}"
    assert sum(many.values()) > 500  # the trace saw the step (the model's Python included)
