"""A reasoning model through the job: the `reasoning` column, the thinking budget (per job and
per row), resume, the job's identity, and OpenAI Batch's message.reasoning.

The model is a tiny random Llama with DeepSeek-R1's real chat template and markers
(tests/model_factory.thinking_tokenizer); the reference is LLM.chat with the same parameters, and
the budget is checked on its token ids (a random model's thinking is byte fragments whose text
does not re-tokenize to the same ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchpage import LLM, SamplingParams
from batchpage.job import JobConfigError, run_job
from tests.job.test_loop import job, table, write_jsonl
from tests.job.test_openai_batch_job import ENGINE, ask, request
from tests.model_factory import build_hf_model, save_hf_folder, thinking_tokenizer

BUDGET = 32
WORDS = ["fox", "tree", "block", "cache", "world", "dog", "sum", "radix"]


@pytest.fixture(scope="module")
def r1_folder(tmp_path_factory) -> Path:
    tok = thinking_tokenizer("deepseek_r1")
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tok))
    return save_hf_folder(hf, tmp_path_factory.mktemp("r1"), tok)


def questions(count: int) -> list[dict[str, str]]:
    return [{"question": f"Why is the {WORDS[i % 8]} {i} here?"} for i in range(count)]


def reasoning_job(data: Path, model: Path, out: Path, **changes):
    dataset = {"prompt_column": "question", "chat_template": True, **changes.pop("dataset", {})}
    engine = {"reasoning_parser": "auto", **changes.pop("engine", {})}
    sampling = {"max_tokens": 48, "ignore_eos": False, "thinking_token_budget": BUDGET}
    sampling.update(changes.pop("sampling", {}))
    return job(data, model, out, dataset=dataset, engine=engine, sampling=sampling, **changes)


def test_a_budgeted_job_of_100_rows_has_short_thinking_and_an_answer_in_every_row(
    tmp_path: Path, r1_folder: Path
) -> None:
    data = write_jsonl(tmp_path / "q.jsonl", questions(100))
    out = tmp_path / "out"
    run_job(reasoning_job(data, r1_folder, out, dataset={"window_rows": 32}))
    rows = table(out)
    assert [r["index"] for r in rows] == list(range(100))
    llm = LLM(str(r1_folder), reasoning_parser="auto", **ENGINE)
    end = llm.tokenizer.hf.convert_tokens_to_ids("</think>")
    params = SamplingParams(temperature=0, max_tokens=48, thinking_token_budget=BUDGET)
    chats = [[{"role": "user", "content": q["question"]}] for q in questions(100)]
    refs = llm.chat(chats, params, use_tqdm=False)
    for row, ref in zip(rows, refs, strict=True):
        o = ref.outputs[0]
        assert row["error"] is None
        assert (row["reasoning"], row["completion"]) == (o.reasoning, o.text)
        assert end in o.token_ids and o.token_ids.index(end) <= BUDGET  # thinking tokens
        assert row["completion"]  # every row has an answer
        assert row["completion_tokens"] == len(o.token_ids)


def test_resume_per_row_budgets_and_the_jobs_identity(tmp_path: Path, r1_folder: Path) -> None:
    records = [
        {**q, "thinking_token_budget": 2 if i % 2 else None} for i, q in enumerate(questions(8))
    ]
    data = write_jsonl(tmp_path / "q.jsonl", records)
    out = tmp_path / "out"
    run_job(reasoning_job(data, r1_folder, out, dataset={"limit": 3}))  # a partial run
    run_job(reasoning_job(data, r1_folder, out))
    clean = tmp_path / "clean"
    run_job(reasoning_job(data, r1_folder, clean))
    assert table(out) == table(clean)
    llm = LLM(str(r1_folder), reasoning_parser="auto", **ENGINE)
    for i, row in enumerate(table(out)):
        budget = 2 if i % 2 else BUDGET
        params = SamplingParams(temperature=0, max_tokens=48, thinking_token_budget=budget)
        chat = [{"role": "user", "content": records[i]["question"]}]
        o = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        assert (row["reasoning"], row["completion"]) == (o.reasoning, o.text)
    # The budget and the parser are part of what the completions mean.
    with pytest.raises(JobConfigError, match="thinking_token_budget"):
        run_job(reasoning_job(data, r1_folder, out, sampling={"thinking_token_budget": 4}))
    with pytest.raises(JobConfigError, match="reasoning_parser"):
        run_job(reasoning_job(data, r1_folder, out, engine={"reasoning_parser": "none"}))


def test_without_a_parser_the_job_has_no_reasoning_column(tmp_path: Path, r1_folder: Path) -> None:
    data = write_jsonl(tmp_path / "q.jsonl", questions(2))
    out = tmp_path / "out"
    run_job(reasoning_job(data, r1_folder, out, engine={"reasoning_parser": "none"},
                          sampling={"thinking_token_budget": None}))  # fmt: skip
    rows = table(out)
    assert "reasoning" not in rows[0]
    llm = LLM(str(r1_folder), **ENGINE)
    chats = [[{"role": "user", "content": q["question"]}] for q in questions(2)]
    refs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [r["completion"] for r in rows] == [o.outputs[0].text for o in refs]


def test_openai_batch_output_puts_the_thinking_in_message_reasoning(
    tmp_path: Path, r1_folder: Path
) -> None:
    lines = [
        request("a", messages=ask("Hello world"), max_tokens=20, thinking_token_budget=3),
        request("b", messages=ask("A radix tree"), max_tokens=20),
    ]
    data = write_jsonl(tmp_path / "b.jsonl", lines)
    out = tmp_path / "out"
    run_job(job(data, r1_folder, out, engine={"reasoning_parser": "deepseek_r1"},
                sampling={"max_tokens": 20, "ignore_eos": False}))  # fmt: skip
    answers = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    llm = LLM(str(r1_folder), reasoning_parser="deepseek_r1", **ENGINE)
    pairs = zip(answers, [3, None], ["Hello world", "A radix tree"], strict=True)
    for answer, budget, text in pairs:
        params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=budget)
        o = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0]
        message = answer["response"]["body"]["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (o.reasoning, o.text)
