"""A checkpoint batchpage cannot run stops the job in plan_job, before any weight is read, with
JobConfigError (which `python -m batchpage.run` turns into exit code 2) naming the fix."""

from __future__ import annotations

import json
import shutil

import pytest

from batchpage.data import DatasetSpec
from batchpage.job import JobConfigError, plan_job
from batchpage.job.config import JobConfig, ModelSpec


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"quantization_config": {"quant_method": "hqq"}}, "quantized with quant_method='hqq'"),
        ({"hidden_size": None}, "lacks hidden_size"),
        ({"model_type": "gemma3n_text"}, "unsupported model_type 'gemma3n_text'"),
    ],
)
def test_unsupported_checkpoints_fail_in_plan_job(tmp_path, tiny_folder, patch, message):
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"unreadable: no weight may be read")
    config = {**json.loads((folder / "config.json").read_text()), **patch}
    (folder / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    cfg = JobConfig(
        model=ModelSpec(path=str(folder)),
        dataset=DatasetSpec(path=str(data)),
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(JobConfigError, match=message):
        plan_job(cfg)
