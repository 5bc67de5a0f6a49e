"""An OpenAI Batch file through the job: batch_output.jsonl answers every good request exactly as
LLM.chat / LLM.generate do with the same parameters, batch_errors.jsonl has every bad line, one
line per request in input order; and kill -9 then resume writes the same files."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchpage import LLM, SamplingParams, StructuredOutputsParams
from batchpage.job import run_job
from batchpage.output import work_dir
from batchpage.run import compose_job
from tests.job.test_loop import job, write_jsonl
from tests.job.test_run_cli import cli, tiny_job_args

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENGINE = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256}


def request(custom_id: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "gpt-x", **body},
    }


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


# (request line, the reference call: chat or generate, its prompt, its SamplingParams)
CASES: list[tuple[Any, str | None, Any, SamplingParams | None]] = [
    (
        request("c-plain", messages=ask("Hello world"), max_tokens=4),
        "chat", [{"role": "user", "content": "Hello world"}],
        SamplingParams(temperature=0, max_tokens=4),
    ),
    (
        request("c-n2", messages=ask("A radix tree"), n=2, temperature=0.9, seed=7, top_p=0.9,
                max_completion_tokens=3, stop=["zz"]),
        "chat", [{"role": "user", "content": "A radix tree"}],
        SamplingParams(n=2, temperature=0.9, seed=7, top_p=0.9, max_tokens=3, stop=["zz"]),
    ),
    ("{broken json", None, None, None),
    (
        request("p-logprobs", COMPLETIONS, prompt="def add(a, b):", max_tokens=3, logprobs=2,
                presence_penalty=0.5, frequency_penalty=0.25),
        "generate", "def add(a, b):",
        SamplingParams(temperature=0, max_tokens=3, logprobs=2, presence_penalty=0.5,
                       frequency_penalty=0.25),
    ),
    (request("bad-url", "/v1/embeddings", input="x"), None, None, None),
    (
        request("c-logprobs", messages=ask("Paged attention"), max_tokens=3, logprobs=True,
                top_logprobs=3),
        "chat", [{"role": "user", "content": "Paged attention"}],
        SamplingParams(temperature=0, max_tokens=3, logprobs=3),
    ),
    (request("no-prompt", max_tokens=3), None, None, None),
    (request("bad-value", messages=ask("x"), temperature=-2), None, None, None),
    (
        request("c-json", messages=ask("Give JSON"), max_tokens=6,
                response_format={"type": "json_object"}),
        "chat", [{"role": "user", "content": "Give JSON"}],
        SamplingParams(temperature=0, max_tokens=6,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
    ),
]  # fmt: skip


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tiny_folder: Path) -> tuple[LLM, list[Any]]:
    llm = LLM(str(tiny_folder), **ENGINE)
    outs = []
    for _, kind, prompt, params in CASES:
        if kind == "chat":
            outs.append(llm.chat(prompt, params, use_tqdm=False)[0])
        elif kind == "generate":
            outs.append(llm.generate(prompt, params, use_tqdm=False)[0])
        else:
            outs.append(None)
    return llm, outs


def test_batch_files_answer_like_llm_chat_and_generate(tmp_path, tiny_folder, reference) -> None:
    llm, refs = reference
    data = write_jsonl(tmp_path / "requests.jsonl", [c[0] for c in CASES])
    out = tmp_path / "out"
    cfg = job(data, tiny_folder, out, sampling={"ignore_eos": False, "max_tokens": 16})
    result = run_job(cfg)
    assert result.rows == len(CASES) and result.errors == 4
    answered, failed = (
        read_lines(out / "batch_output.jsonl"),
        read_lines(out / "batch_errors.jsonl"),
    )
    good = [c[0]["custom_id"] for c, r in zip(CASES, refs, strict=True) if r is not None]
    assert [a["custom_id"] for a in answered] == good  # input order
    assert [f["custom_id"] for f in failed] == [None, "bad-url", "no-prompt", "bad-value"]
    assert "not valid JSON" in failed[0]["error"]["message"]
    assert "/v1/embeddings needs a job with engine.task=embed" in failed[1]["error"]["message"]
    assert "needs messages" in failed[2]["error"]["message"]
    assert "temperature" in failed[3]["error"]["message"]
    assert all(f["response"] is None and f["error"]["code"] for f in failed)
    ids = [line["id"] for line in answered + failed]
    assert len(set(ids)) == len(CASES) and all(i.startswith("batch_req_") for i in ids)

    by_id = {a["custom_id"]: a for a in answered}
    for (req, kind, _, params), ref in zip(CASES, refs, strict=True):
        if ref is None:
            continue
        line = by_id[req["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == ("chat.completion" if kind == "chat" else "text_completion")
        assert body["model"] == tiny_folder.name  # the job's model, not the line's
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(params.n))
        texts = [c["message"]["content"] if kind == "chat" else c["text"] for c in choices]
        assert texts == [o.text for o in ref.outputs]
        assert [c["finish_reason"] for c in choices] == [o.finish_reason for o in ref.outputs]
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
        assert usage["completion_tokens"] == sum(len(o.token_ids) for o in ref.outputs)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if params.logprobs is None:
            assert all(c["logprobs"] is None for c in choices)
            continue
        check_logprobs(choices[0]["logprobs"], ref.outputs[0], params.logprobs, kind, llm)

    table = pq.read_table(out / "completions.parquet")
    assert table.column_names[-2:] == ["url", "logprobs"]
    assert table.column("id").to_pylist()[:2] == ["c-plain", "c-n2"]


def check_logprobs(got: dict[str, Any], ref: Any, top: int, kind: str, llm: LLM) -> None:
    """OpenAI's shapes, with the engine's logprobs: the chosen token's and the top-k."""

    def text(token_id: int) -> str:
        return llm.tokenizer.decode([token_id], skip_special_tokens=False)

    # Batches differ from the reference's, so logprobs agree to float error (pytest.approx).
    want_tokens = [text(t) for t in ref.token_ids]
    want_lps = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    want_top = [sorted(lp.values(), reverse=True)[:top] for lp in ref.logprobs]
    if kind == "chat":
        content = got["content"]
        assert [e["token"] for e in content] == want_tokens
        assert [e["logprob"] for e in content] == pytest.approx(want_lps)
        tops = [[t["logprob"] for t in e["top_logprobs"]] for e in content]
        assert [x for t in tops for x in t] == pytest.approx([x for t in want_top for x in t])
        assert [len(t) for t in tops] == [top] * len(tops)
        assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    else:
        assert got["tokens"] == want_tokens
        assert got["token_logprobs"] == pytest.approx(want_lps)
        tops = [sorted(d.values(), reverse=True) for d in got["top_logprobs"]]
        # A dict by token text: two ids of the same text would share a key (not here).
        assert [x for t in tops for x in t] == pytest.approx([x for t in want_top for x in t])
        assert got["text_offset"][0] == 0 and len(got["text_offset"]) == len(want_tokens)


