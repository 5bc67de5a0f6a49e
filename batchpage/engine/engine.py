"""Engine: the step loop. schedule -> build step tensors -> execute -> sample -> stop checks.

State flows one way: the scheduler decides, step_inputs builds the tensors, the model runner
executes, the KV cache manager owns the blocks. The engine only moves results between them and
records the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchpage.cache.kv_cache import KVCache, bytes_per_block
from batchpage.cache.kv_manager import KVCacheManager, StaticKVCacheManager
from batchpage.config import EngineConfig, kv_cache_bytes
from batchpage.engine.beam_runner import BeamSearchRunner
from batchpage.engine.model_runner import ModelRunner, make_attention_backend
from batchpage.engine.scheduler import ScheduledSeq, Scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.sequence_factory import SequenceFactory
from batchpage.engine.step_inputs import StepInputs, build_step
from batchpage.host_memory import keep_freed_memory
from batchpage.metrics import RunStats
from batchpage.model.config import ModelConfig
from batchpage.model.llama import LlamaForCausalLM
from batchpage.model.tokenizer import Tokenizer
from batchpage.sampler import compute_logprobs, sample

OnFinish = Callable[[Sequence, RunStats], None]


class PoolTooSmall(ValueError):
    pass


def plan_num_blocks(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Blocks that fit the KV budget; refuses a pool that cannot hold one max_model_len sequence.
    Needs only the model's config, so a job fails here before any weight is read."""
    per_block = bytes_per_block(
        model_cfg.num_layers, cfg.block_size, model_cfg.num_kv_heads, model_cfg.head_dim, dtype
    )
    budget = kv_cache_bytes(cfg.kv_cache_memory, device)
    num_blocks = budget // per_block
    needed = -(-max_model_len // cfg.block_size)
    if num_blocks < needed:
        raise PoolTooSmall(
            f"the KV pool ({budget / 2**20:.1f} MiB = {num_blocks} blocks of {cfg.block_size} "
            f"tokens) cannot hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed} blocks, {needed * per_block / 2**20:.1f} MiB): raise kv_cache_memory or "
            "lower max_model_len"
        )
    return num_blocks


@dataclass
class _Run:
    """One run()'s bookkeeping."""

    stats: RunStats
    on_finish: OnFinish | None
    by_request: dict[int, list[Sequence]] = field(default_factory=dict)
    started: set[int] = field(default_factory=set)  # requests that produced a token


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        num_blocks: int,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.max_model_len = max_model_len
        if device.type == "cpu":
            keep_freed_memory()  # see host_memory.py: page faults were a third of a CPU step
        kv = KVCache.allocate(
            model_cfg.num_layers,
            num_blocks,
            cfg.block_size,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            dtype,
            device,
        )
        if cfg.kv_allocator == "static":
            self.kv_manager: KVCacheManager = StaticKVCacheManager(
                num_blocks, cfg.block_size, max_model_len
            )
        else:
            self.kv_manager = KVCacheManager(
                num_blocks, cfg.block_size, cfg.prefix_caching, cfg.eviction_policy
            )
        self.runner = ModelRunner(model, kv, make_attention_backend(cfg.attention_backend, device))
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.batched_tokens(),
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            preemption_mode=cfg.preemption_mode,
        )
        self.eos_ids = tokenizer.eos_token_ids
        self.factory = SequenceFactory(tokenizer, self.eos_ids, max_model_len, cfg.seed)
        # Tests set this to check every invariant after every step.
        self.check_integrity_each_step = False

    def run(
        self, requests: list[Request], on_finish: OnFinish | None = None
    ) -> tuple[dict[int, list[Sequence]], RunStats]:
        """Runs every valid request to completion; returns its sequences by request index."""
        run = _Run(RunStats(self.kv_manager.num_blocks, self.cfg.block_size), on_finish)
        stats = run.stats
        # The whole job is known: in token order, prompts that share a prefix run back to back
        # (depth-first over the prompts' trie), so the shared blocks are computed once and are
        # still cached when the next one arrives. Outputs keep the input order.
        if self.cfg.schedule == "prefix":
            requests = sorted(requests, key=lambda r: r.prompt_token_ids)
        share = self.cfg.kv_allocator == "paged"
        beams = [r for r in requests if r.error is None and r.params.use_beam_search]
        for req in requests:
            if req.error is not None:
                continue
            stats.requests += 1
            stats.prompt_tokens += len(req.prompt_token_ids)
            if req.params.use_beam_search:
                continue
            seqs = self.factory.for_request(req, share_prompt=share)
            run.by_request[req.index] = seqs
            for seq in seqs:
                self.scheduler.add(seq)
        before = (self.scheduler.num_preemptions, self.scheduler.num_swaps)

        while self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
            if not out.scheduled:
                raise RuntimeError("the scheduler could not run any sequence: this is a bug")
            inputs = build_step(out.scheduled, self.cfg.block_size, self.device)
            blocks_used = self.kv_manager.pool.num_used  # during the forward, before any frees
            logits, prompt_logits = self.runner.execute(inputs, out)
            if prompt_logits is not None:
                self._score_prompts(inputs, prompt_logits)
            for s in out.scheduled:
                stats.prefill_tokens_computed += self._prefill_tokens(s)
                s.seq.num_computed_tokens += s.num_new_tokens
                if s.num_new_tokens > 1:
                    self.kv_manager.cache_progress(s.seq)  # later arrivals can hit it now
            if inputs.sample_seqs:
                self._sample(inputs.sample_seqs, logits, run)
            running = self.scheduler.running
            stats.record_step(
                num_running=len(running),
                used_slots=sum(s.num_computed_tokens for s in running),
                reserved_slots=sum(len(s.block_table) for s in running) * self.cfg.block_size,
                blocks_used=blocks_used,
            )
            if self.check_integrity_each_step:
                self.scheduler.check_integrity()
        if beams:
            BeamSearchRunner(self).run(beams, run)
        stats.preemptions = self.scheduler.num_preemptions - before[0]
        stats.swaps = self.scheduler.num_swaps - before[1]
        stats.finish()
        return run.by_request, stats

    @staticmethod
    def _prefill_tokens(s: ScheduledSeq) -> int:
        """Tokens computed for a prompt (or recomputed after preemption), not as a decode step."""
        seq = s.seq
        if s.num_new_tokens > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return s.num_new_tokens
        return 0

    @staticmethod
    def _score_prompts(inputs: StepInputs, logits: torch.Tensor) -> None:
        targets = torch.tensor(inputs.prompt_targets)
        wanted = [s.params.prompt_logprobs for s, n in inputs.prompt_owners for _ in range(n)]
        scored = compute_logprobs(logits, targets, wanted)
        row = 0
        for seq, n in inputs.prompt_owners:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs += scored[row : row + n]
            row += n

    def _fork_samples(self, seqs: list[Sequence], run: _Run) -> tuple[list[Sequence], list[int]]:
        """A parent whose prompt is now computed forks its other samples: they share its blocks
        and sample their first token from its logits row. Returns every sampling sequence and
        its logits row."""
        rows = list(range(len(seqs)))
        if not any(s.pending_forks for s in seqs):
            return seqs, rows
        all_seqs = list(seqs)
        for row, parent in enumerate(seqs):
            for index in parent.pending_forks:
                child = self.factory.make(parent.request, index)
                self.kv_manager.fork(parent, child)
                self.scheduler.add_forked(child)
                run.by_request[parent.request.index].append(child)
                all_seqs.append(child)
                rows.append(row)
            parent.pending_forks = []
        return all_seqs, rows

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, run: _Run) -> None:
        seqs, rows = self._fork_samples(seqs, run)
        if len(rows) != logits.shape[0]:
            logits = logits[rows]
        params = [s.params for s in seqs]
        # Token histories cost a copy per row: build them only when a row's penalties read them.
        history = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
            for p in params
        )
        result = sample(
            logits,
            params=params,
            generators=[s.generator for s in seqs],
            prompt_ids=[s.token_ids[: s.num_prompt_tokens] if history else () for s in seqs],
            output_ids=[s.output_token_ids if history else () for s in seqs],
            eos_ids=[self.eos_ids] * len(seqs),
        )
        stats = run.stats
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids, strict=True)):
            if seq.request.index not in run.started:
                run.started.add(seq.request.index)
                stats.record_first_token()
                stats.cached_prompt_tokens += seq.num_cached_tokens
            seq.token_ids.append(token)
            stats.generated_tokens += 1
            if result.logprobs[i] is not None:
                seq.logprobs = (seq.logprobs or []) + [result.logprobs[i]]
            decision = seq.stop.append(token)
            if decision is not None:
                seq.finish_reason = decision.finish_reason
                seq.stop_reason = decision.stop_reason
                seq.text = seq.stop.text
                self.scheduler.finish(seq)
                if run.on_finish is not None:
                    run.on_finish(seq, stats)
