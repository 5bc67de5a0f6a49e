"""Engine: the step loop. schedule -> build step tensors -> execute -> sample -> stop checks.

State flows one way: the scheduler decides, step_inputs builds the tensors, the model runner
executes, the KV cache manager owns the blocks. The engine only moves results between them and
records the metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchpage.cache.kv_cache import KVCache, bytes_per_block
from batchpage.cache.kv_manager import KVCacheManager
from batchpage.config import EngineConfig, kv_cache_bytes
from batchpage.engine.model_runner import ModelRunner, make_attention_backend
from batchpage.engine.scheduler import ScheduledSeq, Scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.step_inputs import build_step
from batchpage.engine.stop_checker import StopChecker
from batchpage.metrics import RunStats
from batchpage.model.config import ModelConfig
from batchpage.model.llama import LlamaForCausalLM
from batchpage.model.tokenizer import Tokenizer
from batchpage.sampler import sample


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


def sequence_seed(request_seed: int | None, engine_seed: int, index: int, sample: int) -> int:
    """A request's randomness depends on its seed (or the engine seed and its position) and the
    sample index only, never on what else runs in the batch."""
    base = request_seed if request_seed is not None else engine_seed * 1_000_003 + index
    return (base * 6_364_136_223_846_793_005 + sample * 1_442_695_040_888_963_407) % 2**63


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
        self.tokenizer = tokenizer
        self.device = device
        self.max_model_len = max_model_len
        kv = KVCache.allocate(
            model_cfg.num_layers,
            num_blocks,
            cfg.block_size,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            dtype,
            device,
        )
        self.kv_manager = KVCacheManager(
            num_blocks, cfg.block_size, cfg.prefix_caching, cfg.eviction_policy
        )
        self.runner = ModelRunner(model, kv, make_attention_backend(cfg.attention_backend, device))
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.batched_tokens(),
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        self.eos_ids = tokenizer.eos_token_ids
        self._next_seq_id = 0
        # Tests set this to check every invariant after every step.
        self.check_integrity_each_step = False

    def _make_sequences(self, req: Request) -> list[Sequence]:
        seqs = []
        for i in range(req.params.n):
            gen = None
            if not req.params.is_greedy:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(sequence_seed(req.params.seed, self.cfg.seed, req.index, i))
            seq = Sequence(
                seq_id=self._next_seq_id,
                request=req,
                sample_index=i,
                token_ids=list(req.prompt_token_ids),
                generator=gen,
                stop=StopChecker(
                    self.tokenizer,
                    req.params,
                    self.eos_ids,
                    prompt_len=len(req.prompt_token_ids),
                    max_model_len=self.max_model_len,
                    # A few prompt tokens as context keep the first output token's leading space.
                    context_ids=req.prompt_token_ids[-4:],
                ),
            )
            self._next_seq_id += 1
            seqs.append(seq)
        return seqs

    def run(
        self,
        requests: list[Request],
        on_finish: Callable[[Sequence, RunStats], None] | None = None,
    ) -> tuple[dict[int, list[Sequence]], RunStats]:
        """Runs every valid request to completion; returns its sequences by request index."""
        stats = RunStats(kv_blocks_total=self.kv_manager.num_blocks, block_size=self.cfg.block_size)
        by_request: dict[int, list[Sequence]] = {}
        # The whole job is known: in token order, prompts that share a prefix run back to back
        # (depth-first over the prompts' trie), so the shared blocks are computed once and are
        # still cached when the next one arrives. Outputs keep the input order.
        if self.cfg.schedule == "prefix":
            requests = sorted(requests, key=lambda r: r.prompt_token_ids)
        for req in requests:
            if req.error is not None:
                continue
            seqs = self._make_sequences(req)
            by_request[req.index] = seqs
            stats.requests += 1
            stats.prompt_tokens += len(req.prompt_token_ids)
            for seq in seqs:
                self.scheduler.add(seq)
        seen_first_token: set[int] = set()
        preemptions_before = self.scheduler.num_preemptions

        while self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
            if not out.scheduled:
                raise RuntimeError("the scheduler could not run any sequence: this is a bug")
            inputs = build_step(out.scheduled, self.cfg.block_size, self.device)
            logits = self.runner.execute(inputs, out.copies)
            for s in out.scheduled:
                stats.prefill_tokens_computed += self._prefill_tokens(s)
                s.seq.num_computed_tokens += s.num_new_tokens
                if s.num_new_tokens > 1:
                    self.kv_manager.cache_progress(s.seq)  # later arrivals can hit it now
            if inputs.sample_seqs:
                self._sample(inputs.sample_seqs, logits, stats, seen_first_token, on_finish)
            stats.record_step(
                num_running=len(self.scheduler.running),
                used_slots=sum(s.num_computed_tokens for s in self.scheduler.running),
                reserved_slots=sum(len(s.block_table) for s in self.scheduler.running)
                * self.cfg.block_size,
            )
            if self.check_integrity_each_step:
                self.scheduler.check_integrity()
        stats.preemptions = self.scheduler.num_preemptions - preemptions_before
        stats.finish()
        return by_request, stats

    @staticmethod
    def _prefill_tokens(s: ScheduledSeq) -> int:
        """Tokens computed for a prompt (or recomputed after preemption), not as a decode step."""
        seq = s.seq
        if s.num_new_tokens > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return s.num_new_tokens
        return 0

    def _sample(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        stats: RunStats,
        seen_first_token: set[int],
        on_finish: Callable[[Sequence, RunStats], None] | None,
    ) -> None:
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
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids, strict=True)):
            if seq.request.index not in seen_first_token:
                seen_first_token.add(seq.request.index)
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
                if on_finish is not None:
                    on_finish(seq, stats)
