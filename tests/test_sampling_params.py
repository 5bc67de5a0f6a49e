"""SamplingParams: defaults, normalisation and validation messages."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from batchpage.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_k, p.top_p, p.min_p) == (1, None, 1.0, 0, 1.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs, p.logit_bias) == (False, None, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert p.use_beam_search is False and p.beam_width is None
    assert p.length_penalty == 1.0 and p.early_stopping is False
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        ({"temperature": -1.0}, "temperature", "-1.0"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": 1.5}, "min_p", "1.5"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 17}, "min_tokens", "17"),
        ({"n": 0}, "n", "0"),
        ({"n": 3, "best_of": 2}, "best_of", "2"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "-1"),
        ({"stop": [""]}, "stop", "''"),
        ({"stop": 3}, "stop", "3"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
        ({"logit_bias": {5: 200.0}}, "logit_bias[5]", "200.0"),
        ({"logit_bias": {-5: 1.0}}, "logit_bias", "-5"),
        ({"seed": 2**64}, "seed", str(2**64)),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"temperature": "hot"}, "temperature", "hot"),
        ({"max_tokens": 2.5}, "max_tokens", "2.5"),
        ({"n": True}, "n", "True"),
        ({"ignore_eos": "no"}, "ignore_eos", "no"),
        ({"length_penalty": 2.0}, "length_penalty", "2.0"),
        ({"beam_width": 4}, "beam_width", "4"),
        ({"use_beam_search": True, "n": 4, "beam_width": 2}, "beam_width", "2"),
        ({"use_beam_search": True, "temperature": 0.7}, "temperature", "0.7"),
        ({"use_beam_search": True, "top_p": 0.9}, "top_p", "0.9"),
        ({"temperature": 0.0, "n": 2, "best_of": 3}, "best_of", "3"),
    ],
)
def test_invalid_values_name_field_and_value(overrides: dict, field: str, value: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**overrides)
    message = str(err.value)
    assert message.startswith(field) or f" {field}" in message, message
    assert value in message, message


def test_messages_state_the_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\], got 3.0"):
        SamplingParams(presence_penalty=3)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, np.int64(9)), top_k=-1, max_tokens=32.0)
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9]
    assert p.top_k == 0 and p.max_tokens == 32 and isinstance(p.max_tokens, int)
    assert SamplingParams(temperature=np.float32(0.5), n=np.int64(2)).n == 2
    assert SamplingParams(logit_bias={"12": 1}).logit_bias == {12: 1.0}
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy


def test_beam_search() -> None:
    p = SamplingParams(use_beam_search=True, n=2, temperature=0, length_penalty=0.5)
    assert p.effective_beam_width == 2
    assert (
        SamplingParams(use_beam_search=True, beam_width=5, early_stopping="never").beam_width == 5
    )


@pytest.mark.parametrize(("width", "shown"), [(0, "0"), (-2, "-2"), (1.5, "1.5"), ("3", "'3'")])
def test_beam_search_params_name_their_own_field(width: object, shown: str) -> None:
    """BeamSearchParams has no `n`: a bad beam_width is refused under its own name."""
    with pytest.raises(ValueError) as err:
        BeamSearchParams(beam_width=width, max_tokens=4).to_sampling_params()  # type: ignore[arg-type]
    said = str(err.value)
    assert said.startswith("BeamSearchParams.beam_width must be") and said.endswith(shown), said
    assert BeamSearchParams(beam_width=2, max_tokens=4).to_sampling_params().n == 2


def test_replace_validates_and_rejects_unknown_fields() -> None:
    base = SamplingParams(temperature=0.5, stop=["a"])
    row = base.replace(max_tokens=4, stop=["b"])
    assert (row.max_tokens, row.stop, row.temperature) == (4, ["b"], 0.5)
    assert base.stop == ["a"] and base.max_tokens == 16
    with pytest.raises(ValueError, match="max_tokens"):
        base.replace(max_tokens=-3)
    with pytest.raises(ValueError, match="maxtokens"):
        base.replace(maxtokens=3)


def test_copies_do_not_share_lists() -> None:
    stop = ["x"]
    p = SamplingParams(stop=stop)
    q = p.replace()
    q.stop.append("y")
    assert p.stop == ["x"] and stop == ["x"]


def test_verify_vocab() -> None:
    SamplingParams(logit_bias={10: 1.0}, stop_token_ids=[3]).verify_vocab(11)
    with pytest.raises(ValueError, match=r"logit_bias .*< vocab size 10.*\[10\]"):
        SamplingParams(logit_bias={10: 1.0}).verify_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[99]).verify_vocab(10)


# --- structured outputs --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_structured_outputs_takes_exactly_one_kind() -> None:
    assert StructuredOutputsParams(regex=r"\d+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(
        ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"
    ):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="got choice, json_object"):
        StructuredOutputsParams(choice=["a"], json_object=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON text"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
        ({"json": 5}, "structured_outputs.json must be a JSON schema object"),
        ({"regex": ""}, "structured_outputs.regex must be non-empty text"),
        ({"grammar": 3}, "structured_outputs.grammar must be non-empty text"),
        ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must hold non-empty strings"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must hold non-empty strings"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be a bool"),
    ],
)
def test_structured_outputs_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_key_is_the_content_in_order() -> None:
    as_text = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {"type": '
                                      '"integer"}, "a": {"type": "string"}}}')  # fmt: skip
    assert as_text.json == SCHEMA
    assert as_text.key == StructuredOutputsParams(json=SCHEMA).key
    # Property order is the output's order: a reordered schema is another constraint.
    reordered = {"type": "object", "properties": dict(reversed(SCHEMA["properties"].items()))}
    assert StructuredOutputsParams(json=reordered).key != as_text.key
    assert StructuredOutputsParams(choice=("x", "y")).key == ("choice", '["x", "y"]')
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


def test_from_response_format_follows_openai() -> None:
    from_rf = StructuredOutputsParams.from_response_format
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert from_rf(rf) == StructuredOutputsParams(json=SCHEMA)
    assert from_rf(json.dumps(rf)) == StructuredOutputsParams(json=SCHEMA)
    assert from_rf({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert from_rf('{"type": "text"}') is None
    for bad, message in [
        ("{nope", "response_format is not valid JSON text"),
        (["json_object"], "response_format must be an object with a type"),
        ({"type": "xml"}, "type must be json_schema, json_object or text, got 'xml'"),
        ({"json_schema": {"schema": SCHEMA}}, "got None"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, '"json_schema": {"schema"'),
        ({"type": "json_schema", "schema": SCHEMA}, '"json_schema": {"schema"'),
        ({"type": "json_schema", "json_schema": {"schema": "{bad"}}, "not valid JSON text"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            from_rf(bad)


def test_sampling_params_structured_outputs() -> None:
    so = StructuredOutputsParams(regex="[ab]+")
    p = SamplingParams(structured_outputs=so, stop=["b"])
    assert p.structured_outputs is so and p.replace(max_tokens=3).structured_outputs is so
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match=r"structured_outputs has unknown key\(s\) \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[ab]+")
    with pytest.raises(ValueError, match="ignore_eos must be False with structured_outputs"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    with pytest.raises(ValueError, match=r"min_tokens must be 0 with structured_outputs .*got 2"):
        SamplingParams(structured_outputs=so, min_tokens=2, max_tokens=5)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True).replace(structured_outputs=so)


def test_a_schema_nested_past_the_limit_is_a_clear_error_not_a_recursion() -> None:
    from batchpage.json_depth import MAX_SCHEMA_DEPTH

    def nested(levels: int) -> str:
        return '{"type": "array", "items": ' * levels + "{}" + "}" * levels

    # Each level is an object inside the one before: the top object and `levels` more.
    StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH - 1))
    for schema in (nested(MAX_SCHEMA_DEPTH), nested(1000), json.loads(nested(200))):
        with pytest.raises(ValueError, match=f"over the limit of {MAX_SCHEMA_DEPTH}"):
            StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="nested too deeply to read"):
        StructuredOutputsParams.from_response_format("[" * 100_000 + "]" * 100_000)
