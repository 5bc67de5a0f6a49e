"""Pooling models through the job: engine.task=embed writes `embedding`, classify `label` and
`probs`, reward and score `score`; resume, carried columns and row errors as for generation; a
reward job over a generated file (its messages and completions); pooling.* as the job's
PoolingParams. The reference is LLM.embed / classify / reward on the same prompts (themselves
checked against HF in tests/engine/test_pooling.py), and HF transformers for score and
Matryoshka dimensions."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification

from batchpage import LLM
from batchpage.job import JobConfigError, run_job
from batchpage.job.config import PoolingConfig
from tests.engine.test_pooling import (
    pooling_config,
    randomize,
    reward_model_folder,
    save_with_tokenizer,
)
from tests.job.test_loop import job, table, write_jsonl
from tests.job.test_openai_batch_job import ask, request

ENGINE = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256}
TEXTS = ["Hello world", "The quick brown fox", "A radix tree", "Paged attention", "def f():"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling_job")
    embed = randomize(AutoModel.from_config(pooling_config("llama_gqa_tied")), 2)
    labels = {0: "bad", 1: "fine", 2: "good"}
    config = pooling_config("llama_gqa_tied", id2label=labels, label2id={})
    cls = randomize(AutoModelForSequenceClassification.from_config(config), 1)
    reward, _ = reward_model_folder(root / "reward")
    cross = AutoModelForSequenceClassification.from_config(
        pooling_config("qwen3_tied", num_labels=1)
    )
    matryoshka = AutoModel.from_config(pooling_config("qwen3_tied", is_matryoshka=True))
    return {
        "embed": save_with_tokenizer(embed, root / "embed"),
        "classify": save_with_tokenizer(cls, root / "classify"),
        "reward": reward,
        "cross": save_with_tokenizer(randomize(cross, 5), root / "cross"),
        "matryoshka": save_with_tokenizer(randomize(matryoshka, 6), root / "matryoshka"),
    }


def records() -> list[dict]:
    rows = [{"prompt": t, "topic": f"t{i}"} for i, t in enumerate(TEXTS)]
    rows.insert(2, {"prompt": "", "topic": "empty"})  # a bad row: its error, the rest run
    return rows


def test_an_embedding_job_resumes_and_equals_llm_embed(tmp_path: Path, folders) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records())
    out = tmp_path / "out"
    run_job(job(data, folders["embed"], out, engine={"task": "embed"}, dataset={"limit": 3}))
    run_job(job(data, folders["embed"], out, engine={"task": "embed"}))
    clean = tmp_path / "clean"
    run_job(job(data, folders["embed"], clean, engine={"task": "embed"}))
    rows, fresh = table(out), table(clean)
    assert [r["embedding"] for r in rows] == [r["embedding"] for r in fresh]
    schema = pq.read_schema(out / "completions.parquet")
    kind = schema.field("embedding").type
    assert kind.list_size == 64 and kind.value_type == pa.float32()  # a fixed-size float32 list
    refs = LLM(str(folders["embed"]), **ENGINE).embed(TEXTS, use_tqdm=False)
    good = [r for r in rows if r["error"] is None]
    assert [r["topic"] for r in rows] == [r["topic"] for r in records()]  # carried, in order
    assert "prompt is empty" in rows[2]["error"] and rows[2]["embedding"] is None
    for row, ref in zip(good, refs, strict=True):
        assert row["completion"] is None and row["prompt_tokens"] == len(ref.prompt_token_ids)
        torch.testing.assert_close(
            torch.tensor(row["embedding"]), torch.tensor(ref.outputs.embedding), atol=1e-6, rtol=0
        )
    with pytest.raises(JobConfigError, match="task: .embed. -> .classify."):
        run_job(job(data, folders["classify"], out, engine={"task": "classify"}))


def test_a_classification_job_writes_the_label_and_the_probabilities(
    tmp_path: Path, folders
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records())
    run_job(job(data, folders["classify"], tmp_path / "out"))  # task=auto: the checkpoint's
    rows = [r for r in table(tmp_path / "out") if r["error"] is None]
    refs = LLM(str(folders["classify"]), **ENGINE).classify(TEXTS, use_tqdm=False)
    for row, ref in zip(rows, refs, strict=True):
        probs = ref.outputs.probs
        assert row["label"] == ("bad", "fine", "good")[probs.index(max(probs))]
        torch.testing.assert_close(torch.tensor(row["probs"]), torch.tensor(probs))


def test_a_reward_job_over_a_generated_file(tmp_path: Path, folders, tiny_folder: Path) -> None:
    """The generated file's prompt (the rendered chat) followed by its completion: the whole
    conversation as the generator saw it, scored."""
    chats = [{"messages": [{"role": "user", "content": t}]} for t in TEXTS]
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    generated = tmp_path / "generated"
    run_job(job(data, tiny_folder, generated, sampling={"max_tokens": 6},
                dataset={"messages_column": "messages"}))  # fmt: skip
    scored = tmp_path / "scored"
    run_job(job(
        generated / "completions.parquet", folders["reward"], scored,
        engine={"task": "reward"},
        dataset={"response_column": "completion", "id_column": "id", "keep_columns": []},
    ))  # fmt: skip
    rows, gens = table(scored), table(generated)
    texts = [g["prompt"] + g["completion"] for g in gens]
    refs = LLM(str(folders["reward"]), **ENGINE).reward(texts, use_tqdm=False)
    assert [r["id"] for r in rows] == [g["id"] for g in gens]
    assert [r["prompt"] for r in rows] == texts
    for row, ref in zip(rows, refs, strict=True):
        assert abs(row["score"] - float(ref.outputs.data[0])) < 1e-6


def pairs() -> list[dict]:
    docs = ["Blocks of keys and values.", "A tree of prefixes.", "Fox.", "Attention.", "Pages."]
    pairs = enumerate(zip(TEXTS, docs, strict=True))
    rows = [{"query": q, "doc": d, "k": i} for i, (q, d) in pairs]
    rows.insert(1, {"query": "No document here", "doc": None, "k": -1})  # its error only
    return rows


@torch.no_grad()
def test_a_score_job_pairs_each_prompt_with_its_response_column(tmp_path: Path, folders) -> None:
    """A cross-encoder reads the pair as the tokenizer's pair encoding (sigmoid of its one
    logit); an embedder gives the cosine of the two texts' last-token states: both against HF.
    Stopped after 3 rows and resumed, the file equals a clean run's."""
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs())
    dataset = {"prompt_column": "query", "response_column": "doc"}
    out, clean = tmp_path / "out", tmp_path / "clean"
    score = {"task": "score"}
    run_job(job(data, folders["cross"], out, engine=score, dataset={**dataset, "limit": 3}))
    run_job(job(data, folders["cross"], out, engine=score, dataset=dataset))
    run_job(job(data, folders["cross"], clean, engine=score, dataset=dataset))
    rows = table(out)
    assert [r["score"] for r in rows] == [r["score"] for r in table(clean)]
    assert [r["k"] for r in rows] == [r["k"] for r in pairs()]  # every row, in order, carried
    assert "response is null" in rows[1]["error"] and rows[1]["score"] is None
    hf = AutoModelForSequenceClassification.from_pretrained(folders["cross"]).eval()
    llm = LLM(str(folders["cross"]), task="score", **ENGINE)
    good = [(r, p) for r, p in zip(rows, pairs(), strict=True) if p["doc"] is not None]
    for row, p in good:
        ids = llm.tokenizer.hf(p["query"], p["doc"])["input_ids"]
        ref = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0])
        assert row["prompt_tokens"] == len(ids) and abs(row["score"] - float(ref)) < 1e-5
    embedder = AutoModel.from_pretrained(folders["embed"]).eval()
    run_job(job(data, folders["embed"], tmp_path / "cos", engine=score, dataset=dataset))

    def last_state(text: str) -> torch.Tensor:
        ids = llm.tokenizer.encode(text)  # the same tokenizer in both folders
        return embedder(torch.tensor([ids])).last_hidden_state[0, -1]

    for row, p in zip(table(tmp_path / "cos"), pairs(), strict=True):
        if p["doc"] is None:
            assert row["score"] is None and row["error"] is not None
            continue
        ref = torch.cosine_similarity(last_state(p["query"]), last_state(p["doc"]), dim=0)
        assert abs(row["score"] - float(ref)) < 1e-5


