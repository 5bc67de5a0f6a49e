"""The lm-evaluation-harness backend: ``import batchpage.lm_eval`` registers the model "batchpage".

    lm_eval.simple_evaluate(model="batchpage", model_args="pretrained=smollm2,dtype=float32", ...)
    python -m batchpage.lm_eval --model batchpage --model_args pretrained=smollm2 --tasks ...

``pretrained`` is what ``LLM(model=...)`` takes; every other model_arg is an ``LLM(...)`` argument,
besides the few lm-eval knobs in ``BatchpageLM.__init__``. All requests of one type go to the
engine as one batch, so its scheduler orders them by shared prefix and batches continuously.

Text becomes tokens exactly as in lm-eval's hf backend (lm-eval's TemplateLM splits context and
continuation; ``tok_encode`` adds special tokens the same way), so both score the same tokens.
Its truncation rules are hf's too, with ``max_length`` (the longest input hf would run) set to
``max_model_len - 2``: a scored window of ``max_length + 1`` tokens goes in as a prompt, and the
engine keeps one position free for the token it must generate after any prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import jinja2
import torch

from batchpage.engine.config import EngineConfig
from batchpage.llm import LLM
from batchpage.request_outputs import RequestOutput
from batchpage.sampling_params import SamplingParams

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        _add_special_kwargs,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] != "lm_eval":
        raise  # lm_eval is there but broken: its own error says more
    raise ModuleNotFoundError(
        "batchpage.lm_eval needs lm-evaluation-harness: pip install 'batchpage[lm_eval]'",
        name="lm_eval",  # what is missing, for the console script (cli.py)
    ) from exc

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

logger = logging.getLogger(__name__)

# A (cache key, context tokens, continuation tokens) triple, as TemplateLM hands them over.
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model("batchpage")
class BatchpageLM(TemplateLM):
    def __init__(
        self,
        pretrained: str = "smollm2",
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        chat_template_args: dict[str, Any] | None = None,
        # lm-eval's end-of-thinking delimiter: a completion is scored on its text after the
        # last one, and `until` strings cut only that text. Without it, reasoning_parser (an LLM
        # argument) gives the engine's answer alone, with `until` applied to the answer.
        think_end_token: str | None = None,
        # What lm-eval passes to every backend. The engine batches continuously (bounded by
        # max_num_seqs), so lm-eval's batch sizes have nothing to set.
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        **llm_args: Any,
    ) -> None:
        super().__init__()
        engine_device = _engine_device(device)
        llm_args = _from_vllm_args(llm_args, engine_device)
        # `device` never lands in llm_args: lm-eval's own --device arrives by the same name.
        known = sorted(f.name for f in dataclasses.fields(EngineConfig) if f.name != "device")
        unknown = sorted(set(llm_args) - set(known))
        if unknown:
            raise TypeError(
                f"unknown batchpage model_args {unknown}: use LLM(...) arguments {known}, "
                "device, the backend's own pretrained, max_gen_toks, add_bos_token, "
                "prefix_token_id, chat_template_args, think_end_token, or vLLM's "
                f"{sorted([*VLLM_RENAMED, *VLLM_IGNORED, 'gpu_memory_utilization'])}"
            )
        if engine_device is not None:
            llm_args["device"] = engine_device
        self.llm = LLM(model=str(pretrained), **llm_args)
        self.tokenizer = self.llm.get_tokenizer().hf  # the transformers tokenizer, as hf's
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.chat_template_args = chat_template_args or {}
        self._max_gen_toks = int(max_gen_toks)
        self.think_end_token = think_end_token or None

    # -- what lm-eval reads ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and each rolling window's start) is conditioned on."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.llm.max_model_len - 2

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        # A chat-templated prompt already starts with BOS: adding another would shift every score.
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        def render(messages: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                **self.chat_template_args,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            # Some templates refuse a system role; lm-eval's backends then drop that message.
            logger.warning("the chat template failed; retrying without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    # -- the three request types -------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding would produce it), from
        the engine's prompt logprobs of context + continuation, left-truncated as hf does."""
        windows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens cannot be scored within "
                    f"max_length={self.max_length}: raise max_model_len"
                )
            windows.append((context + continuation)[-(self.max_length + 1) :])
        # The top-1 alternative next to the chosen token tells whether the choice was greedy.
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outputs = self._generate(windows, params, disable_tqdm)
        results = []
        for (key, _, continuation), window, out in zip(requests, windows, outputs, strict=True):
            answer = _score_tail(out, window, len(continuation))
            if key is not None:  # rolling windows are cached per document instead
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Each text's logprob over lm-eval's disjoint windows of at most max_length tokens,
        every window of every text scored in one batch."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for index, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, target in map(make_disjoint_window, rolling):
                windows.append((None, context, target))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True
        ):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled completions cut at the first `until` string, all in one batch."""
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            sampling, until = self._sampling_params(gen_kwargs, eos)
            assert sampling.max_tokens is not None
            # hf keeps the last max_length - max_gen_toks context tokens.
            keep = self.max_length - sampling.max_tokens
            tokens = self.tok_encode(context)
            if len(tokens) > keep:
                logger.warning("context of %d tokens truncated to its last %d", len(tokens), keep)
            prompts.append(tokens[-keep:])
            params.append(sampling)
            stops.append(until)
        outputs = self._generate(prompts, params, disable_tqdm)
        texts = []
        for req, out, until in zip(requests, outputs, stops, strict=True):
            text = postprocess_generated_text(out.outputs[0].text, until, self.think_end_token)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    # -- helpers -----------------------------------------------------------------------------------

    def _sampling_params(
        self, gen_kwargs: dict[str, Any], eos: str
    ) -> tuple[SamplingParams, list[str]]:
        """lm-eval's generation kwargs as SamplingParams, and the stop strings (with EOS)."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"max_gen_toks={max_gen_toks} leaves no room for a context within "
                f"max_length={self.max_length}: lower max_gen_toks or raise max_model_len"
            )
        # do_sample without a temperature: SamplingParams' default of 1, as in lm-eval's vllm.
        temperature = float(kwargs.pop("temperature", 1.0))
        if not kwargs.pop("do_sample"):
            temperature = 0.0
        settable = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens", "stop"}
        unknown = sorted(set(kwargs) - settable)
        if unknown:
            raise ValueError(
                f"generation kwargs {unknown} have no batchpage counterpart: use until, "
                f"max_gen_toks, do_sample or SamplingParams fields {sorted(settable)}"
            )
        # An empty stop string would end every completion at once; with think_end_token the
        # thinking is in the text, so stop strings apply after generation, to the answer only.
        stop = [s for s in until if s] if self.think_end_token is None else []
        sampling = SamplingParams(
            max_tokens=max_gen_toks, stop=stop, temperature=temperature, **kwargs
        )
        return sampling, until

    def _generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        disable_tqdm: bool,
    ) -> list[RequestOutput]:
        if not prompts:
            return []
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        for out in outputs:
            if out.error is not None:
                # A score missing from an eval would bias it silently: stop instead.
                raise RuntimeError(f"batchpage refused an lm-eval request: {out.error}")
        return outputs


