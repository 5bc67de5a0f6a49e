"""A simulated model for scheduler tests: no forward, a known next token.

Prompts are 0..n-1 and the next token at position p is 1000 + p, so all sequences share prefixes
and a token's KV never depends on which sequence computed it: recompute after preemption is
exact, and a finished sequence's output can be checked against a formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpage.engine.kv_manager import blocks_for
from batchpage.engine.scheduler import Scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.stop_checker import StopChecker
from batchpage.sampling_params import SamplingParams


def make_seq(i: int, prompt_len: int, params: SamplingParams | None = None) -> Sequence:
    req = Request(
        index=i,
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        params=params or SamplingParams(max_tokens=1),
    )
    stop = StopChecker(lambda ids: "", req.params, prompt_len=prompt_len)
    return Sequence(i, req, 0, list(range(prompt_len)), 0, stop)


@dataclass
class Simulated:
    steps: int
    tokens_computed: int  # prompt and recomputed tokens included: the work the model did


def simulate(sched: Scheduler, targets: dict[int, int], max_steps: int = 100_000) -> Simulated:
    """Run the scheduler until nothing is left; sequence i stops after targets[i] outputs.
    Every step checks the budget, max_num_seqs, slots for every scheduled token and the
    integrity of the pool and tree."""
    kv = sched.kv
    steps = computed = 0
    while sched.has_unfinished():
        assert steps < max_steps, "no end"
        out = sched.schedule()
        assert out.scheduled, "no progress"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            need = blocks_for(s.seq.num_computed_tokens + s.num_new_tokens, kv.block_size)
            assert len(s.seq.block_table) >= need
        sched.check_integrity()
        sampling = [s.seq for s in out.scheduled if s.completes_prefill]
        computed += out.num_tokens
        sched.update_from_output(out)
        for seq in sampling:
            seq.append_token(1000 + seq.num_tokens)
            if seq.num_output_tokens == targets[seq.seq_id]:
                sched.finish(seq)
        sched.check_integrity()
        steps += 1
    return Simulated(steps, computed)
