"""Settings of the job's own that would fail every row are the job's error, found before the
model loads (exit 2 from the command line): a thinking budget without thinking markers, stop
token ids outside the vocabulary, a constraint xgrammar cannot parse, a chat template that
fails the one-line chat every prompt row becomes, structured outputs on a pooling job. Each
case is run with an LLM factory that fails the test if called."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from batchpage.job import JobConfigError, run_job
from batchpage.job.config import StructuredOutputsConfig as SO
from tests.job.test_loop import job, never, table, write_jsonl

PROMPTS = [{"prompt": "Hello world"}, {"prompt": "A radix tree"}]
CHATS = [{"messages": [{"role": "user", "content": "Hi"}]}]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"sampling": {"thinking_token_budget": 8}},
            "sampling.thinking_token_budget needs a reasoning model's thinking markers, and "
            "engine.reasoning_parser is not set",
        ),
        (
            {"sampling": {"thinking_token_budget": 8}, "engine": {"reasoning_parser": "auto"}},
            "engine.reasoning_parser=auto found no thinking markers",
        ),
        (
            {"sampling": {"stop_token_ids": [3, 10**6]}},
            r"sampling.stop_token_ids token ids must be < vocab size \d+, got \[1000000\]",
        ),
        (
            {"sampling": {"structured_outputs": SO(regex="(ab"), "ignore_eos": False}},
            "sampling.structured_outputs.regex is invalid: Regex parsing error",
        ),
        (
            {
                "sampling": {
                    "structured_outputs": SO(json='{"type": "objekt"}'),
                    "ignore_eos": False,
                }
            },
            "sampling.structured_outputs.json is invalid: .*objekt",
        ),
        (
            {
                "sampling": {
                    "structured_outputs": SO(grammar="root ::= missing"),
                    "ignore_eos": False,
                }
            },
            "sampling.structured_outputs.grammar is invalid: .*missing",
        ),
    ],
)
def test_sampling_settings_that_fail_every_row_are_refused_before_loading(
    tmp_path: Path, tiny_folder: Path, changes: dict, message: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    with pytest.raises(JobConfigError, match=message):
        run_job(job(data, tiny_folder, tmp_path / "out", **changes), llm_factory=never)
    assert not (tmp_path / "out").exists()


TEMPLATES = {
    "raise_exception": ('{{ raise_exception("only system turns, please") }}', "only system turns"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    "range limit": ("{% for i in range(10 ** 8) %}x{% endfor %}", "safe_range"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_chat_template_that_fails_a_prompt_rows_chat_fails_the_job(
    tmp_path: Path, tiny_folder: Path, name: str
) -> None:
    text, said = TEMPLATES[name]
    template = tmp_path / "t.jinja"
    template.write_text(text)
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    cfg = job(
        data,
        tiny_folder,
        tmp_path / "out",
        engine={"chat_template": str(template)},
        dataset={"chat_template": "true"},
    )
    with pytest.raises(
        JobConfigError, match=f"engine.chat_template fails on a one-line chat.*{said}"
    ):
        run_job(cfg, llm_factory=never)


def test_a_chats_template_that_refuses_one_chat_is_left_to_the_rows(
    tmp_path: Path, tiny_folder: Path
) -> None:
    """Rows with their own turns may pass where the probe did not: that is each row's error."""
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATES["raise_exception"][0])
    data = write_jsonl(tmp_path / "d.jsonl", CHATS)
    cfg = job(
        data,
        tiny_folder,
        tmp_path / "out",
        engine={"chat_template": str(template)},
        dataset={"prompt_column": None, "messages_column": "messages"},
    )
    run_job(cfg)
    (row,) = table(tmp_path / "out")
    assert "only system turns" in row["error"]
    template.write_text(TEMPLATES["sandbox"][0])  # no data can avoid this one
    with pytest.raises(JobConfigError, match="SecurityError"):
        run_job(dataclasses.replace(cfg, output_dir=str(tmp_path / "o2")), llm_factory=never)


def test_structured_outputs_on_a_pooling_job_are_refused(tmp_path: Path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    cfg = job(
        data,
        tiny_folder,
        tmp_path / "out",
        engine={"task": "embed"},
        sampling={"structured_outputs": SO(regex="a+"), "ignore_eos": False},
    )
    with pytest.raises(JobConfigError, match="engine.task=embed generates none"):
        run_job(cfg, llm_factory=never)
