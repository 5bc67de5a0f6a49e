"""Tokenizer: the few operations the engine needs, over a transformers fast tokenizer.

Built from a HF folder (tokenizer.json / tokenizer_config.json) or from the vocabulary embedded
in a GGUF file. End-of-sequence ids are the union of every place a checkpoint may declare them:
config.json, the tokenizer, generation_config.json and GGUF metadata (chat models often stop on
an end-of-turn token that only one of those lists).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from batchpage.chat_messages import normalize_messages
from batchpage.fileio import atomic_dir
from batchpage.model.chat_render import CompiledTemplate
from batchpage.model.render_budget import RenderLimits
from batchpage.paths import cache_dir as batchpage_cache_dir

log = logging.getLogger(__name__)

# transformers' own apply_chat_template arguments: not template variables.
_RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: Iterable[int] = ()):
        self.hf = hf_tokenizer  # transformers PreTrainedTokenizerFast (kept public for detok)
        eos = set(extra_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._templates: dict[str, CompiledTemplate] = {}  # by source: compiled once

    @classmethod
    def from_hf_folder(cls, folder: Path, config_eos_ids: Iterable[int] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        check_hf_tokenizer_files(folder)
        hf = AutoTokenizer.from_pretrained(str(folder))
        return cls(hf, [*config_eos_ids, *_generation_config_eos(folder)])

    @classmethod
    def from_gguf(
        cls, path: Path, config_eos_ids: Iterable[int] = (), cache_dir: Path | None = None
    ) -> Tokenizer:
        """From the vocabulary inside a GGUF file. transformers' conversion re-parses the whole
        file, every tensor included, so the converted tokenizer is saved under cache_dir (default:
        batchpage.paths.cache_dir(); BATCHPAGE_CACHE="" disables it) and
        reloaded from there next time."""
        from transformers import AutoTokenizer

        cached = _cache_entry(path, cache_dir)
        if cached is not None and (cached / "tokenizer.json").is_file():
            return cls(AutoTokenizer.from_pretrained(str(cached)), config_eos_ids)
        where = f"; once, then cached in {cached}" if cached is not None else ""
        log.info("converting the tokenizer inside %s (about 10 s%s)", path.name, where)
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if cached is not None:
            # A cache that cannot be written is skipped: the tokenizer in memory is good.
            with atomic_dir(cached) as tmp:
                if tmp is not None:
                    hf.save_pretrained(str(tmp))
        return cls(hf, config_eos_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` of each text, in one call to the tokenizers library (which splits the batch
        over its threads), without transformers' per-text conversion of each encoding and
        without the character offsets nobody here reads (`encode_batch_fast`: for short texts
        the offsets are much of the work); the same ids (tests/model/test_loaders.py checks
        it), as `decoder` reads the same backend."""
        if not texts:
            return []
        found = self.hf.backend_tokenizer.encode_batch_fast(
            list(texts), add_special_tokens=add_special_tokens
        )
        return [e.ids for e in found]

    def decode_batch(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each id list, in one call."""
        return self.hf.backend_tokenizer.decode_batch(
            [list(ids) for ids in batch], skip_special_tokens=skip_special_tokens
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decoder(skip_special_tokens)(list(ids))

    def single_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one token of the vocabulary (an added marker such as
        ``<think>``), else None."""
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        """Token ids to text through the tokenizers library directly: transformers' decode adds
        per-call conversions, and its tokenization-space cleanup rewrites text across token
        boundaries (" ." -> "."), which incremental decoding cannot reproduce (vLLM leaves it
        off too)."""
        return functools.partial(
            self.hf.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        limits: RenderLimits | None = None,
    ) -> list[int]:
        """`render_chat_template`, then tokenized without adding special tokens again
        (templates write BOS themselves), the same as transformers' apply_chat_template."""
        text = self.render_chat_template(
            messages, add_generation_prompt, chat_template, chat_template_kwargs, limits
        )
        return self.encode(text, add_special_tokens=False)

    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        limits: RenderLimits | None = None,
    ) -> str:
        """The chat as text, rendered with the model's template (or `chat_template`, the
        template text) the way transformers renders it (its sandbox, globals and variables),
        within `limits` (default RenderLimits()): a template that goes past them raises
        TemplateLimitError, a ValueError (batchpage.model.chat_render). `chat_template_kwargs`
        become variables of the template (e.g. enable_thinking=False), as in vLLM. The messages
        are checked and normalised first (batchpage.chat_messages): ValueError names a bad one."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template: use generate() with plain prompts, "
                "pick a chat/instruct model, or give one with chat_template=<file.jinja>"
            )
        kwargs = dict(chat_template_kwargs or {})
        check_chat_template_kwargs(kwargs)
        source = self.hf.get_chat_template(chat_template)
        compiled = self._templates.get(source)
        if compiled is None:
            compiled = self._templates[source] = CompiledTemplate(source)
        variables = {
            **self.hf.special_tokens_map,
            **kwargs,
            "messages": normalize_messages(messages),
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        return compiled.render(limits or RenderLimits(), variables)


def check_chat_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse names that are transformers' own arguments rather than template variables."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs must map names to values, got {kwargs!r:.80}")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise ValueError(
            f"chat_template_kwargs has {reserved}, which batchpage sets itself; pass only "
            "variables of the template (e.g. enable_thinking)"
        )


def resolve_chat_template(value: str | None) -> str | None:
    """A chat-template override as template text: the contents of a .jinja file, or the text
    itself (as vLLM's --chat-template takes either). Parsed now, so that a broken template fails
    before any weight loads."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat_template must be a .jinja file or template text, got {value!r}")
    path = Path(os.path.expanduser(value))
    if "{" not in value and "\n" not in value:
        if not path.is_file():
            raise ValueError(
                f"chat_template={value!r}: no such file ({path.absolute()}); give a .jinja file "
                "or the template text itself"
            )
        text = path.read_text(encoding="utf-8")
    else:
        text = value
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template {value[:60]!r} is not a valid Jinja template: {e}") from e
    return text


def check_hf_tokenizer_files(folder: Path) -> None:
    """Cheap presence check, so a folder without a tokenizer fails before weights load."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"{folder} has no tokenizer (tokenizer.json): save one into the folder with "
            "tokenizer.save_pretrained(folder)"
        )


def _cache_entry(gguf_path: Path, cache_dir: Path | None) -> Path | None:
    """Where the converted tokenizer of this file's header and this transformers version lives;
    None when caching is disabled. The key is the header's bytes (everything before the tensor
    data: the vocabulary and every setting the conversion reads), not the file's path or time,
    so another copy of the file (the same model installed in a second environment) reuses it."""
    import transformers

    from batchpage.model.gguf_file import read_gguf_header

    if cache_dir is None:
        if os.environ.get("BATCHPAGE_CACHE") == "":
            return None
        cache_dir = batchpage_cache_dir()
    header_bytes = read_gguf_header(gguf_path).data_start
    key = hashlib.sha256(transformers.__version__.encode() + b"\0")
    with open(gguf_path, "rb") as f:
        key.update(f.read(header_bytes))
    return cache_dir / "tokenizers" / f"{gguf_path.stem}-{key.hexdigest()[:20]}"


def _generation_config_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
