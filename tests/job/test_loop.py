"""The job loop on a tiny model: one output row per input row in order, bad rows, chats, resume,
config changes, errors before the model loads, seeds independent of windows, and the dry run."""

from __future__ import annotations

import dataclasses
import gc
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchpage import LLM
from batchpage.data import DatasetSpec
from batchpage.engine.config import EngineConfig
from batchpage.job import JobConfigError, run_job
from batchpage.job.config import (
    SAMPLING_FIELDS_NOT_IN_JOB,
    JobConfig,
    ModelSpec,
    PoolingConfig,
    SamplingConfig,
)
from batchpage.job.dry_run import dry_run, pack_tokens, shared_prefix_stats
from batchpage.output import work_dir
from batchpage.pooling_params import PoolingParams
from batchpage.sampling_params import SamplingParams

# What a clean rerun may legitimately change: cached_tokens depends on what ran alongside.
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def job(data: Path, model: Path, out: Path, **changes: Any) -> JobConfig:
    """A small greedy job; changes: dataset=/engine=/sampling= dicts or top-level fields."""
    dataset = {"window_rows": 3, **changes.pop("dataset", {})}
    engine = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256}
    sampling = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
    return JobConfig(
        model=ModelSpec(path=str(model)),
        dataset=DatasetSpec(path=str(data), **dataset),
        engine=EngineConfig(**{**engine, **changes.pop("engine", {})}),
        sampling=SamplingConfig(**{**sampling, **changes.pop("sampling", {})}),
        output_dir=str(out),
        progress=False,
        **{"flush_rows": 2, **changes},
    )


class Spy:
    """An LLM factory that counts model loads and the prompts sent to generate."""

    def __init__(self) -> None:
        self.loads = 0
        self.prompts = 0

    def __call__(self, model: str, **engine: Any) -> LLM:
        self.loads += 1
        llm = LLM(model, **engine)
        generate = llm.generate

        def counting(prompts: list, params: Any = None, **kwargs: Any) -> list:
            self.prompts += len(prompts)
            return generate(prompts, params, **kwargs)

        llm.generate = counting  # type: ignore[method-assign]
        return llm


def never(*_: Any, **__: Any) -> None:
    raise AssertionError("the model must not load")


def table(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "completions.parquet").to_pylist()


def prompts(count: int) -> list[dict[str, str]]:
    words = ["fox", "tree", "block", "cache", "world", "dog", "sum", "radix"]
    return [{"prompt": f"The quick brown {words[i % 8]} {i} jumps"} for i in range(count)]


