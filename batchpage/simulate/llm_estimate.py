"""LLM.estimate: the capacity plan of a generate call on a loaded engine, and the output lengths
learned by generating some of the rows for real (shared with the dry run's
plan.output_tokens=sample:N).

The engine is loaded already, so the plan has no setup part; its I/O part is the prompts'
tokenizing, timed here. `this` is calibrated on this very engine when no calibration of its
setup is cached.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from batchpage.engine.sequence import Request
from batchpage.simulate.calibrate import cached_calibration, calibrate
from batchpage.simulate.capacity import Lengths, Row, WindowSample
from batchpage.simulate.devices import parse_device
from batchpage.simulate.estimate import HereFacts, plan_capacity
from batchpage.simulate.memory import host_runtime_bytes
from batchpage.simulate.options import OutputTokens, parse_output_tokens


def sampled_lengths(llm: Any, sample: WindowSample, count: int) -> tuple[Lengths, dict[str, Any]]:
    """`count` rows picked evenly over the sample, generated for real on `llm` (an LLM) with
    their own params:
    their completions' lengths, and what the report says of them."""
    rows = [r for w in sample.windows for r in w]
    picked = [rows[i * len(rows) // count] for i in range(min(count, len(rows)))]
    started = time.perf_counter()
    outs = llm.generate([r.prompts[0] for r in picked], [r.params for r in picked],
                        use_tqdm=False)  # fmt: skip
    seconds = time.perf_counter() - started
    lengths = tuple(len(c.token_ids) for o in outs if o.error is None for c in o.outputs)
    if not lengths:
        return Lengths("max"), {"assumed": "max_tokens (no sampled row generated)"}
    return Lengths("sampled", lengths), {
        "assumed": f"the lengths of {len(picked)} rows generated for real",
        "sampled_rows": len(picked),
        "mean": sum(lengths) / len(lengths),
        "max": max(lengths),
        "sample_seconds": seconds,
    }


def lengths_for(
    wanted: OutputTokens, llm: Any, sample: WindowSample
) -> tuple[Lengths, dict[str, Any]]:
    """The output-length estimate `wanted` asks for (`llm`: an LLM, where rows are to be
    generated for real; else None)."""
    if wanted.kind == "given":
        return Lengths("given", (wanted.value,)), {
            "assumed": f"{wanted.value} tokens a row, capped by max_tokens"
        }
    if wanted.kind == "sample":
        assert llm is not None, "sampled lengths need the model"
        return sampled_lengths(llm, sample, wanted.value)
    return Lengths("max"), {"assumed": "max_tokens"}


def estimate_requests(
    llm: Any,
    requests: Sequence[Request],
    devices: Sequence[str],
    output_tokens: str | int,
    simulated_rows: int,
    io_s: float,
) -> dict[str, Any]:
    """LLM.estimate's plan of the requests generate() would make (`llm`: the LLM; those with
    an error are left out, as generate leaves them; `io_s`: their tokenizing)."""
    names = [parse_device(d) for d in devices]
    wanted = parse_output_tokens(str(output_tokens))
    rows = [Row([r.prompt_token_ids], r.params) for r in requests if r.error is None]
    sample = WindowSample(simulated_rows, max(1, len(rows)))
    sample.add(rows)  # one generate call: one window
    source, plan, cfg = llm.source, llm.plan, llm.config
    cal = None
    if any(n.name == "this" for n in names):
        cal = cached_calibration(cfg, source, plan.dtype, plan.device) or calibrate(llm, source)
    lengths, facts = lengths_for(wanted, llm, sample)
    weights = int(llm.engine.weight_bytes)
    # The process holds the engine already: its own bytes are the rest of what it holds.
    runtime = max(0, host_runtime_bytes() - weights)
    here = HereFacts(plan, weights, cal, 0.0, io_s, runtime)
    result = plan_capacity(sample, cfg, source, here, names, lengths)
    return {
        "prompts": len(requests),
        "prompts_with_errors": len(requests) - len(rows),
        "prompt_tokens": sum(len(r.prompts[0]) for r in rows),
        **result.as_dict(),
        "output_tokens": facts,
        "rows_simulated": sum(len(w) for w in sample.windows),
    }
