"""OpenAI Batch input files: detection, each body field onto the row, and each bad line its own
error while the rest of the file reads on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchpage.data import DatasetError, DatasetSpec, iter_rows, validate
from batchpage.job.prompts import row_params
from batchpage.sampling_params import SamplingParams, StructuredOutputsParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"question {custom_id}"}])
    else:
        body.setdefault("prompt", f"prompt {custom_id}")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "x", **body}}


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_detected_by_its_first_record_and_read_as_requests(tmp_path: Path) -> None:
    text_parts = [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    records = [
        line(
            "c1",
            messages=[
                {"role": "system", "content": "S"},
                {"role": "user", "content": text_parts},
            ],
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            n=2,
            stop="END",
            seed=3,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logprobs=True,
            top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        ),
        line("c2", COMPLETIONS, max_tokens=4, logprobs=3, stop=["a", "b"]),
        line("c3", logprobs=True),
        line("c4", response_format={"type": "text"}),
    ]  # fmt: skip
    f = write(tmp_path / "requests.jsonl", records)
    info = validate(DatasetSpec(path=str(f)))
    assert info.format == "openai_batch" and info.id_column == "custom_id"
    assert info.num_rows == 4 and info.carried == ()
    rows = list(iter_rows(DatasetSpec(path=str(f))))
    assert [r.id for r in rows] == ["c1", "c2", "c3", "c4"] and all(r.error is None for r in rows)
    assert rows[0].messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "x\ny"},
    ]
    assert rows[0].overrides == {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": ["END"],
        "seed": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "logprobs": 2,
        "structured_outputs": StructuredOutputsParams(json=schema),
    }
    assert rows[1].prompt == "prompt c2" and rows[1].messages is None
    assert rows[1].overrides == {"max_tokens": 4, "logprobs": 3, "stop": ["a", "b"]}
    assert rows[2].overrides == {"logprobs": 0} and rows[3].overrides == {}
    assert [r.extra["url"] for r in rows] == [CHAT, COMPLETIONS, CHAT, CHAT]
    # The overrides are SamplingParams fields: the job's params take them as they are.
    params = row_params(rows[0], SamplingParams(max_tokens=16), base_seed=0)
    assert (params.n, params.max_tokens, params.logprobs, params.seed) == (2, 7, 2, 3)


def embeddings(value: Any, custom_id: str = "e") -> dict[str, Any]:
    return {**line(custom_id), "url": "/v1/embeddings", "body": {"input": value}}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "is not an object"),
        ({**line("a"), "url": "/v1/moderations"}, "url '/v1/moderations' is not supported"),
        ({**line("a"), "url": "/v1/embeddings"}, "not supported for /v1/embeddings"),  # messages
        (embeddings([]), "input must be a string, an array of strings, an array of token ids"),
        (embeddings(["a", 3]), "input[1] is neither a text nor token ids"),
        (embeddings([[1, 2], [True]]), "input[1] is neither a text nor token ids"),
        (embeddings([[1, -2]]), "input[0] is neither a text nor token ids"),
        (embeddings({"text": "a"}), "got dict"),
        (embeddings(["a", " "]), "input[1] is empty"),
        (embeddings(["a"] * 2049), "input has 2049 items, at most 2048"),
        ({**line("a"), "method": "GET"}, "method must be POST"),
        ({**line("a"), "custom_id": 5}, "custom_id must be a non-empty string"),
        ({**line("a"), "body": "x"}, "body must be an object"),
        ({**line("a"), "body": {"model": "m"}}, "needs messages"),
        ({**line("a", COMPLETIONS), "body": {"max_tokens": 3}}, "needs prompt as one string"),
        (line("a", COMPLETIONS, prompt=["p", "q"]), "needs prompt as one string"),
        (line("a", COMPLETIONS, prompt=" "), "prompt is empty"),
        (line("a", messages=[{"role": "robot", "content": "x"}]), "role 'robot'"),
        (line("a", messages=[]), "non-empty list"),
        (line("a", tools=[{}]), "tools are not supported"),
        (line("a", COMPLETIONS, messages=[]), "messages are not supported"),
        (line("a", max_tokens=2, max_completion_tokens=3), "both max_tokens"),
        (line("a", logprobs=2), "logprobs must be true or false"),
        (line("a", top_logprobs=2), "top_logprobs needs logprobs"),
        (line("a", logprobs=True, top_logprobs=21), "from 0 to 20"),
        (line("a", response_format={"type": "xml"}), "bad response_format"),
    ],
)
def test_each_bad_line_is_its_own_error(tmp_path: Path, record: Any, message: str) -> None:
    f = write(tmp_path / "b.jsonl", [line("first"), record, line("last")])
    rows = list(iter_rows(DatasetSpec(path=str(f))))
    assert [r.error for r in (rows[0], rows[2])] == [None, None]
    assert rows[1].error is not None and message in rows[1].error, rows[1].error
    custom_id = record.get("custom_id") if isinstance(record, dict) else None
    assert rows[1].id == (custom_id if isinstance(custom_id, str) else None)


def test_embeddings_inputs_in_each_of_openais_shapes(tmp_path: Path) -> None:
    """One text is the row's prompt; several texts, token ids or token-id lists its inputs."""
    shapes = ["one", ["one"], ["a", "b"], [5, 6, 7], [[5, 6], [7]]]
    f = write(tmp_path / "e.jsonl", [embeddings(v, f"e{i}") for i, v in enumerate(shapes)])
    rows = list(iter_rows(DatasetSpec(path=str(f))))
    assert [(r.prompt, r.inputs) for r in rows] == [
        ("one", None),
        ("one", None),
        (None, ["a", "b"]),
        (None, [[5, 6, 7]]),
        (None, [[5, 6], [7]]),
    ]


