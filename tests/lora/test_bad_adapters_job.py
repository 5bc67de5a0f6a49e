"""Bad adapters through a job and the API: a folder a row names is that row's error (naming the
adapter), one model.loras names stops the job before the model loads (exit 2 on the command
line), a request of LLM.generate fails alone; and `model.loras={a: /p/a, b: /p/b}` on the command
line is the same job as `+model.loras.a=/p/a +model.loras.b=/p/b`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from batchpage import LLM, LoRARequest, SamplingParams
from batchpage.job import run_job
from batchpage.job.plan import JobConfigError
from batchpage.run import compose_job
from tests.job.test_loop import job, never, write_jsonl
from tests.lora.peft_adapters import edit_config, make_adapter, poison

ROOT = Path(__file__).resolve().parents[2]
# The bad adapters, each with what its refusal says.
BAD = {
    "nan": "holds NaN values",
    "inf": "holds infinite values",
    "rank": "has rank 4, but adapter_config.json gives its module rank 8",
    "targets": "select none of the modules its tensors adapt",
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_folder) -> dict[str, Path]:
    """A good adapter ("good") and the bad ones of BAD, of the tiny model."""
    root = tmp_path_factory.mktemp("bad_adapters")
    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    for name in ["good", *BAD]:
        make_adapter(base, root / name, rank=4, seed=1)
    poison(root / "nan", math.nan)
    poison(root / "inf", -math.inf)
    edit_config(root / "rank", r=8)
    edit_config(root / "targets", target_modules=["qkv_proj"])
    return {p.name: p for p in root.iterdir()}


def lora_job(data: Path, model: Path, out: Path, loras: dict[str, Path]):
    cfg = job(
        data, model, out,
        dataset={"lora_column": "adapter", "chat_template": "false"},
        engine={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
    )  # fmt: skip
    cfg.model.loras = {name: str(path) for name, path in loras.items()}
    return cfg


@pytest.mark.parametrize("bad", list(BAD))
def test_a_row_naming_a_bad_adapter_folder_gets_the_error(tmp_path, tiny_folder, adapters, bad):
    folder = str(adapters[bad])
    rows = [{"prompt": "Hello world", "adapter": a} for a in (folder, None, "good", folder)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    result = run_job(lora_job(data, tiny_folder, tmp_path / "out", {"good": adapters["good"]}))
    table = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert result.errors == 2
    for row in (table[0], table[3]):
        assert f"LoRA adapter {folder!r} ({folder})" in row["error"] and BAD[bad] in row["error"]
        assert not row["completion"]
    assert table[1]["error"] is None and table[2]["error"] is None
    assert table[1]["completion"] and table[2]["completion"]


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_adapter_in_model_loras_stops_the_job_before_the_model_loads(
    tmp_path, tiny_folder, adapters, bad
):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "good"}])
    loras = {"good": adapters["good"], "x": adapters[bad]}
    with pytest.raises(JobConfigError, match=rf"^model\.loras\.x: LoRA adapter 'x' .*{BAD[bad]}"):
        run_job(lora_job(data, tiny_folder, tmp_path / "out", loras), llm_factory=never)


def test_a_model_loras_adapter_over_max_lora_rank_stops_the_job(tmp_path, tiny_folder):
    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    make_adapter(base, tmp_path / "wide", rank=16)  # the job's max_lora_rank is 8
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "wide"}])
    cfg = lora_job(data, tiny_folder, tmp_path / "out", {"wide": tmp_path / "wide"})
    with pytest.raises(
        JobConfigError, match=r"^model\.loras\.wide: .*rank 16 exceeds max_lora_rank=8"
    ):
        run_job(cfg, llm_factory=never)


def test_the_api_fails_only_the_bad_adapters_request(tiny_folder, adapters):
    llm = LLM(str(tiny_folder), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory=2**22, max_model_len=256)  # fmt: skip
    requests = [
        LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(["good", *BAD])
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[5, 9, 13]] * len(requests), params, lora_request=requests, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    for out, (name, said) in zip(outs[1:], BAD.items(), strict=True):
        assert f"LoRA adapter {name!r}" in out.error and said in out.error
        assert not out.outputs


def test_model_loras_as_one_dict_on_the_command_line(tmp_path, tiny_folder, adapters):
    good, nan = adapters["good"], adapters["nan"]
    whole = compose_job([f"model.loras={{a: {good}, b: {nan}}}", "dataset.lora_column=adapter"])
    keys = [f"+model.loras.a={good}", f"+model.loras.b={nan}", "dataset.lora_column=adapter"]
    assert whole == compose_job(keys)
    assert whole.model.loras == {"a": str(good), "b": str(nan)}
    # The same form through `python -m batchpage.run`: b's NaN weights are the job's error.
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "a"}])
    args = [
        f"dataset.path={data}", f"model.path={tiny_folder}", "dataset.lora_column=adapter",
        "engine.enable_lora=true", f"model.loras={{a: {good}, b: {nan}}}",
        f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path}/hydra",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.run", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "model.loras.b: LoRA adapter 'b'" in done.stderr and "NaN" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_loras_value_that_is_not_a_folder_is_the_jobs_error(tmp_path, tiny_folder):
    """`model.loras={a: {b: 1}}` composes (OmegaConf does not type a merged dict's values)."""
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "Hi", "adapter": "a"}])
    composed = compose_job(["model.loras={a: {b: 1}}"]).model.loras
    cfg = lora_job(data, tiny_folder, tmp_path / "out", {})
    cfg.model.loras = composed
    with pytest.raises(JobConfigError, match=r"model\.loras\.a must be an adapter folder"):
        run_job(cfg, llm_factory=never)