@torch.no_grad()
def test_pooling_dimensions_in_a_job_truncate_a_matryoshka_embedding(
    tmp_path: Path, folders
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records())
    out = tmp_path / "out"
    eight = PoolingConfig(dimensions=8)
    run_job(job(data, folders["matryoshka"], out, engine={"task": "embed"}, pooling=eight))
    kind = pq.read_schema(out / "completions.parquet").field("embedding").type
    assert kind.list_size == 8
    hf = AutoModel.from_pretrained(folders["matryoshka"]).eval()
    llm = LLM(str(folders["matryoshka"]), **ENGINE)
    for row in table(out):
        if row["error"] is not None:
            continue
        ids = llm.tokenizer.encode(row["prompt"])
        state = hf(torch.tensor([ids])).last_hidden_state[0, -1, :8]
        ref = torch.nn.functional.normalize(state, dim=-1)
        torch.testing.assert_close(torch.tensor(row["embedding"]), ref, atol=1e-5, rtol=0)
    raw = PoolingConfig(dimensions=8, normalize=False)  # another job: refused, not mixed in
    with pytest.raises(JobConfigError, match="changed: pooling.normalize: None -> False"):
        run_job(job(data, folders["matryoshka"], out, engine={"task": "embed"}, pooling=raw))


def test_pooling_jobs_refuse_what_they_cannot_do(tmp_path: Path, folders, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records())
    o = tmp_path / "o"
    with pytest.raises(JobConfigError, match="task=classify needs a score head"):
        run_job(job(data, folders["embed"], o, engine={"task": "classify"}))
    with pytest.raises(JobConfigError, match="dataset.response_column=<column>"):
        run_job(job(data, folders["cross"], o, engine={"task": "score"}))
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "a"}],
                                               "doc": "b"}])  # fmt: skip
    with pytest.raises(JobConfigError, match="pairs two plain texts"):
        run_job(job(chats, folders["cross"], o, engine={"task": "score"},
                    dataset={"messages_column": "messages", "response_column": "doc"}))  # fmt: skip
    with pytest.raises(JobConfigError, match="pooling.dimensions=8: this model was not trained"):
        run_job(job(data, folders["embed"], o, engine={"task": "embed"},
                    pooling=PoolingConfig(dimensions=8)))  # fmt: skip
    with pytest.raises(JobConfigError, match="pooling.dimensions=999 is not one the model"):
        run_job(job(data, folders["matryoshka"], o, engine={"task": "embed"},
                    pooling=PoolingConfig(dimensions=999)))  # fmt: skip
    with pytest.raises(JobConfigError, match="this job generates: drop the pooling"):
        run_job(job(data, tiny_folder, o, pooling=PoolingConfig(normalize=False)))
    assert not o.exists()  # every refusal before anything was written