def _score_tail(out: RequestOutput, tokens: list[int], count: int) -> tuple[float, bool]:
    """Sum of the logprobs of the last `count` prompt tokens, and whether each was the argmax.
    prompt_logprobs[i] maps the chosen token tokens[i] and the top-1 token to their logprobs."""
    assert out.prompt_logprobs is not None
    total, greedy = 0.0, True
    for token, dist in zip(tokens[-count:], out.prompt_logprobs[-count:], strict=True):
        assert dist is not None  # only position 0 has no logprob, and it is never scored
        total += dist[token]
        greedy = greedy and dist[token] >= max(dist.values())
    return total, greedy


# lm-eval's vLLM model_args that mean an LLM argument here, and those with no meaning here.
VLLM_RENAMED = {"max_length": "max_model_len", "enable_prefix_caching": "prefix_caching"}
VLLM_IGNORED = {
    "trust_remote_code": "no checkpoint code runs here: the families are batchpage's own",
    "swap_space": "preemption_mode=swap sizes its host copies per sequence",
    "tokenizer_mode": "the checkpoint's own tokenizer is used",
    "revision": "models are local folders or files",
}


def _from_vllm_args(args: dict[str, Any], device: str | None) -> dict[str, Any]:
    """model_args pasted from lm-eval's vLLM backend as LLM arguments: renamed where they mean
    one (gpu_memory_utilization: on a GPU the KV pool's share of the memory left after the
    weights, the nearest budget batchpage has; ignored on a CPU, where that share of the host's
    memory would be the pool), dropped with a warning where they mean nothing here."""
    args = dict(args)
    for theirs, ours in VLLM_RENAMED.items():
        if theirs in args:
            if ours in args:
                raise TypeError(f"model_args give both {theirs} and {ours}: give {ours}")
            args[ours] = args.pop(theirs)
    for name, why in VLLM_IGNORED.items():
        if name in args:
            logger.warning("model_args %s=%r ignored: %s", name, args.pop(name), why)
    if "gpu_memory_utilization" in args:
        share = args.pop("gpu_memory_utilization")
        on_gpu = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
        if on_gpu and "kv_cache_memory" not in args:
            args["kv_cache_memory"] = float(share)
        else:
            logger.warning(
                "model_args gpu_memory_utilization=%r ignored: on a CPU (or with "
                "kv_cache_memory) kv_cache_memory sets the KV pool",
                share,
            )
    return args


def _engine_device(device: str | None) -> str | None:
    """lm-eval's --device (its CLI default is cuda:0) as an LLM device. Like lm-eval's hf
    backend, a CUDA device this machine lacks falls back to what it has."""
    if device is None:
        return None
    if device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %r is not available here; batchpage picks the device", device)
        return None
    return device


def main() -> None:
    """lm-eval's command line, with "batchpage" registered (by importing this module)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
