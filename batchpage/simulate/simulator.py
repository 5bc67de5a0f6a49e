"""The engine's scheduling without a model: the real Scheduler, KV manager and radix cache (one
`build_scheduler`, as Engine builds them) driven step by step, each step's time from a
`StepCost` instead of a forward.

Each request is a prompt's token ids and the number of tokens it will generate: exactly
max_tokens with ignore_eos, else `output_len` (then the engine only knows max_tokens, and the
simulated end is an EOS at output_len, as the model's would be). A step goes as Engine.step
goes: schedule (admission, preemption, swaps), then the engine's own commit (engine/commit.py) of
a result in which each sequence that completes its prompt takes one token: computed counts, full
blocks published to the cache, the token appended, and the stop checks (the engine's StopChecker)
finish what ends. Swaps cost their K/V bytes over the
host link. What comes out is the job's simulated time and what the engine would report, the time
also in parts: first prefills, decodes, recomputation after preemptions, swaps (a step that
mixes prefill chunks and decodes gives its decodes what those alone would cost, and its prompt
tokens the rest).

A job runs its rows window by window (each window one generate call, drained before the next,
the radix cache kept): `simulate_windows` steps through windows in turn on one scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from batchpage.engine.commit import StepCommit, StepResult
from batchpage.engine.config import EngineConfig
from batchpage.engine.schedule_output import SchedulerOutput
from batchpage.engine.scheduler import Scheduler, build_scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.stop_checker import StopChecker
from batchpage.metrics import RunStats
from batchpage.sampling_params import SamplingParams
from batchpage.simulate.step_cost import StepCost, StepWork

# Token ids of the simulated outputs: above any vocabulary, so that they never match a prompt's
# tokens in the radix cache; each sequence's its own (outputs of different requests differ).
_EOS = 2**40
_FIRST_OUTPUT_ID = 2**40 + 1


@dataclass(frozen=True)
class SimRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    output_len: int  # tokens it generates; with ignore_eos, max_tokens
    ignore_eos: bool = True


@dataclass
class SimResult:
    seconds: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_running: int = 0
    preemptions: int = 0
    swaps: int = 0
    recomputed_tokens: int = 0  # prompt and output tokens computed again after a preemption
    cached_prompt_tokens: int = 0
    used_slot_steps: int = 0
    reserved_slot_steps: int = 0
    running_steps: int = 0  # running sequences summed over steps
    swap_seconds: float = 0.0  # of `seconds`
    prefill_seconds: float = 0.0  # of `seconds`: prompt tokens computed the first time
    decode_seconds: float = 0.0  # of `seconds`
    recompute_seconds: float = 0.0  # of `seconds`: tokens computed again after a preemption
    # With keep_steps: each step's work, to time the same schedule under other efficiencies
    # (the schedule does not depend on the step times).
    works: list[StepWork] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def kv_waste(self) -> float:
        """1 - used slots / reserved slots, time-averaged over steps (RunStats' kv_waste)."""
        if not self.reserved_slot_steps:
            return 0.0
        return 1.0 - self.used_slot_steps / self.reserved_slot_steps

    @property
    def mean_running(self) -> float:
        return self.running_steps / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "seconds": self.seconds,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "peak_running": self.peak_running,
            "mean_running": self.mean_running,
            "preemptions": self.preemptions,
            "swaps": self.swaps,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_waste": self.kv_waste,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "recompute_seconds": self.recompute_seconds,
            "swap_seconds": self.swap_seconds,
        }


def simulate(
    requests: Seq[SimRequest],
    cfg: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    cost: StepCost,
    max_num_batched_tokens: int,
    keep_steps: bool = False,
    acceptance: float | None = None,
) -> SimResult:
    """Run the requests through the engine's scheduling with simulated steps."""
    return simulate_windows(
        [requests], cfg, num_blocks, max_model_len, cost, max_num_batched_tokens, keep_steps,
        acceptance,
    )  # fmt: skip


