"""dataset.lora_column through the job: each row runs the adapter it names (a name of
model.loras, or a folder), rows without one the base model, a row naming no adapter gets its
own error; completions equal LLM.generate with the same lora_request (which tests/lora checks
against PEFT); run.json counts rows per adapter; a changed adapter file is another job."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from batchpage import LLM, LoRARequest, SamplingParams
from batchpage.job import run_job
from batchpage.job.plan import JobConfigError
from tests.job.test_loop import job, never, write_jsonl
from tests.lora.peft_adapters import make_adapter

PROMPTS = ["Hello world", "The quick brown fox", "A radix tree", "def add(a, b):"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_folder) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    make_adapter(base, root / "a", rank=4, seed=1)
    make_adapter(base, root / "b", rank=8, seed=2)
    return root / "a", root / "b"


def lora_job(data: Path, model: Path, out: Path, a: Path, **changes):
    return job(
        data, model, out,
        dataset={"lora_column": "adapter", "chat_template": "false"},
        engine={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
        **changes,
    )  # fmt: skip


def test_rows_run_the_adapters_they_name(tmp_path, tiny_folder, adapters):
    a, b = adapters
    names = ["a", None, str(b), "a", "", "missing", str(b), None]
    rows = [{"prompt": PROMPTS[i % 4], "adapter": n} for i, n in enumerate(names)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = lora_job(data, tiny_folder, tmp_path / "out", a)
    cfg.model.loras = {"a": str(a)}
    result = run_job(cfg)
    assert result.errors == 1
    table = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert "neither a name of model.loras (a)" in table[5]["error"]
    llm = LLM(str(tiny_folder), dtype="float32", enable_lora=True, max_lora_rank=8,
              max_loras=2, kv_cache_memory=2**22, max_model_len=256)  # fmt: skip
    requests = {"a": LoRARequest("a", 1, str(a)), str(b): LoRARequest("b", 2, str(b))}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i, name in enumerate(names):
        if name == "missing":
            continue
        want = llm.generate(
            [PROMPTS[i % 4]], params, lora_request=requests.get(name or ""), use_tqdm=False
        )[0]
        assert table[i]["completion"] == want.outputs[0].text, (i, name)
    totals = json.loads((tmp_path / "out" / "run.json").read_text())["metrics"]
    assert totals["rows_by_adapter"] == {"a": 2, "base": 3, str(b): 2}
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert progress["rows_by_adapter"] == totals["rows_by_adapter"]
    # Base rows and adapter rows of one prompt differ: the adapters did run.
    assert table[0]["completion"] != table[4]["completion"]


def test_a_changed_adapter_is_another_job(tmp_path, tiny_folder, adapters):
    a, _ = adapters
    copy = tmp_path / "a"
    copy.mkdir()
    for f in a.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "a"}])
    cfg = lora_job(data, tiny_folder, tmp_path / "out", copy)
    cfg.model.loras = {"a": str(copy)}
    run_job(cfg)
    config = json.loads((copy / "adapter_config.json").read_text())
    config["lora_alpha"] = 3
    (copy / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(JobConfigError, match="loras"):
        run_job(cfg, llm_factory=never)


def test_what_is_refused_before_the_model_loads(tmp_path, tiny_folder, adapters):
    a, _ = adapters
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "a"}])
    cfg = lora_job(data, tiny_folder, tmp_path / "o1", a)
    cfg.engine.enable_lora = False
    with pytest.raises(JobConfigError, match="engine.enable_lora=true"):
        run_job(cfg, llm_factory=never)
    cfg = lora_job(data, tiny_folder, tmp_path / "o2", a)
    cfg.model.loras = {"a": str(tmp_path)}
    with pytest.raises(JobConfigError, match="adapter_config.json and adapter_model"):
        run_job(cfg, llm_factory=never)
    cfg = lora_job(data, tiny_folder, tmp_path / "o3", a)
    cfg.dataset.lora_column = "nope"
    with pytest.raises(JobConfigError, match="nope"):
        run_job(cfg, llm_factory=never)


def test_a_dry_run_counts_rows_naming_no_adapter_as_errors(tmp_path, tiny_folder, adapters):
    from batchpage.job.dry_run import dry_run

    a, _ = adapters
    rows = [{"prompt": "Hi", "adapter": n} for n in ("a", "missing", None)]
    cfg = lora_job(write_jsonl(tmp_path / "rows.jsonl", rows), tiny_folder, tmp_path / "o", a)
    cfg.model.loras = {"a": str(a)}
    report = dry_run(cfg)
    assert report["rows_to_generate"] == 2 and report["rows_with_errors"] == 1