@pytest.mark.slow
def test_sigkill_then_resume_writes_the_same_batch_files(tmp_path, tiny_folder) -> None:
    lines = [
        request(f"r{i}", messages=ask(f"The quick brown fox {i}"), max_tokens=8) for i in range(40)
    ]
    data = write_jsonl(tmp_path / "requests.jsonl", [*lines[:5], "{bad", *lines[5:]])
    out = tmp_path / "out"
    args = [
        *tiny_job_args(data, tiny_folder, out),
        "dataset.window_rows=4",
        "flush_rows=2",
        "sampling.temperature=0",
        "sampling.max_tokens=8",
    ]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = cli(args, tmp_path, stderr=err)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not list(work_dir(out).glob("shard-*.parquet")):
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the job ended before the kill"
    assert not (out / "batch_output.jsonl").exists()  # written only when the job finishes
    proc = cli(args, tmp_path, stderr=subprocess.PIPE)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr

    clean = compose_job(args)
    clean.output_dir = str(tmp_path / "clean")
    run_job(clean)
    for name in ("batch_output.jsonl", "batch_errors.jsonl"):
        resumed, fresh = read_lines(out / name), read_lines(tmp_path / "clean" / name)
        for line in resumed + fresh:
            if line["response"]:
                line["response"]["body"].pop("created")
                line["response"]["body"]["usage"]["prompt_tokens_details"].pop("cached_tokens")
        assert resumed == fresh
    assert len(read_lines(out / "batch_output.jsonl")) == 40