def simulate_windows(
    windows: Seq[Seq[SimRequest]],
    cfg: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    cost: StepCost,
    max_num_batched_tokens: int,
    keep_steps: bool = False,
    acceptance: float | None = None,
) -> SimResult:
    """Each window's requests added once the previous window's have all finished, as a job's
    generate calls go: one scheduler, so a later window's prompts hit what an earlier one
    cached. With cfg.speculative_config and an `acceptance` (each draft's odds of being
    accepted, given the ones before it were), every decode row runs num_speculative_tokens
    drafts a step (within its length limit) and keeps a run of them drawn at those odds."""
    scheduler = build_scheduler(cfg, num_blocks, max_model_len, max_num_batched_tokens)
    result = SimResult()
    drafts = cfg.num_speculative_tokens if acceptance is not None else 0
    run = _Run(scheduler, cost, cfg.block_size, result, keep_steps, drafts, acceptance or 0.0)
    for window in windows:
        seqs = [_sequence(result.requests + i, r, max_model_len) for i, r in enumerate(window)]
        run.targets.update((s.seq_id, r.output_len) for s, r in zip(seqs, window, strict=True))
        result.requests += len(seqs)
        result.prompt_tokens += sum(s.num_tokens for s in seqs)
        scheduler.add_batch(seqs)
        while scheduler.has_unfinished():
            run.step()
    result.recomputed_tokens = run.computed_prefill - sum(run.first_prefill.values())
    return result


class _Run:
    """The steps of one simulation, as Engine.step takes them."""

    def __init__(
        self,
        scheduler: Scheduler,
        cost: StepCost,
        block_size: int,
        result: SimResult,
        keep: bool,
        drafts: int = 0,
        acceptance: float = 0.0,
    ) -> None:
        self.scheduler, self.cost, self.block_size = scheduler, cost, block_size
        self.result, self.keep = result, keep
        self.drafts, self.acceptance = drafts, acceptance
        self.rng = np.random.default_rng(0)  # the drafts' acceptance draws
        self.commit = StepCommit(scheduler, factory=None)
        self.stats = RunStats(scheduler.kv.num_blocks, block_size)
        self.targets: dict[int, int] = {}  # seq_id -> the tokens it generates
        self.first_prefill: dict[int, int] = {}  # seq_id -> prompt tokens its first admission ran
        self.recomputing: set[int] = set()  # preempted without a swap: its prefill is again
        self.computed_prefill = 0

    def step(self) -> None:
        scheduler, result = self.scheduler, self.result
        if self.drafts:
            self._draft()
        out = scheduler.schedule()
        if not len(out.rows):
            raise RuntimeError("the scheduler could not run any sequence: this is a bug")
        result.preemptions += len(out.preempted)
        result.swaps += len(out.swap_out)
        swapped = {s.seq_id for s in out.swap_out}
        self.recomputing.update(s.seq_id for s in out.preempted if s.seq_id not in swapped)
        self._time(out)
        rows, tokens, counts = [], [], []
        rejected = np.zeros(len(out.rows), dtype=np.int64)
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if seq.seq_id not in self.first_prefill:
                result.cached_prompt_tokens += seq.num_cached_tokens
                self.first_prefill[seq.seq_id] = seq.num_prompt_tokens - seq.num_cached_tokens
            if s.completes_prefill:
                ran = seq.num_computed_tokens + s.num_new_tokens - seq.num_tokens  # drafts
                accepted = self._accepted(ran)
                rejected[i] = ran - accepted
                left = self.targets[seq.seq_id] - seq.num_output_tokens
                take = min(accepted + 1, left)
                row = [_FIRST_OUTPUT_ID + seq.seq_id] * (self.drafts + 1)
                if take == left:  # the simulated end: an EOS as its last token
                    row[take - 1] = _EOS
                rows.append(seq.row)
                tokens.append(row)
                counts.append(take)
        stats = self.stats
        prefill_before = stats.prefill_tokens_computed
        step = StepResult(
            np.array(rows, dtype=np.int64),
            np.array(tokens, dtype=np.int64).reshape(len(rows), self.drafts + 1),
            np.array(counts, dtype=np.int64),
            rejected=rejected if self.drafts else None,
        )
        for seq in self.commit.commit(out, step, stats):
            self.recomputing.discard(seq.seq_id)
        self.computed_prefill += stats.prefill_tokens_computed - prefill_before
        result.generated_tokens = stats.generated_tokens
        running = scheduler.running
        result.steps += 1
        result.running_steps += len(running)
        result.peak_running = max(result.peak_running, len(running))
        result.used_slot_steps = stats.used_slot_steps
        result.reserved_slot_steps = stats.reserved_slot_steps

    def _draft(self) -> None:
        """Every decode row runs its drafts this step, as many as its length limit allows."""
        batch = self.scheduler.batch
        batch.num_drafts[:] = 0
        decoding = batch.speculates & (batch.computed == batch.num_tokens - 1)
        rows = np.flatnonzero(decoding & (batch.num_tokens > batch.num_prompt))
        room = batch.stop_len[rows] - batch.num_tokens[rows] - 1
        batch.num_drafts[rows] = np.clip(room, 0, self.drafts)

    def _accepted(self, drafts: int) -> int:
        """How many of `drafts` are accepted: each at the acceptance odds, while all before it
        were."""
        accepted = 0
        while accepted < drafts and self.rng.random() < self.acceptance:
            accepted += 1
        return accepted

    def _time(self, out: SchedulerOutput) -> None:
        """The step's seconds, in parts (read before the step's tokens are committed)."""
        cost, result = self.cost, self.result
        rows = [(s.num_new_tokens, s.seq.num_computed_tokens, s.completes_prefill) for s in
                out.scheduled]  # fmt: skip
        prefill = [s.seq.is_prefilling for s in out.scheduled]
        work = cost.work(rows)
        work.read_once(_repeated_context(out, self.block_size))
        seconds = cost.seconds(work)
        swap = _swap_seconds(out, cost, self.block_size)
        result.seconds += seconds + swap
        result.swap_seconds += swap
        if self.keep:
            result.works.append(work)
        if not any(prefill):
            result.decode_seconds += seconds
            return
        if not all(prefill):
            alone = cost.work(r for r, p in zip(rows, prefill, strict=True) if not p)
            alone.read_once(_repeated_context(out, self.block_size, decodes_only=True))
            decodes = cost.seconds(alone)
            result.decode_seconds += decodes
            seconds -= decodes
        again = sum(
            s.num_new_tokens
            for s, p in zip(out.scheduled, prefill, strict=True)
            if p and s.seq.seq_id in self.recomputing
        )
        share = again / sum(r[0] for r, p in zip(rows, prefill, strict=True) if p)
        result.recompute_seconds += seconds * share
        result.prefill_seconds += seconds * (1 - share)