def test_bad_values_fail_when_the_row_gets_its_params(tmp_path: Path) -> None:
    f = write(tmp_path / "v.jsonl", [line("a", temperature=-1), line("b", n="two")])
    for row, field in zip(iter_rows(DatasetSpec(path=str(f))), ("temperature", "n"), strict=True):
        assert row.error is None
        with pytest.raises(ValueError, match=field):
            row_params(row, SamplingParams(), base_seed=0)


def test_file_level_problems_stop_before_the_model_loads(tmp_path: Path) -> None:
    dup = write(tmp_path / "dup.jsonl", [line("a"), line("b"), line("a")])
    with pytest.raises(DatasetError, match="duplicate ids: 'a'"):
        validate(DatasetSpec(path=str(dup)))
    plain = write(tmp_path / "plain.jsonl", [{"prompt": "x"}])
    with pytest.raises(DatasetError, match="not an OpenAI Batch file"):
        validate(DatasetSpec(path=str(plain), format="openai_batch"))
    ok = write(tmp_path / "ok.jsonl", [line("a"), {"oops": 1}])
    with pytest.raises(DatasetError, match="drop dataset.messages_column, dataset.system_prompt"):
        validate(DatasetSpec(path=str(ok), messages_column="m", system_prompt="s"))
    # A line without a custom_id is that line's error, not a refused job.
    assert validate(DatasetSpec(path=str(ok), format="openai_batch")).num_rows == 2


def test_other_top_level_fields_are_carried(tmp_path: Path) -> None:
    f = write(tmp_path / "m.jsonl", [{**line("a"), "meta": {"k": 1}}, line("b")])
    info = validate(DatasetSpec(path=str(f)))
    assert info.carried == ("meta",) and str(info.carried_schema.field("meta").type) == (
        "struct<k: int64>"
    )
    rows = list(iter_rows(DatasetSpec(path=str(f))))
    assert [r.extra["meta"] for r in rows] == [{"k": 1}, None]