def test_openai_batch_embeddings_lines_are_answered_in_openais_format(
    tmp_path: Path, folders
) -> None:
    """One text, several, token ids and lists of them: each input's embedding in `data`, in
    order, usage the inputs' tokens together; a line with one bad input fails as a whole."""
    llm = LLM(str(folders["embed"]), **ENGINE)
    ids = llm.tokenizer.encode("Paged attention")
    lines = [
        request("e1", "/v1/embeddings", input="Hello world"),
        request("c1", messages=ask("Hi"), max_tokens=3),  # a chat line: not for an embedder
        request(
            "e2", "/v1/embeddings", input=["A radix tree", "def f():"], encoding_format="float"
        ),
        request("e3", "/v1/embeddings", input="x", encoding_format="base64"),
        request("e4", "/v1/embeddings", input=ids),
        request("e5", "/v1/embeddings", input=[ids, ids[:2], ids]),
        request("e6", "/v1/embeddings", input=["fine", "word " * 300]),  # over max_model_len
    ]
    data = write_jsonl(tmp_path / "b.jsonl", lines)
    out = tmp_path / "out"
    run_job(job(data, folders["embed"], out, engine={"task": "embed"}))
    answers = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "batch_errors.jsonl").read_text().splitlines()]
    expected = {
        "e1": ["Hello world"],
        "e2": ["A radix tree", "def f():"],
        "e4": [ids],
        "e5": [ids, ids[:2], ids],
    }
    assert [a["custom_id"] for a in answers] == list(expected)
    for answer, inputs in zip(answers, expected.values(), strict=True):
        refs = llm.embed(inputs, use_tqdm=False)
        body = answer["response"]["body"]
        assert body["object"] == "list"
        assert [d["index"] for d in body["data"]] == list(range(len(inputs)))
        for got, ref in zip(body["data"], refs, strict=True):
            assert got["object"] == "embedding"
            torch.testing.assert_close(
                torch.tensor(got["embedding"]),
                torch.tensor(ref.outputs.embedding),
                atol=1e-6,
                rtol=0,
            )
        tokens = sum(len(r.prompt_token_ids) for r in refs)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [e["custom_id"] for e in errors] == ["c1", "e3", "e6"]
    assert "needs a job with a generation model" in errors[0]["error"]["message"]
    assert "encoding_format 'base64' is not supported" in errors[1]["error"]["message"]
    assert "input[1]: prompt has" in errors[2]["error"]["message"]


