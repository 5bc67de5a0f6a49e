"""From rows to prompts: each row's token ids and SamplingParams, or the reason it failed.

How a row is posed (PromptPlan, settled by plan_job before the model loads):
- a `messages` chat goes through the model's chat template;
- a code-completion prompt set (the evals preset) in the instruct style becomes one user turn
  that asks for the function (the code is taken from the reply afterwards); in the completion
  style it is sent as raw text, its stop strings being in the job's SamplingParams already;
- a plain prompt goes through the chat template as a user turn when dataset.chat_template=true
  or a system_prompt is set, and is sent as raw text otherwise.
Prompts are tokenized here, so the job knows every row's cost before it is generated. The text
that reaches the tokenizer is bounded by dataset.max_prompt_bytes (the chat template renders
within that many characters, its work and time bounded too: batchpage.model.chat_render); a
row past a bound is that row's error.

A row with images (an image column, a chat's image parts) for a vision-language model: posed as
a chat without image parts (a prompt through the template, or a messages chat that holds none),
its images go as {"type": "image"} parts before the text of its first user turn, where the
template writes the family's placeholder; a raw-text prompt holds its placeholders itself. Its
images are decoded here (job.row_images: bounded, a bad one is the row's error) and go to the
engine with its token ids, which expands each placeholder.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from batchpage.data.images import ImageLimits
from batchpage.data.readers import DEFAULT_MAX_PROMPT_BYTES
from batchpage.data.rows import Row, prompt_size_error
from batchpage.job.row_images import WindowImages
from batchpage.lora.request import LoRARequest
from batchpage.model.render_budget import RenderLimits, TemplateLimitError
from batchpage.model.tokenizer import Tokenizer
from batchpage.output.batch_files import logprobs_json
from batchpage.output.files import ResultRow
from batchpage.request_outputs import RequestOutput
from batchpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from PIL import Image

    from batchpage.job.adapters import JobAdapters


@dataclass(frozen=True)
class PromptPlan:
    chat_template: str = "auto"  # auto | true | false (dataset.chat_template)
    instruct: str | None = None  # the user turn around {prompt}, in the instruct style
    template: str | None = None  # engine.chat_template's text; None: the model's own
    template_kwargs: dict[str, Any] | None = None  # dataset.chat_template_kwargs
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # dataset.max_prompt_bytes
    # How rows' images are read (the dataset.*image* options); None: the job takes none (a
    # text model, a pooling job, executor=ray), and a row with images is its error.
    image_limits: ImageLimits | None = None

    @property
    def limits(self) -> RenderLimits:
        return RenderLimits(max_chars=self.max_prompt_bytes)


class Prepared(NamedTuple):
    row: Row
    prompt_ids: list[int]  # with `inputs`: theirs end to end (what the row costs)
    text: str  # what the output's prompt column holds (the rendered chat for chats)
    params: SamplingParams
    # An embeddings line's inputs (Row.inputs), each as token ids; None: one prompt.
    inputs: list[list[int]] | None = None
    lora: LoRARequest | None = None  # the row's adapter (dataset.lora_column); None: the base
    # Its images, decoded (job.row_images), one per placeholder token in prompt_ids, in order.
    images: tuple[Image.Image, ...] = ()

    @property
    def prompts(self) -> list[list[int]]:
        """What the engine runs for this row: its inputs, or its one prompt."""
        return self.inputs if self.inputs is not None else [self.prompt_ids]

    @property
    def engine_prompt(self) -> list[int] | dict[str, Any]:
        """What LLM.generate takes for this row: its token ids, with its images as vLLM's
        multi_modal_data when it has some (the engine expands each placeholder)."""
        if not self.images:
            return self.prompt_ids
        return {"prompt_token_ids": self.prompt_ids, "multi_modal_data": {"image": self.images}}


def row_seed(base_seed: int, index: int) -> int:
    """A row's own seed from the job seed and its input position: independent of windows, batch
    order and resume, and unrelated between neighbouring rows."""
    digest = hashlib.blake2b(f"{base_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: a valid torch seed


def row_params(row: Row, base: SamplingParams, base_seed: int) -> SamplingParams:
    """The job's params with the row's overrides (SamplingParams checks every value, against
    the job's own: ValueError or TypeError names the field) and the row's own seed."""
    params = base.replace(**row.overrides) if row.overrides else base
    if not params.is_greedy and "seed" not in row.overrides:
        params = params.replace(seed=row_seed(base_seed, row.index))
    return params


def chat_of(row: Row, plan: PromptPlan) -> list[dict[str, Any]] | None:
    """The row as a chat, or None when its prompt is sent as raw text. A row with images whose
    chat has no image parts gets them before the text of its first user turn."""
    if row.messages is not None:
        return _with_images(row.messages, len(row.images or ()))
    prompt = row.prompt or ""
    if plan.instruct is not None:
        prompt = plan.instruct.replace("{prompt}", prompt)
    elif plan.chat_template != "true" and not row.system_prompt:
        return None
    system = [{"role": "system", "content": row.system_prompt}] if row.system_prompt else []
    return _with_images([*system, {"role": "user", "content": prompt}], len(row.images or ()))


def _with_images(chat: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The chat with `count` image parts before the text of its first user turn, unless it
    places its images itself (it has image parts) or has no user turn (the engine then says
    that the placeholders are not the images)."""
    if not count or any(not isinstance(m["content"], str) for m in chat):
        return chat
    at = next((i for i, m in enumerate(chat) if m["role"] == "user"), None)
    if at is None:
        return chat
    text = chat[at]["content"]
    parts = [{"type": "image"} for _ in range(count)]
    parts += [{"type": "text", "text": text}] if text else []
    return [*chat[:at], {"role": "user", "content": parts}, *chat[at + 1 :]]


def prepare_window(
    rows: Iterable[Row],
    tokenizer: Tokenizer | None,
    base: SamplingParams,
    base_seed: int,
    plan: PromptPlan | None = None,
    adapters: JobAdapters | None = None,
) -> tuple[list[Prepared], list[ResultRow]]:
    """Rows -> (prompts to generate, rows that already failed with their error), each list in
    the rows' order. The tokenizer may be None only when no row is left to generate. `adapters`
    resolve the rows' lora values (a value that names no adapter is the row's error). The
    window's texts are tokenized in one batch per kind (raw text, rendered chats)."""
    plan = plan or PromptPlan()
    posed: list[_Posed] = []
    failed: list[ResultRow] = []
    limits = plan.image_limits
    images = WindowImages(limits) if limits is not None else None  # this window's, then dropped
    for row in rows:
        found = _pose(row, tokenizer, base, base_seed, plan, adapters, images)
        if isinstance(found, _Failed):
            prompt = row.prompt if found.keeps_prompt else None
            failed.append(ResultRow.failed(row.index, row.id, found.error, prompt, row.extra))
        else:
            posed.append(found)
    if not posed:
        return [], failed
    assert tokenizer is not None  # _pose refuses a row to tokenize without one
    raw = [p for p in posed if p.kind == "raw"]
    chats = [p for p in posed if p.kind == "chat"]
    ids_of: dict[int, list[int]] = {}
    text_of: dict[int, str] = {}
    for p, ids in zip(raw, tokenizer.encode_batch([p.text for p in raw]), strict=True):
        ids_of[id(p)], text_of[id(p)] = ids, p.text
    chat_ids = tokenizer.encode_batch([p.text for p in chats], add_special_tokens=False)
    # A chat's prompt column holds what its ids decode to (what the model saw).
    chat_text = tokenizer.decode_batch(chat_ids, skip_special_tokens=False)
    for p, ids, text in zip(chats, chat_ids, chat_text, strict=True):
        ids_of[id(p)], text_of[id(p)] = ids, text
    ready = []
    for p in posed:
        if p.kind == "inputs":  # an embeddings line: each input tokenized on its own
            assert p.row.inputs is not None
            each = [tokenizer.encode(x) if isinstance(x, str) else x for x in p.row.inputs]
            flat = [t for one in each for t in one]
            ready.append(Prepared(p.row, flat, json.dumps(p.row.inputs), p.params, each, p.lora))
        else:
            ids, text = ids_of[id(p)], text_of[id(p)]
            ready.append(Prepared(p.row, ids, text, p.params, lora=p.lora, images=p.images))
    return ready, failed


class _Posed(NamedTuple):
    """A row ready to tokenize: raw text, a rendered chat, or an embeddings line's inputs."""

    row: Row
    kind: str  # raw | chat | inputs
    text: str
    params: SamplingParams
    lora: LoRARequest | None
    images: tuple[Image.Image, ...] = ()


class _Failed(NamedTuple):
    error: str
    keeps_prompt: bool  # the output row shows the prompt (an error found before rendering)


def _pose(
    row: Row,
    tokenizer: Tokenizer | None,
    base: SamplingParams,
    base_seed: int,
    plan: PromptPlan,
    adapters: JobAdapters | None,
    images: WindowImages | None = None,
) -> _Posed | _Failed:
    """The row's text to tokenize, its params and its images (decoded by `images`, the
    window's), or its error."""
    if row.error is not None:
        return _Failed(row.error, True)
    if row.images and images is None:
        return _Failed(
            "this row has images, and this job takes none: images need a vision-language model, "
            "in a generation job (engine.task=generate) with executor=local",
            True,
        )
    try:
        params = row_params(row, base, base_seed)
    except (ValueError, TypeError) as e:
        return _Failed(f"bad sampling value: {e}", True)
    lora = None
    if row.lora is not None:
        assert adapters is not None, "a lora value without dataset.lora_column"
        resolved = adapters.resolve(row.lora)
        if isinstance(resolved, str):
            return _Failed(resolved, True)
        lora = resolved
    if tokenizer is None:
        raise ValueError("prepare_window needs the tokenizer for rows left to generate")
    if row.inputs is not None:  # bounded when the line was read
        return _Posed(row, "inputs", "", params, lora)
    chat = chat_of(row, plan)
    if chat is None:
        text = (row.prompt or "") + (row.response or "")
        too_long = prompt_size_error(text, plan.max_prompt_bytes)
        if too_long:
            return _Failed(too_long, False)
        return _with_decoded(_Posed(row, "raw", text, params, lora), images)
    try:
        if row.response is not None:  # the reply to score: the last turn, not a prompt
            chat = [*chat, {"role": "assistant", "content": row.response}]
        text = tokenizer.render_chat_template(
            chat,
            add_generation_prompt=row.response is None,
            chat_template=plan.template,
            chat_template_kwargs=plan.template_kwargs,
            limits=plan.limits,
        )
    except Exception as e:  # a template can fail on one odd chat; only that row fails
        return _Failed(f"chat template failed: {e}", False)
    too_long = prompt_size_error(text, plan.max_prompt_bytes)
    if too_long:
        return _Failed(f"after the chat template, {too_long.removeprefix('the ')}", False)
    return _with_decoded(_Posed(row, "chat", text, params, lora), images)


def _with_decoded(posed: _Posed, images: WindowImages | None) -> _Posed | _Failed:
    """The posed row with its images decoded, or its error (the first image that fails)."""
    if not posed.row.images or images is None:
        return posed
    decoded = images.load(posed.row)
    return _Failed(decoded, True) if isinstance(decoded, str) else posed._replace(images=decoded)


def check_template(
    tokenizer: Tokenizer, plan: PromptPlan, system_prompt: str | None, chats: bool
) -> None:
    """Render a one-turn chat (after the job's system prompt, if any) with the job's template
    before the model loads. Where rows are prompts, every row is such a chat, so any failure is
    the job's error (ValueError); where rows bring their own turns (`chats`), only a failure
    that no data can avoid is: a template that does not compile, goes past its bounds, or
    breaks the sandbox's rules (its `range` limit included). Others are left to the rows."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import SecurityError

    probe = [{"role": "user", "content": "Hello"}]
    if system_prompt:
        probe.insert(0, {"role": "system", "content": system_prompt})
    try:
        tokenizer.render_chat_template(
            probe,
            chat_template=plan.template,
            chat_template_kwargs=plan.template_kwargs,
            limits=plan.limits,
        )
    except Exception as e:  # noqa: BLE001 (a template can raise anything; the message says what)
        template_bug = (TemplateLimitError, TemplateSyntaxError, SecurityError, OverflowError)
        if chats and not isinstance(e, template_bug):
            return  # it may refuse this chat and accept the data's
        which = "engine.chat_template" if plan.template is not None else "the model's chat template"
        why = str(e) if isinstance(e, TemplateLimitError) else f"{type(e).__name__}: {e}"
        raise ValueError(
            f"{which} fails on a one-line chat: {why}; fix the template, or give another with "
            "engine.chat_template=<file.jinja>"
        ) from None


def to_result(
    p: Prepared, out: RequestOutput, listed: bool, tokenizer: Tokenizer | None = None
) -> ResultRow:
    """The output row of a generated request: completion and finish_reason as lists when
    `listed`, else the one sample's; the row's carried values. With a tokenizer, an OpenAI
    Batch row that asked for logprobs gets them (its `logprobs` column)."""
    extra = dict(p.row.extra)
    if out.error is not None:
        return ResultRow(
            p.row.index,
            p.row.id,
            p.text,
            prompt_tokens=len(out.prompt_token_ids),
            error=out.error,
            extra=extra,
        )
    if tokenizer is not None and p.params.logprobs is not None:
        decode = tokenizer.decode

        def token(token_id: int) -> str:
            return decode([token_id], skip_special_tokens=False)

        extra["logprobs"] = logprobs_json(out, p.params.logprobs, token)
    texts = [o.text for o in out.outputs]
    reasons = [o.finish_reason or "length" for o in out.outputs]
    return ResultRow(
        index=p.row.index,
        id=p.row.id,
        prompt=p.text,
        completion=texts if listed else texts[0],
        finish_reason=reasons if listed else reasons[0],
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(o.token_ids) for o in out.outputs),
        cached_tokens=out.num_cached_tokens,
        extra=extra,
    )