def _repeated_context(out: SchedulerOutput, block_size: int, decodes_only: bool = False) -> int:
    """Context tokens of the step's sequences (of its decodes alone with `decodes_only`) in
    blocks that an earlier one of them reads too: a shared prefix's blocks, which the step reads
    from memory once."""
    seen: set[int] = set()
    listed = 0
    for s in out.scheduled:
        seq = s.seq
        if decodes_only and seq.is_prefilling:
            continue
        full = seq.num_computed_tokens // block_size  # a partial block is never shared
        blocks = seq.block_table[:full]
        listed += len(blocks)
        seen.update(blocks)
    return (listed - len(seen)) * block_size


def _sequence(index: int, r: SimRequest, max_model_len: int) -> Sequence:
    if r.ignore_eos and r.output_len != r.max_tokens:
        raise ValueError(f"request {index}: with ignore_eos it generates max_tokens tokens")
    if not 1 <= r.output_len <= r.max_tokens:
        raise ValueError(f"request {index}: output_len must be in [1, max_tokens]")
    params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
    ids = list(r.prompt_token_ids)
    request = Request(index, None, ids, params)
    stop = StopChecker(lambda _: "", params, (_EOS,), len(ids), max_model_len)
    return Sequence(index, request, 0, list(ids), 0, stop)


def _swap_seconds(out: SchedulerOutput, cost: StepCost, block_size: int) -> float:
    """The step's swap-outs and swap-ins: each block's K/V over the host link."""
    blocks = sum(len(s.blocks) for s in (*out.swap_out, *out.swap_in))
    if not blocks:
        return 0.0
    block_bytes = cost.shape.kv_bytes_per_token * block_size / cost.tp
    device = cost.device
    return blocks * block_bytes / (device.host_bandwidth or device.bandwidth)