def test_a_pooling_job_with_a_bad_row_says_what_it_did(tmp_path: Path, folders) -> None:
    """Its summary counts rows embedded and prompt tokens read, not generation's finish reasons
    (a None reason sorted against "error" was a traceback), on the first run and on a rerun."""
    from batchpage.run import summary

    data = write_jsonl(tmp_path / "d.jsonl", records())
    out = tmp_path / "out"
    first = summary(run_job(job(data, folders["embed"], out, engine={"task": "embed"})))
    lines = first.splitlines()
    assert lines[0].startswith("6 rows (5 embedded, 0 resumed, 1 with errors)"), first
    tokens = sum(r["prompt_tokens"] for r in table(out) if r["error"] is None)
    assert lines[1].startswith(f"{tokens} prompt tokens read at "), first
    assert "finish reasons" not in first and "generated" not in first
    assert "first error: " in first and "prompt is empty" in first
    again = summary(run_job(job(data, folders["embed"], out, engine={"task": "embed"})))
    assert again.startswith("6 rows (0 embedded, 6 resumed, 1 with errors)"), again


def test_a_score_rows_empty_response_is_named_as_such(tmp_path: Path, folders) -> None:
    """Not "prompt is empty" (an embedder's second text), nor a cross-encoder scoring the prompt
    alone: the row's error says its response is empty; the other rows are scored."""
    rows = [{"query": "q one", "doc": "a doc"}, {"query": "q two", "doc": " "}]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    dataset = {"prompt_column": "query", "response_column": "doc"}
    for model in ("cross", "embed"):
        out = tmp_path / model
        run_job(job(data, folders[model], out, engine={"task": "score"}, dataset=dataset))
        first, second = table(out)
        assert first["error"] is None and first["score"] is not None
        assert second["error"].startswith("response is empty") and second["score"] is None
