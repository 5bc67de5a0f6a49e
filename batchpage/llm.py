"""LLM: the offline Python API (vLLM's shape): LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from batchpage.chat_messages import normalize_messages
from batchpage.distributed.workers import TensorParallelWorkers
from batchpage.engine.beam_group import worst_case_blocks
from batchpage.engine.config import EngineConfig
from batchpage.engine.engine import BEAM_SEARCH_WITH_CONSTRAINT, Engine
from batchpage.engine.plan import plan_engine
from batchpage.engine.reasoning import reasoning_text
from batchpage.engine.sampler import TopLogprobs
from batchpage.engine.sequence import Request, Sequence
from batchpage.host_memory import older_objects_frozen
from batchpage.llm_pooling import PoolingMethods
from batchpage.lora.request import LoRARequest
from batchpage.metrics import RunStats, tokens_per_s
from batchpage.model.image_prompt import ImagePrompts, PromptImage
from batchpage.model.loader import load_model, resolve_model_source
from batchpage.model.tokenizer import check_chat_template_kwargs, resolve_chat_template
from batchpage.prompt_images import (
    MULTI_MODAL_KEYS,
    PromptImageReader,
    multi_modal_sources,
    multi_modal_uuids,
)
from batchpage.prompt_list import PromptType, as_prompt_list, is_token_id
from batchpage.request_outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
)
from batchpage.sampling_params import BeamSearchParams, SamplingParams

OnOutput = Callable[[RequestOutput, int], None]  # (a finished request's output, its index)
OnStep = Callable[[RunStats], None]  # after each engine step: the call's figures so far
# One adapter for every prompt, or one (or None: the base model) per prompt.
LoRAArg = LoRARequest | Seq[LoRARequest | None] | None


class LLM(PoolingMethods):
    def __init__(self, model: str = "smollm2", **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"unknown LLM argument(s) {sorted(unknown)}; "
                f"known: {sorted(EngineConfig.__dataclass_fields__)}"
            )
        self.config = cfg = EngineConfig(**engine_args)
        # Everything that can be wrong is checked from the config alone, before weights load.
        source = resolve_model_source(model)
        self.chat_template = resolve_chat_template(cfg.chat_template)  # None: the model's own
        self.plan = plan = plan_engine(cfg, source)
        self.max_model_len = plan.max_model_len
        # Tensor-parallel workers load their shares while this process loads rank 0's.
        peers = None
        if cfg.tensor_parallel_size > 1:
            peers = TensorParallelWorkers.start(source, cfg, plan)
        try:
            loaded = load_model(
                source,
                plan.dtype,
                plan.device,
                max_positions=plan.max_model_len,
                int8_activations=cfg.int8_activations,
                shard=None if peers is None else peers.shard,
            )
            if peers is not None:
                peers.join(plan.device)
            self.engine = Engine(loaded.model, loaded.tokenizer, loaded.config, cfg, plan, peers)
        except BaseException:
            if peers is not None:
                peers.close()
            raise
        self.model_config = loaded.config
        # A vision-language model's image processor and placeholder rule (None: a text model).
        image_prompts = None
        if loaded.config.vision is not None:
            image_prompts = ImagePrompts.from_model(
                loaded.source.path, loaded.config, loaded.tokenizer
            )
        self.images = PromptImageReader(image_prompts, cfg.image_limits())
        self.source = loaded.source  # the checkpoint (its headers' counts; LLM.estimate)
        self.tokenizer = loaded.tokenizer
        self.workers = peers  # ranks 1.. of a tensor-parallel engine
        # The last generate() call's figures: `stats` as a dict (vLLM-style), `run_stats` as
        # the RunStats that several calls can be merged from.
        self.run_stats = RunStats(plan.num_blocks, cfg.block_size)
        self.stats: dict[str, Any] = {}

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def estimate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        devices: Seq[str] = ("this",),
        output_tokens: str | int = "max",
        simulated_rows: int = 8192,
    ) -> dict[str, Any]:
        """What generate(prompts, sampling_params) would take, before running it (the dry run's
        capacity plan, batchpage/simulate): the KV pool and peak memory, the preemptions, and
        the wall time in parts on each of `devices` ("this": this engine, its step cost
        measured by a few seconds of calibration steps the first time, cached; "h100",
        "a100-80gb", "h200", "l4", "name:tpN", or a device file). output_tokens: "max" (every
        prompt to its max_tokens), a number of tokens, or "sample:N" (N prompts generated for
        real to learn the lengths); max_tokens is always the bound. A call of more than
        simulated_rows prompts is simulated on a sample of them and scaled. (`plan` is the
        engine's plan, an attribute, hence the name.)"""
        from batchpage.simulate.llm_estimate import estimate_requests

        self._require_generation()
        started = time.perf_counter()
        items = as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(items))
        pairs = enumerate(zip(items, params, strict=True))
        requests = [self._make_request(i, p, sp) for i, (p, sp) in pairs]  # as generate()'s
        io_s = time.perf_counter() - started
        return estimate_requests(self, requests, devices, output_tokens, simulated_rows, io_s)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_output: OnOutput | None = None,
        on_step: OnStep | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. A bad prompt gets an output with `error` set
        and no completion; the others still run. `on_output(output, index)` is called as each
        request finishes (in completion order), so a caller can save results while the batch
        still runs; `on_step(stats)` after every engine step, so it can show progress.
        `lora_request`: the LoRA adapter of every prompt, or a list with one per prompt (None
        for the base model); needs enable_lora=True. A bad adapter is its requests' error."""
        self._require_generation()
        items = as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(items))
        loras = self._per_prompt_lora(lora_request, len(items))
        triples = enumerate(zip(items, params, loras, strict=True))
        requests = [self._make_request(i, p, sp, lora) for i, (p, sp, lora) in triples]
        return self._run(requests, use_tqdm, on_output, on_step)

    def beam_search(
        self,
        prompts: PromptType | Seq[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRAArg = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam-search call: for each prompt its params.beam_width beams, best first,
        each the prompt's tokens then the beam's. The same search as generate() with
        SamplingParams(use_beam_search=True); a bad prompt's output has `error` and no beams."""
        sampling = params.to_sampling_params()
        outs = self.generate(prompts, sampling, use_tqdm=use_tqdm, lora_request=lora_request)
        decode = self.tokenizer.decoder(skip_special_tokens=False)
        results = []
        for out in outs:
            beams = []
            for c in sorted(out.outputs, key=lambda c: c.index):  # index 0 is the best
                tokens = [*out.prompt_token_ids, *c.token_ids]
                assert c.cumulative_logprob is not None
                beams.append(
                    BeamSearchSequence(
                        tokens, decode(tokens), c.cumulative_logprob, c.finish_reason
                    )
                )
            results.append(BeamSearchOutput(beams, out.error))
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        on_output: OnOutput | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Applies the chat template to each conversation, then generates. chat_template (a
        .jinja file or the template text) replaces the model's (or LLM(chat_template=...)) for
        this call; chat_template_kwargs are variables of the template, e.g.
        {"enable_thinking": False}. Message content may be a list of OpenAI text parts; a bad
        message (an unknown role, a non-text part) fails its own request only."""
        self._require_generation()
        template = resolve_chat_template(chat_template) or self.chat_template
        check_chat_template_kwargs(chat_template_kwargs or {})
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = _per_prompt(sampling_params, len(conversations))
        loras = self._per_prompt_lora(lora_request, len(conversations))
        requests = []
        for i, (conv, sp, lora) in enumerate(zip(conversations, params, loras, strict=True)):
            images: list[Any] = []
            try:  # a vision model's image parts are collected, in order
                turns = normalize_messages(conv, images if self.images.prompts else None)
            except ValueError as exc:
                requests.append(Request(i, None, [], sp, error=f"bad messages: {exc}"))
                continue
            try:
                ids = self.tokenizer.apply_chat_template(
                    turns,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=template,
                    chat_template_kwargs=chat_template_kwargs,
                )
            except Exception as exc:  # a template can fail on one odd chat: only its request
                requests.append(Request(i, None, [], sp, error=f"chat template failed: {exc}"))
                continue
            requests.append(self._make_request(i, ids, sp, lora, images))
        return self._run(requests, use_tqdm, on_output)

    def _require_generation(self) -> None:
        task = self.engine.task
        if task != "generate":
            method = "embed" if task == "embed" else task
            raise ValueError(
                f"this model runs task={task}, which generates nothing: use LLM.{method}(), or "
                "load a causal LM (task=generate)"
            )

    def _per_prompt_lora(self, lora: LoRAArg, count: int) -> list[LoRARequest | None]:
        """Each prompt's adapter; ValueError when adapters are asked of an engine without
        enable_lora, or a list's length is not the prompts'."""
        loras = [lora] * count if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != count:
            raise ValueError(
                f"got {len(loras)} lora_requests for {count} prompts: pass one, or one per prompt"
            )
        bad = [x for x in loras if x is not None and not isinstance(x, LoRARequest)]
        if bad:
            raise TypeError(f"lora_request must be LoRARequest or None; got {type(bad[0])}")
        if not self.config.enable_lora and any(x is not None for x in loras):
            raise ValueError(
                "a lora_request needs an engine made with enable_lora=True (and max_loras, "
                "max_lora_rank as the adapters need)"
            )
        return loras

    def _make_request(
        self,
        index: int,
        prompt: Any,
        params: SamplingParams,
        lora: LoRARequest | None = None,
        images: list[Any] | None = None,
    ) -> Request:
        """The request of one prompt (text, token ids or a prompt dict) and its `images` (a
        chat's image parts), or one whose `error` says what is wrong with them."""
        images = list(images or ())
        uuids = None
        if isinstance(prompt, dict):
            prompt, own, uuids, error = _unwrap_prompt(prompt)
            if error is not None:
                return Request(index, None, [], params, error=error)
            images += own
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, list | tuple) and all(is_token_id(t) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list | tuple):
            kind = next(type(t).__name__ for t in prompt if not is_token_id(t))
            return Request(
                index, None, [], params, error=f"prompt token ids must be ints, got a {kind}"
            )
        else:
            kind = type(prompt).__name__
            return Request(
                index, None, [], params, error=f"prompt must be text or token ids, got {kind}"
            )
        error = None
        vocab = self.model_config.vocab_size
        placed: tuple[PromptImage, ...] = ()
        try:
            ids, placed = self.images.place(ids, images, uuids)
        except ValueError as exc:
            return Request(index, text, [], params, error=str(exc))
        if not ids:
            error = "prompt is empty: give at least one token of text"
        elif len(ids) >= self.max_model_len:
            error = (
                f"prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}: shorten the "
                "prompt or raise max_model_len (a completion needs at least one more position)"
            )
        elif any(t < 0 or t >= vocab for t in ids):
            error = f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}"
        else:
            error = self._check_params(params, len(ids))
        grammar = None
        if error is None and params.structured_outputs is not None:
            try:  # compiled once per distinct constraint; a bad one fails this request only
                grammar = self.engine.grammars.compile(params.structured_outputs)
            except ValueError as exc:
                error = str(exc)
        if error is None and lora is not None:
            assert self.engine.adapters is not None
            error = self.engine.adapters.check(lora)
        return Request(
            index, text, ids, params, error=error, grammar=grammar, lora=lora, images=placed
        )

    def _check_params(self, params: SamplingParams, prompt_len: int) -> str | None:
        """What the engine's limits rule out for these params; None when they fit."""
        try:
            params.verify_vocab(self.model_config.vocab_size)
        except ValueError as exc:
            return str(exc)
        if params.use_beam_search and params.structured_outputs is not None:
            return BEAM_SEARCH_WITH_CONSTRAINT
        if params.thinking_token_budget is not None and self.engine.reasoning is None:
            return (
                "thinking_token_budget needs a reasoning parser: set reasoning_parser (auto, "
                "qwen3, deepseek_r1, mistral) to that of a model whose vocabulary has the markers"
            )
        max_seqs = self.config.max_num_seqs
        width = params.effective_beam_width if params.use_beam_search else params.n
        if width > max_seqs:
            return f"n / beam_width {width} exceeds max_num_seqs={max_seqs}: raise max_num_seqs"
        if params.use_beam_search and width > self.engine.scheduler.max_num_batched_tokens:
            return (
                f"beam_width {width} exceeds max_num_batched_tokens="
                f"{self.engine.scheduler.max_num_batched_tokens}: a step runs every beam of a "
                "search; raise max_num_batched_tokens"
            )
        if params.use_beam_search:
            need = worst_case_blocks(params, prompt_len, self.max_model_len, self.config.block_size)
            if need > self.plan.num_blocks:
                return (
                    f"beam search with beam_width {width} may need {need} KV blocks, the pool "
                    f"has {self.plan.num_blocks}: raise kv_cache_memory or lower "
                    "max_tokens or beam_width"
                )
        return None

    def _run(
        self,
        requests: list[Request],
        use_tqdm: bool,
        on_output: OnOutput | None,
        on_step: OnStep | None = None,
        make_output: Callable[[Request, list[Sequence]], Any] | None = None,
    ) -> list[Any]:
        """Runs the requests; each output is `make_output(request, its sequences)` (default:
        a RequestOutput)."""
        make = make_output or _request_output
        bar = tqdm(total=len(requests), desc="requests", disable=not use_tqdm, dynamic_ncols=True)
        done: dict[int, list[Sequence]] = {r.index: [] for r in requests if r.error is None}
        for r in requests:
            if r.error is not None:
                bar.update(1)
                if on_output is not None:
                    on_output(make(r, []), r.index)
        engine = self.engine
        with older_objects_frozen():  # see host_memory.py
            stats = engine.add_requests(requests)
            try:
                while engine.has_unfinished():
                    for seq in engine.step():
                        seqs = done[seq.request.index]
                        seqs.append(seq)
                        if len(seqs) < seq.params.n:
                            continue
                        bar.update(1)
                        if use_tqdm:  # a hidden bar's text would be formatted for nothing
                            rate = tokens_per_s(stats.generated_tokens, stats.elapsed_s)
                            hit = f"{stats.prefix_hit_rate:.0%}"
                            bar.set_postfix(tok_s=f"{rate:.1f}", hit=hit, refresh=False)
                        if on_output is not None:
                            on_output(make(seq.request, seqs), seq.request.index)
                    if on_step is not None:
                        on_step(stats)
            finally:
                bar.close()
            outputs = [make(r, done.get(r.index, [])) for r in requests]
        stats.finish()
        self.run_stats = stats
        self.stats = stats.as_dict()
        return outputs


def _unwrap_prompt(prompt: dict[str, Any]) -> tuple[Any, list[Any], list | None, str | None]:
    """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids}, either with
    "multi_modal_data": {"image": ...} (and "multi_modal_uuids"): (the text or ids, the images,
    their uuids or None, None), or (None, [], None, why the dict is not one)."""
    keys = set(prompt) - set(MULTI_MODAL_KEYS)
    if keys not in ({"prompt"}, {"prompt_token_ids"}):
        why = (
            'a prompt dict must hold exactly one of "prompt" (text) or "prompt_token_ids" (token '
            f"ids), and may hold {' and '.join(MULTI_MODAL_KEYS)}; got keys "
            f"{sorted(map(str, prompt))}"
        )
        return None, [], None, why
    try:
        images = multi_modal_sources(prompt)
        uuids = multi_modal_uuids(prompt, len(images))
    except ValueError as exc:
        return None, [], None, str(exc)
    return prompt[keys.pop()], images, uuids, None


def _per_prompt(
    params: SamplingParams | Seq[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"got {len(params)} SamplingParams for {count} prompts: pass one, or one per prompt"
        )
    return params


def _request_output(req: Request, seqs: list[Sequence]) -> RequestOutput:
    out = RequestOutput(
        request_id=str(req.index),
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        error=req.error,
        num_cached_tokens=max((s.num_cached_tokens for s in seqs), default=0),
    )
    first = min(seqs, key=lambda s: s.sample_index, default=None)
    if first is not None and first.result.prompt_logprobs is not None:
        out.prompt_logprobs = [
            None if lp is None else _logprob_dict(lp) for lp in first.result.prompt_logprobs
        ]
    for seq in sorted(seqs, key=lambda s: s.sample_index):
        result = seq.result
        out.outputs.append(
            CompletionOutput(
                index=seq.sample_index,
                text=result.text,
                token_ids=seq.output_token_ids,
                finish_reason=result.finish_reason,
                stop_reason=result.stop_reason,
                logprobs=[_logprob_dict(lp) for lp in result.logprobs] if result.logprobs else None,
                reasoning=reasoning_text(seq),
                cumulative_logprob=result.cumulative_logprob,
            )
        )
    return out


def _logprob_dict(lp: TopLogprobs) -> dict[int, float]:
    """vLLM's per-token shape: the chosen token and the top-k, token id -> logprob."""
    return {lp.token_id: lp.logprob, **dict(zip(lp.top_ids, lp.top_logprobs, strict=True))}