def test_one_row_per_input_in_order_and_bad_rows_do_not_stop_the_job(tmp_path, tiny_folder) -> None:
    records = [
        # JSONL columns are the first record's keys, so it names both override columns.
        {"prompt": "Hello world", "max_tokens": 3, "temperature": None},
        {"prompt": None},
        {"prompt": ""},
        {"prompt": 42},
        {"prompt": "The quick brown fox " * 80},  # over max_model_len=256
        {"prompt": "A radix tree", "temperature": -1},  # bad per-row value
        {"prompt": "Paged attention", "max_tokens": 1},  # valid alone, < the job's min_tokens
        "{not json",
        {"prompt": "def add(a, b):"},
        {"prompt": "Hello world! How are you today?"},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    result = run_job(job(data, tiny_folder, tmp_path / "out", sampling={"min_tokens": 2}))
    rows = table(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(len(records)))
    assert [r["id"] for r in rows] == [str(i) for i in range(len(records))]
    failed = [i for i, r in enumerate(rows) if r["error"] is not None]
    assert failed == [1, 2, 3, 4, 5, 6, 7]
    assert all(rows[i]["completion"] is None for i in failed)
    assert "max_model_len" in rows[4]["error"] and rows[4]["prompt_tokens"] > 256
    assert "temperature" in rows[5]["error"]
    assert "min_tokens" in rows[6]["error"]
    assert rows[0]["completion_tokens"] == 3  # the row's max_tokens override
    assert rows[8]["completion_tokens"] == 5 and rows[8]["finish_reason"] == "length"
    assert rows[8]["prompt"] == "def add(a, b):"  # plain prompts are sent as raw text
    assert result.rows == 10 and result.errors == 7 and result.rows_generated == 4
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["metrics"]["requests"] == 3  # the too-long row fails inside the engine
    assert run["metrics"]["generated_tokens"] == 3 + 5 + 5
    assert run["config"]["job"]["sampling"]["min_tokens"] == 2
    assert run["versions"]["batchpage"]
    # The job's last state, where run.json says: every row done, the 7 errors counted.
    state = json.loads((tmp_path / "out" / run["config"]["progress_file"]).read_text())
    assert (state["stage"], state["rows_total"], state["rows_done"]) == ("done", 10, 10)
    assert state["rows_failed"] == 7 and "executor" not in state
    assert gc.get_freeze_count() == 0  # the objects frozen while the windows ran, handed back


def test_chats_and_system_prompts_go_through_the_chat_template(
    tmp_path, tiny_folder, tokenizer
) -> None:
    chat = [{"role": "user", "content": "Hello world"}]
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}, {"messages": "oops"}])
    run_job(job(data, tiny_folder, tmp_path / "a", dataset={"messages_column": "messages"}))
    rows = table(tmp_path / "a")
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert rows[0]["prompt"].startswith("<|im_start|>user\nHello world")
    assert rows[0]["prompt_tokens"] == len(ids) and rows[0]["error"] is None
    assert "messages" in rows[1]["error"]

    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello world"}])
    run_job(job(plain, tiny_folder, tmp_path / "b", dataset={"system_prompt": "Be brief."}))
    prompt = table(tmp_path / "b")[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello")


def test_resume_generates_only_missing_rows_and_never_duplicates(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(10))
    out = tmp_path / "out"
    first = Spy()
    run_job(job(data, tiny_folder, out, dataset={"limit": 4}), first)  # a partial run
    assert first.prompts == 4
    second = Spy()
    result = run_job(job(data, tiny_folder, out), second)  # the limit is not in the job identity
    assert second.prompts == 6 and (result.rows_resumed, result.rows_generated) == (4, 6)
    rows = table(out)
    assert [r["index"] for r in rows] == list(range(10))
    third = Spy()
    run_job(job(data, tiny_folder, out), third)
    assert third.loads == 0  # all done: the model is not even loaded
    report = json.loads((out / "run.json").read_text())
    # Every run that generated is in the history; the totals add them up.
    assert [r["rows_generated"] for r in report["runs"]] == [4, 6]
    assert [r["metrics"]["requests"] for r in report["runs"]] == [4, 6]
    assert report["metrics"]["rows_generated"] == 10 == report["metrics"]["requests"]
    assert report["metrics"]["runs"] == 2 and report["metrics"]["rows"] == 10
    assert report["config"]["resolved"]["dtype"] == "float32"
    assert report["config"]["resolved"]["attention_backend"] in (
        "CpuPagedAttention",
        "TorchPagedAttention",
    )
    run_job(job(data, tiny_folder, tmp_path / "clean"))
    clean = table(tmp_path / "clean")
    assert [{k: r[k] for k in COMPARED} for r in rows] == [
        {k: r[k] for k in COMPARED} for r in clean
    ]


def test_a_changed_config_is_refused_unless_overwrite(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(2))
    out = tmp_path / "out"
    run_job(job(data, tiny_folder, out))
    with pytest.raises(JobConfigError, match=r"changed: sampling.max_tokens: 5 -> 6.*overwrite"):
        run_job(job(data, tiny_folder, out, sampling={"max_tokens": 6}), never)
    with pytest.raises(JobConfigError, match=r"changed: dataset.system_prompt: None -> 'Be'"):
        run_job(job(data, tiny_folder, out, dataset={"system_prompt": "Be"}), never)
    # An edit in the middle of the input, same size: every byte is hashed, so it is seen.
    text = data.read_text()
    middle = len(text) // 2
    data.write_text(text[:middle] + ("X" if text[middle] != "X" else "Y") + text[middle + 1 :])
    with pytest.raises(JobConfigError, match=rf"changed: dataset.files.{re.escape(str(data))}"):
        run_job(job(data, tiny_folder, out), never)
    data.write_text(text)
    spy = Spy()
    run_job(job(data, tiny_folder, out, engine={"block_size": 8}), spy)  # speed knobs: same job
    assert spy.loads == 0
    result = run_job(job(data, tiny_folder, out, sampling={"max_tokens": 6}, overwrite=True))
    assert result.rows_generated == 2
    assert all(r["completion_tokens"] == 6 for r in table(out))


def test_user_errors_fail_fast_before_the_model_loads(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi", "answer": "yo"}])
    good = write_jsonl(tmp_path / "g.jsonl", prompts(1))
    out = tmp_path / "out"
    cases = [
        (job(data, tiny_folder, out), r"'prompt' not found .* its columns are: question, answer"),
        (job(tmp_path / "missing.jsonl", tiny_folder, out), "no such file or folder"),
        (job(Path("nope"), tiny_folder, out), "bundled datasets are: demo"),
        (job(good, tmp_path / "no-model", out), "no such file or folder"),
        (job(good, tiny_folder, out, engine={"kv_cache_memory": 4096}), "raise kv_cache_memory"),
        (job(good, tiny_folder, out, engine={"max_model_len": 4096}), "max_position_embeddings"),
        (job(good, tiny_folder, out, sampling={"temperature": -1.0}), "temperature must be >= 0"),
    ]
    for cfg, message in cases:
        started = time.perf_counter()
        with pytest.raises(JobConfigError, match=message):
            run_job(cfg, never)
        assert time.perf_counter() - started < 2.0
    assert not out.exists()  # nothing was written either


def test_random_samples_do_not_depend_on_windows_or_resume(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(5))
    sampling = {"temperature": 1.0, "n": 2, "seed": 7, "max_tokens": 4}
    run_job(job(data, tiny_folder, tmp_path / "a", sampling=sampling, dataset={"window_rows": 5}))
    run_job(job(data, tiny_folder, tmp_path / "b", sampling=sampling, dataset={"window_rows": 1}))
    a, b = table(tmp_path / "a"), table(tmp_path / "b")
    assert all(len(r["completion"]) == 2 and len(r["finish_reason"]) == 2 for r in a)
    assert [r["completion"] for r in a] == [r["completion"] for r in b]
    assert len({c for r in a for c in r["completion"]}) > 5  # samples differ


def test_dry_run_reports_the_jobs_shape_without_output(tmp_path, tiny_folder, tokenizer) -> None:
    shared = "The quick brown fox jumps over the lazy dog. " * 2
    texts = [shared + "Hello world", shared + "A radix tree", "def add(a, b):"]
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": t} for t in texts] + [{"prompt": None}])
    report = dry_run(job(data, tiny_folder, tmp_path / "out", engine={"block_size": 4}))
    ids = [tokenizer.encode(t) for t in texts]
    common = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1], strict=False)) if x != y)
    assert report["rows"] == 4 and report["rows_to_generate"] == 3
    assert report["rows_with_errors"] == 1
    assert report["prompt_tokens"] == sum(map(len, ids))
    assert report["longest_shared_prefix"] == common
    assert report["shared_prefix_tokens"] == 2 * common
    assert report["kv_blocks_longest_sequence"] == -(-(max(map(len, ids)) + 5) // 4)
    expected = sum(-(-(len(x) + 5) // 4) for x in ids)
    assert report["kv_blocks_all_rows_no_sharing"] == expected
    assert report["kv_blocks_all_rows_shared"] == expected - common // 4
    assert report["kv_blocks_pool"] > 0
    assert not (tmp_path / "out").exists()


def test_shared_prefix_stats_match_brute_force() -> None:
    rng = random.Random(0)
    stems = [[rng.randrange(300) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    lists = [rng.choice(stems)[: rng.randrange(9)] + [rng.randrange(3)] for _ in range(40)]
    lists += [lists[0]]  # an exact duplicate shares all of itself

    def lcp(a: list[int], b: list[int]) -> int:
        return next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

    got = shared_prefix_stats([pack_tokens(x) for x in lists], block_size=2)
    best = [max(lcp(a, b) for j, b in enumerate(lists) if j != i) for i, a in enumerate(lists)]
    prefixes = {tuple(x[:k]) for x in lists for k in range(1, len(x) + 1)}
    assert got.total_tokens == sum(map(len, lists))
    assert got.shared_tokens == sum(best)
    assert got.longest_shared_prefix == max(best)
    assert got.unique_tokens == len(prefixes)  # the size of a trie of the prompts
    assert pack_tokens([1, 70000]) < pack_tokens([2]) < pack_tokens([2, 0])


def test_sampling_config_mirrors_sampling_params() -> None:
    ours = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert set(theirs) - set(ours) == SAMPLING_FIELDS_NOT_IN_JOB
    # structured_outputs is a node of its own in the config (Hydra cannot set keys under None);
    # left empty it means no constraint, as None does in SamplingParams.
    del ours["structured_outputs"]
    assert theirs.pop("structured_outputs") is None
    assert SamplingConfig().to_params().structured_outputs is None
    assert {k: theirs[k] for k in ours} == ours


def test_pooling_config_mirrors_pooling_params() -> None:
    ours = {f.name: f.default for f in dataclasses.fields(PoolingConfig)}
    assert ours == {f.name: f.default for f in dataclasses.fields(PoolingParams)}
    assert PoolingConfig(dimensions=8).to_params() == PoolingParams(dimensions=8)
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1"):
        PoolingConfig(dimensions=0).to_params()
    assert SamplingConfig(temperature=0.5, stop=["\n"]).to_params().stop == ["\n"]


def test_dry_run_block_sharing_equals_a_radix_tree() -> None:
    """The dry run's shared-block count is what the engine's radix cache would lend."""
    from batchpage.cache.block_pool import BlockPool
    from batchpage.cache.radix_cache import RadixCache

    rng = random.Random(1)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    lists = [rng.choice(stems)[: rng.randrange(30)] + [rng.randrange(5)] for _ in range(60)]
    for bs in (1, 2, 4):
        pool = BlockPool(sum(len(x) // bs for x in lists) + 1)
        tree = RadixCache(pool, bs)
        for x in lists:
            full = len(x) // bs
            own = pool.allocate(full)
            tree.insert(x[: full * bs], own)
            pool.release(own)
        tree.check_integrity()
        total_full = sum(len(x) // bs for x in lists)
        got = shared_prefix_stats([pack_tokens(x) for x in lists], block_size=bs)
        assert got.shared_blocks == total_full - tree.cached_blocks


@pytest.mark.parametrize(
    ("data", "out", "what"),
    [
        ("D", "D", "folder"),  # would read its own job.json and shards as input
        ("D", "D/out", "folder"),
        ("D/sub", "D", "folder"),  # holds the input folder
        ("D/*.jsonl", "D", "folder"),  # a glob's folder
        ("D/a.jsonl", "D", "file"),  # could write over it
    ],
)
def test_an_output_dir_that_overlaps_the_input_is_refused_before_loading(
    tmp_path: Path, tiny_folder: Path, monkeypatch, data: str, out: str, what: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for folder in ("D", "D/sub"):
        (tmp_path / folder).mkdir(parents=True)
        write_jsonl(tmp_path / folder / "a.jsonl", [{"prompt": "hi"}, {"prompt": "yo"}])
    spy = Spy()
    with pytest.raises(JobConfigError, match=f"output_dir={out} overlaps the input {what}"):
        run_job(job(Path(data), tiny_folder, Path(out)), llm_factory=spy)
    assert spy.loads == 0 and not work_dir(tmp_path / out).exists()
    # Beside the input, the same job runs.
    run_job(job(Path(data), tiny_folder, tmp_path / "elsewhere"), llm_factory=spy)
    assert len(table(tmp_path / "elsewhere")) == 2 * (1 + (data == "D"))
