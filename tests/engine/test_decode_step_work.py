"""A decode-only step runs no Python per sequence: decided, built, executed, sampled, checked and
committed from the input batch's columns. Measured as the lines of Python a step executes
(sys.settrace, everything engine.step runs, the forward included): the same lines, the same
number of times, at 4 and at 32 running sequences."""

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


def _lines_of_a_decode_step(folder: Path, running: int, block_size: int, sampled: bool) -> Counter:
    llm = LLM(
        model=str(folder), dtype="float32", block_size=block_size, max_num_seqs=running,
        max_model_len=128, kv_cache_memory=2**24, max_num_batched_tokens=32 * running,
        linear_backend="torch",  # one linear for every shape (auto measures per batch size)
    )  # fmt: skip
    engine = llm.engine
    rng = random.Random(running)
    # Prompts of one length: every row is at the same position, so no row needs a new block in
    # the traced step (a row that does asks the KV manager, once every block_size steps).
    prompts = [[rng.randrange(3, 200) for _ in range(20)] for _ in range(running)]
    params = SamplingParams(
        temperature=0.8 if sampled else 0.0, top_p=0.9, top_k=20, max_tokens=30, ignore_eos=True
    )
    engine.add_requests([llm._make_request(i, p, params) for i, p in enumerate(prompts)])
    engine.step()  # every prompt, and the first tokens
    engine.step()  # a decode: the rows' positions are 21 from now on
    batch = engine.batch
    assert len(engine.scheduler.running) == running and not engine.scheduler.waiting
    assert (batch.num_tokens[: len(batch)] - batch.computed[: len(batch)] == 1).all()
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
    assert not finished and engine.stats.generated_tokens == 3 * running
    return lines


@pytest.mark.parametrize(("block_size", "sampled"), [(16, False), (32, False), (16, True)])
def test_a_decode_step_runs_the_same_python_at_any_batch_size(
    tiny_folder: Path, block_size: int, sampled: bool
) -> None:
    """Greedy, and sampled (temperature, top-k, top-p, each row's own seeded draw)."""
    few = _lines_of_a_decode_step(tiny_folder, 4, block_size, sampled)
    many = _lines_of_a_decode_step(tiny_folder, 32, block_size, sampled)
    grew = {line: (few[line], n) for line, n in many.items() if n != few[line]}
    assert not grew, f"lines run more often with more rows (line: (4 rows, 32 rows)): {grew}"
    assert sum(many.values()) > 500  # the trace saw the step (the model's Python included)
