"""Engine: the step loop. schedule -> build step tensors -> execute -> sample -> stop checks.

State flows one way: the scheduler decides, step_inputs builds the tensors, the model runner
executes, the KV cache manager owns the blocks. The engine moves results between them, records
the metrics, and hands back the sequences that finished in each step; it never calls out.

    engine.add_requests(requests)      # returns the RunStats the following steps fill
    while engine.has_unfinished():
        for seq in engine.step(): ...  # finished sequences, as they finish
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from batchpage.engine.beam_steps import BeamOutcome, Beams
from batchpage.engine.commit import Forks, StepCommit, StepResult
from batchpage.engine.config import EngineConfig
from batchpage.engine.constraint import Constraint, GrammarMasks
from batchpage.engine.drafts import DraftStage
from batchpage.engine.encoder_cache import EncoderCache
from batchpage.engine.encoder_files import EncoderFiles, vision_key
from batchpage.engine.grammar_cache import GrammarCache
from batchpage.engine.image_budget import holds_nothing
from batchpage.engine.kv_manager import KVCacheManager
from batchpage.engine.model_runner import Peers, build_model_runner
from batchpage.engine.plan import EnginePlan
from batchpage.engine.pooled_states import PoolingType, PoolSum, pooled_vector, uses_score_head
from batchpage.engine.reasoning import (
    ThinkingTracker,
    allow_start_marker,
    force_tokens,
    resolve_markers,
)
from batchpage.engine.sampler import (
    Penalties,
    SamplerOutput,
    TopLogprobs,
    compute_logprobs,
    draw_keys,
    sample,
    sample_greedy,
)
from batchpage.engine.scheduler import build_scheduler
from batchpage.engine.sequence import PendingForks, Request, Sequence
from batchpage.engine.sequence_factory import SequenceFactory, sequence_seed
from batchpage.engine.step_inputs import StepBuilder, StepInputs
from batchpage.host_memory import keep_freed_memory
from batchpage.metrics import RunStats
from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.mrope import prompt_positions
from batchpage.model.score_head import token_classifier
from batchpage.model.tokenizer import Tokenizer
from batchpage.model.vision_lm import VisionLanguageBase
from batchpage.speculative.verify import accepted_counts

log = logging.getLogger(__name__)

BEAM_SEARCH_WITH_CONSTRAINT = (
    "structured_outputs cannot be combined with use_beam_search: use sampling or greedy "
    "decoding (n > 1 for several candidates)"
)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        plan: EnginePlan,
        peers: Peers | None = None,
    ) -> None:
        """`peers`: the model is rank 0's share of a tensor-parallel group, whose other ranks
        (distributed/workers.py) run every step with it."""
        self.cfg = cfg
        self.plan = plan
        self.device = plan.device
        self.max_model_len = plan.max_model_len
        if plan.device.type == "cpu":
            keep_freed_memory()  # see host_memory.py: freed pages are not faulted in again
        # A vision-language model's encoder rows by image content (engine/encoder_cache.py); the
        # tower's key for rows on disk is hashed before bind packs its linears.
        self.encoder = None
        # Its image rows attend both ways (Gemma 3): spans are scheduled and attended whole.
        whole_spans = isinstance(model, VisionLanguageBase) and model.BIDIRECTIONAL_IMAGES
        if isinstance(model, VisionLanguageBase):
            files = None
            if cfg.encoder_cache_dir is not None:
                files = EncoderFiles(Path(cfg.encoder_cache_dir), vision_key(model.vision))
            budget = int(cfg.encoder_cache_gb * 2**30)
            self.encoder = EncoderCache(model.encode_images, budget, plan.device, files)
        self.scheduler = build_scheduler(
            cfg,
            plan.num_blocks,
            plan.max_model_len,
            cfg.batched_tokens(plan.device),
            holds_nothing if self.encoder is None else self.encoder.holds,
            whole_spans,
        )
        self.kv_manager: KVCacheManager = self.scheduler.kv
        if cfg.classifier_from_token is not None:  # before bind: the lm_head as loaded
            rows = model.head_rows(_token_ids(tokenizer, cfg.classifier_from_token))
            model.score = token_classifier(rows, model.embed_tokens.weight.dtype)
        # Linears are measured with the threads rank 0 runs its steps with.
        with peers.rank_threads() if peers is not None else contextlib.nullcontext():
            built = build_model_runner(model, cfg, plan, peers)
        self.bind_report = built.bind_report
        self.linear_methods = built.linear_methods
        self.linear_measurement = built.linear_measurement
        self.weight_bytes = model.weight_bytes()  # after bind: in the layouts the ops keep
        # The all-greedy sampler's argmax: the bound layer ops' (the C++ one on the CPU kernels).
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = built.argmax
        # The sampled rows' draw: the bound layer ops' exponential race (C++ on the CPU kernels).
        self.race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = built.race
        # A pooling model's requests finish when their prompt is computed (pooled_states.py).
        self.task = plan.task
        self.pooling = None if plan.task == "generate" else PoolingType(cfg.pooling_type)
        self.model = model
        self.runner = built.runner
        # The LoRA adapters read so far (enable_lora), which requests are checked against.
        self.adapters = built.runner.adapters
        self.eos_ids = tokenizer.eos_token_ids
        self.grammars = GrammarCache(tokenizer.hf, model_cfg.vocab_size, self.eos_ids)
        self.masks = GrammarMasks(model_cfg.vocab_size)
        self.reasoning = resolve_markers(cfg.reasoning_parser, tokenizer.single_token_id)
        self.factory = SequenceFactory(
            tokenizer, self.eos_ids, plan.max_model_len, cfg.seed, self.reasoning
        )
        self.batch = self.scheduler.batch  # the running sequences' rows
        # M-RoPE (Qwen2.5-VL): 3-D positions, a prompt's with images from its images' grids
        # of this spatial merge; None: 1-D positions.
        self.mrope_merge: int | None = None
        if model_cfg.mrope_section:
            self.mrope_merge = model_cfg.vision.spatial_merge_size if model_cfg.vision else 1
        mrope = self.mrope_merge is not None
        self.step_builder = StepBuilder(self.batch, cfg.block_size, plan.device, mrope, whole_spans)
        self.beams = Beams(self.factory, plan.max_model_len)
        self.commit = StepCommit(self.scheduler, self.factory)
        spec = cfg.speculative()
        self.drafts = None if spec is None else DraftStage(spec, self.batch, plan.max_model_len)
        self.stats = self._new_stats()
        # Tests set this to check every invariant after every step.
        self.check_integrity_each_step = False

    def _new_stats(self) -> RunStats:
        stats = RunStats(self.kv_manager.num_blocks, self.cfg.block_size)
        stats.weight_bytes = self.weight_bytes
        stats.weight_formats = dict(self.bind_report.weight_formats)
        stats.linear_methods = dict(self.linear_methods)
        stats.linear_measurement = dict(self.linear_measurement)
        return stats

    def add_requests(self, requests: list[Request]) -> RunStats:
        """Queue every valid request (those with an error are skipped). When nothing was running,
        this starts a new run: the returned RunStats is filled by the steps that follow.

        A request with structured_outputs gets its grammar compiled here unless the caller did
        it (LLM does, to turn a bad constraint into that request's error); a bad one raises
        ValueError, as does one combined with beam search."""
        if not self.has_unfinished():
            self.stats = self._new_stats()
            self.commit.new_run()
            if self.drafts is not None:
                self.drafts.reset()
        share = self.cfg.kv_allocator == "paged"
        seqs: list[Sequence] = []
        for req in requests:
            if req.error is not None:
                continue
            if (req.pooling is None) != (self.pooling is None):
                raise ValueError(
                    f"a {'pooling' if req.pooling else 'generation'} request for an engine whose "
                    f"task is {self.task}"
                )
            self._compile_grammar(req)
            if self.mrope_merge is not None and req.images and req.mrope is None:
                n = len(req.prompt_token_ids)
                req.mrope = prompt_positions(n, req.images, self.mrope_merge)
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.prompt_token_ids)
            if req.params.use_beam_search:
                seqs.append(self.beams.add(req))
            else:
                seqs += self.factory.for_request(req, share_prompt=share)
        self.scheduler.add_batch(seqs)
        return self.stats

    def _compile_grammar(self, req: Request) -> None:
        constraint = req.params.structured_outputs
        if constraint is None or req.grammar is not None:
            return
        if req.params.use_beam_search:
            raise ValueError(BEAM_SEARCH_WITH_CONSTRAINT)
        req.grammar = self.grammars.compile(constraint)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward over the scheduled tokens; returns the sequences that finished in it
        (a beam search's: its best hypotheses, when it ends)."""
        if not self.scheduler.has_unfinished():
            self._finish_run_if_done()
            return []
        stats = self.stats
        parts, clock = stats.step_time_s, time.perf_counter
        t0 = clock()
        out = self.scheduler.schedule()
        if not len(out.rows):
            raise RuntimeError("the scheduler could not run any sequence: this is a bug")
        stats.preemptions += len(out.preempted)
        stats.swaps += len(out.swap_out)
        t1 = clock()
        inputs = self.step_builder.build(out.rows, out.num_new)
        t2 = clock()
        embeds = None
        if inputs.images:
            assert self.encoder is not None, "image positions on a model without a vision tower"
            embeds = self.encoder.embeds(inputs.images, stats)
        logits, prompt_logits, pooled = self.runner.execute(inputs, out, embeds)
        t3 = clock()
        parts["schedule"] += t1 - t0
        parts["inputs"] += t2 - t1
        parts["forward"] += t3 - t2
        prompt_logprobs = [] if prompt_logits is None else _score_prompts(inputs, prompt_logits)
        if self.pooling is not None:
            result = self._pool(inputs, logits, pooled, prompt_logprobs)
        elif len(inputs.sample_rows):
            result = self._sample(inputs, logits, prompt_logprobs)
        else:
            result = StepResult.nothing(prompt_logprobs=prompt_logprobs)
        parts["sample"] += clock() - t3
        finished = self.commit.commit(out, result, stats)
        if self.drafts is not None:
            t5 = clock()
            tokens, sampled = int(out.num_new.sum()), len(inputs.sample_rows)
            self.drafts.follow(result, finished, tokens, sampled, t5 - t0)
            self.drafts.propose(len(self.scheduler.running))
            parts["draft"] += clock() - t5
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        self._finish_run_if_done()
        return finished

    def run(self, requests: list[Request]) -> tuple[dict[int, list[Sequence]], RunStats]:
        """Runs every valid request to completion; returns its sequences by request index."""
        stats = self.add_requests(requests)
        by_request: dict[int, list[Sequence]] = {}
        while self.has_unfinished():
            for seq in self.step():
                by_request.setdefault(seq.request.index, []).append(seq)
        stats.finish()  # a run of error requests only takes no step
        return by_request, stats

    def _finish_run_if_done(self) -> None:
        if not self.has_unfinished():
            self.stats.finish()

    def _pool(
        self,
        inputs: StepInputs,
        last_rows: torch.Tensor,
        pooled: torch.Tensor | None,
        prompt_logprobs: list[tuple[Sequence, list[TopLogprobs]]],
    ) -> StepResult:
        """Pooling requests: sum this step's MEAN / CLS rows; those whose prompt is now
        computed get the head's output on their pooled vector (they finish at the commit)."""
        row = 0
        for seq, start, n in inputs.pool_owners:
            assert pooled is not None
            pool_sum = seq.feature(PoolSum)
            if pool_sum is None:
                pool_sum = PoolSum()
                seq.attach(pool_sum)
            pool_sum.add_chunk(start, pooled[row : row + n])
            row += n
        seqs = self.batch.seqs(inputs.sample_rows)
        if not seqs:
            return StepResult.nothing(prompt_logprobs=prompt_logprobs)
        pooling = self.pooling
        assert pooling is not None
        vectors = [
            pooled_vector(pooling, _pool_total(s), last_rows[i], s.num_prompt_tokens)
            for i, s in enumerate(seqs)
        ]
        stacked = torch.stack([v.to(last_rows.dtype) for v in vectors])
        with torch.inference_mode():
            outputs = self.model.pool_head(stacked) if uses_score_head(self.task) else stacked
        outputs = outputs.float().cpu()
        for seq in seqs:
            seq.detach(PoolSum)
        return StepResult.nothing(
            pooled=list(zip(seqs, outputs, strict=True)), prompt_logprobs=prompt_logprobs
        )

    def _sample(
        self,
        inputs: StepInputs,
        logits: torch.Tensor,
        prompt_logprobs: list[tuple[Sequence, list[TopLogprobs]]],
    ) -> StepResult:
        """The tokens of the rows whose sequences computed all their tokens (and of the samples
        a parent forks now), as data for the commit. Plain greedy rows take their argmax with no
        Python per row; only rows whose flags need it are read as sequences. A row that ran
        drafts has a logits row per position: each is drawn as without speculation, and the
        drafts those draws confirm are accepted (speculative/verify.py)."""
        batch, rows, counts = self.batch, inputs.sample_rows, inputs.sample_counts
        entries = inputs.sample_entries
        # Each logits row's batch row and its position past the row's newest token.
        spec = bool(len(counts)) and int(counts.max()) > 1
        at_rows, offsets = rows, np.zeros(len(rows), dtype=np.int64)
        if spec:
            at_rows = np.repeat(rows, counts)
            offsets = np.arange(len(at_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        beams: list[BeamOutcome] = []
        beam = batch.beam[at_rows]
        if beam.any():  # the beams' rows (one logits row each) go to their searches
            beams, keep, logits = self._advance_beams(at_rows, logits, beam)
            at_rows, offsets = at_rows[keep], offsets[keep]
            own = ~batch.beam[rows]
            rows, counts, entries = rows[own], counts[own], entries[own]
            if not len(rows):
                return StepResult.nothing(beams=beams, prompt_logprobs=prompt_logprobs)
        seeds = batch.seed[at_rows]
        fork_parents, fork_indices = self._pending_forks(at_rows)
        sampled_rows = at_rows
        if fork_indices:  # forking rows run no drafts: one logits row each
            at = np.concatenate([np.arange(len(at_rows)), fork_parents])
            sampled_rows = at_rows[at]
            offsets = np.concatenate([offsets, np.zeros(len(fork_parents), dtype=np.int64)])
            seeds = np.concatenate([seeds, self._fork_seeds(at_rows[fork_parents], fork_indices)])
            logits = logits.index_select(0, torch.from_numpy(at).to(logits.device))
        forced = self._forced_tokens(sampled_rows)
        if not forced and batch.plain_greedy[sampled_rows].all():
            sampled = sample_greedy(logits, self.argmax)
        else:
            sampled = self._sample_rows(sampled_rows, seeds, offsets, logits, forced)
        tokens, n = np.asarray(sampled.token_ids, dtype=np.int64), len(at_rows)
        wants = bool((batch.sampling.logprobs[sampled_rows] >= 0).any())
        logprobs = sampled.logprobs if wants else None
        forks = None
        if fork_indices:
            forks = Forks(
                parents=at_rows[fork_parents],
                indices=fork_indices,
                tokens=tokens[n:],
                logprobs=None if logprobs is None else logprobs[n:],
            )
        if not spec:
            return StepResult.one_each(
                rows,
                tokens[:n],
                logprobs=None if logprobs is None else [[lp] for lp in logprobs[:n]],
                forks=forks,
                beams=beams,
                prompt_logprobs=prompt_logprobs,
            )
        return self._verify(inputs, rows, counts, entries, tokens[:n], logprobs, beams, forks,
                            prompt_logprobs)  # fmt: skip

    def _verify(
        self,
        inputs: StepInputs,
        rows: np.ndarray,
        counts: np.ndarray,
        entries: np.ndarray,
        targets: np.ndarray,
        logprobs: list[TopLogprobs | None] | None,
        beams: list[BeamOutcome],
        forks: Forks | None,
        prompt_logprobs: list[tuple[Sequence, list[TopLogprobs]]],
    ) -> StepResult:
        """Rows that ran drafts keep those their target tokens confirm, then the target token
        after them; the computed count of the others is given back at the commit."""
        k = int(counts.max())
        starts = np.cumsum(counts) - counts
        grid = np.zeros((len(rows), k), dtype=np.int64)
        within = np.arange(k) < counts[:, None]
        grid[within] = targets
        accepted = accepted_counts(grid, self.batch.drafts[rows, : k - 1], counts)
        rejected = np.zeros(len(inputs.rows), dtype=np.int64)
        rejected[entries] = counts - 1 - accepted
        taken = accepted + 1
        row_logprobs = None
        if logprobs is not None:
            row_logprobs = [
                logprobs[a : a + t] for a, t in zip(starts.tolist(), taken.tolist(), strict=True)
            ]
        self.stats.draft_tokens += int((counts - 1).sum())
        self.stats.accepted_draft_tokens += int(accepted.sum())
        return StepResult(rows, grid, taken, row_logprobs, rejected, forks, beams,
                          prompt_logprobs=prompt_logprobs)  # fmt: skip

    def _pending_forks(self, rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The samples to fork now, from parents whose prompt is computed: each one's parent
        (an index into rows) and sample index."""
        batch = self.batch
        parents: list[int] = []
        indices: list[int] = []
        for i in np.flatnonzero(batch.forking[rows]).tolist():
            forks = batch.seq_at(int(rows[i])).feature(PendingForks)
            assert forks is not None, "a forking row's sequence has forks pending"
            for index in forks.indices:
                parents.append(i)
                indices.append(index)
        return np.array(parents, dtype=np.int64), indices

    def _fork_seeds(self, parent_rows: np.ndarray, indices: list[int]) -> np.ndarray:
        """The draw seeds of samples to fork: each the seed its sequence will have."""
        seqs = self.batch.seqs(parent_rows)
        seeds = [
            sequence_seed(s.params.seed, self.factory.seed, s.request.index, index)
            for s, index in zip(seqs, indices, strict=True)
        ]
        return np.array(seeds, dtype=np.int64)

    def _advance_beams(
        self, rows: np.ndarray, logits: torch.Tensor, beam: np.ndarray
    ) -> tuple[list[BeamOutcome], np.ndarray, torch.Tensor]:
        """One step of every beam search in the step (beam_steps.py); returns their outcomes,
        the mask of the other logits rows, which sample, and their logits."""
        at = torch.from_numpy(np.flatnonzero(beam)).to(logits.device)
        beams = self.batch.seqs(rows[beam])
        outcomes = self.beams.advance(beams, logits.index_select(0, at))
        keep = ~beam
        at = torch.from_numpy(np.flatnonzero(keep)).to(logits.device)
        return outcomes, keep, logits.index_select(0, at)

    def _forced_tokens(self, rows: np.ndarray) -> dict[int, int]:
        """Row -> the token it must take: the end of thinking of rows past their budget."""
        if self.reasoning is None:
            return {}
        forced = {}
        for row, seq in enumerate(self.batch.seqs(rows)):
            thinking = seq.feature(ThinkingTracker)
            if thinking is not None and (token := thinking.forced_token) is not None:
                forced[row] = token
        return forced

    def _sample_rows(
        self,
        rows: np.ndarray,
        seeds: np.ndarray,
        offsets: np.ndarray,
        logits: torch.Tensor,
        forced: dict[int, int],
    ) -> SamplerOutput:
        """Sample the batch rows `rows` (logits in their order; a row appears again for a
        sample it forks, with that sample's seed, and for each draft it ran, `offsets` past its
        newest token), not all plain greedy: settings from the batch's columns, draw keys from
        `seeds` and the position; sequences are read only for the rows that carry lists
        (penalties' token histories, grammars and their thinking; of those, only grammar rows
        run drafts, each position masked by the grammar after the drafts before it). Grammars
        take the tokens at the commit."""
        batch, n = self.batch, len(rows)
        params = batch.sampling.take(rows)
        keys = draw_keys(seeds, batch.num_tokens[rows] + offsets)
        processed = np.flatnonzero(params.processed).tolist()
        penalties = None
        if processed:
            seqs = batch.seqs(rows[processed])
            penalties = Penalties(
                processed,
                [s.params for s in seqs],
                [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                [s.output_token_ids for s in seqs],
                [self.eos_ids] * len(seqs),
            )
        constrained = np.flatnonzero(batch.constrained[rows]).tolist()
        token_mask = None
        if constrained:
            constraints: list[Constraint | None] = [None] * n
            thinking: dict[int, ThinkingTracker] = {}
            for i, seq in zip(constrained, batch.seqs(rows[constrained]), strict=True):
                tracker = seq.feature(ThinkingTracker)
                if tracker is not None:
                    thinking[i] = tracker
                constraints[i] = _active_constraint(seq, tracker)
            drafted: list[np.ndarray] | None = None
            if offsets[constrained].any():  # a grammar row's drafts before each of its positions
                drafted = [batch.drafts[0, :0]] * n
                for i in constrained:
                    drafted[i] = batch.drafts[rows[i], : offsets[i]]
            token_mask = self.masks.fill(constraints, drafted)
            if token_mask is not None and self.reasoning is not None:
                before = [i for i in token_mask.rows if (t := thinking.get(i)) and t.may_open]
                allow_start_marker(token_mask, before, self.reasoning.start_id)
        if forced:
            token_mask = force_tokens(token_mask, forced, n, self.masks.vocab_size)
        return sample(logits, params, keys, penalties, token_mask, self.argmax, self.race)


def _score_prompts(
    inputs: StepInputs, logits: torch.Tensor
) -> list[tuple[Sequence, list[TopLogprobs]]]:
    """The prompt logprobs the step scored: each sequence's, in prompt order."""
    targets = torch.tensor(inputs.prompt_targets)
    wanted = [s.params.prompt_logprobs for s, n in inputs.prompt_owners for _ in range(n)]
    scored = compute_logprobs(logits, targets, wanted)
    out, row = [], 0
    for seq, n in inputs.prompt_owners:
        out.append((seq, scored[row : row + n]))
        row += n
    return out


def _pool_total(seq: Sequence) -> torch.Tensor | None:
    pool_sum = seq.feature(PoolSum)
    return None if pool_sum is None else pool_sum.total


def _active_constraint(seq: Sequence, thinking: ThinkingTracker | None) -> Constraint | None:
    """The constraint that masks seq's next token: none while it thinks."""
    if thinking is not None and not thinking.answer_may_start:
        return None
    return seq.feature(Constraint)


def _token_ids(tokenizer: Tokenizer, tokens: list[str]) -> list[int]:
    """Each text's token id; ValueError naming a text that is not exactly one token."""
    ids = [tokenizer.single_token_id(t) for t in tokens]
    bad = [t for t, i in zip(tokens, ids, strict=True) if i is None]
    if bad:
        raise ValueError(
            f"classifier_from_token: {bad} are not single tokens of this model's vocabulary: "
            "give tokens as the tokenizer spells them"
        )
    return [i for i in ids if i is not None]
