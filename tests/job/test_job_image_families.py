"""Images through the job for the families beside LLaVA (issue #72): Idefics3 / SmolVLM (an
image split into tiles), Qwen2.5-VL (M-RoPE, an image's token count from its size) and Gemma 3
(image spans attended both ways, its blank lines merged with the prompt's), each a tiny random
checkpoint with real photographs. An image column
of relative paths, a list per row and a bad image among them, and an OpenAI Batch file with
image parts: every row equals the API's answer for the same prompt and images (the API is
checked against transformers in tests/test_llm_idefics3.py, tests/test_llm_qwen2_5_vl.py and
tests/test_llm_gemma3.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchpage import LLM
from batchpage.job import run_job
from batchpage.output.files import BATCH_ERRORS_FILE, BATCH_OUTPUT_FILE
from tests.gemma3_vl_factory import gemma3_vl_folder
from tests.job.test_job_images import (
    ENGINE,
    PARAMS,
    batch_line,
    check_rows,
    data_url,
    image_part,
    images_of,
    photos,  # noqa: F401 (a fixture)
)
from tests.job.test_loop import job, table, write_jsonl
from tests.qwen_vl_factory import qwen_folder
from tests.vision_factory import idefics3_folder

PLACEHOLDER = {
    "smolvlm": "<image>",
    "qwen": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma": "<start_of_image>",
}
MAKE = {
    "smolvlm": lambda folder: idefics3_folder(folder, "smolvlm"),
    "qwen": qwen_folder,
    "gemma": gemma3_vl_folder,
}


@pytest.fixture(scope="module", params=list(MAKE))
def family(request, tmp_path_factory) -> tuple[str, Path, LLM]:
    """(its name, its folder, the API on it with the job's engine options)."""
    folder, _, _ = MAKE[request.param](tmp_path_factory.mktemp(request.param))
    api = LLM(str(folder), dtype="float32", kv_cache_memory=2**23, max_model_len=256, **ENGINE)
    return request.param, folder, api


def test_an_image_column_of_relative_paths(tmp_path, family, photos) -> None:  # noqa: F811
    name, folder, api = family
    image = PLACEHOLDER[name]
    rows_in: list[tuple[str, Any]] = [
        (f"{image}\nwhat is this", "img/d.png"),
        (f"the cat {image} and {image}?", ["img/d.png", "img/b.png"]),
        ("no image here", None),
        (f"{image}\ncut", "img/cut.png"),
        (f"{image}\nwhere", "img/b.png"),
    ]
    good = [0, 1, 2, 4]
    data = photos["folder"] / f"rows-{name}.jsonl"
    write_jsonl(data, [{"prompt": p, "image": im} for p, im in rows_in])
    dataset = {"image_column": "image"}
    engine = {**ENGINE, "kv_cache_memory": 2**23, "max_model_len": 256}
    result = run_job(job(data, folder, tmp_path / "out", dataset=dataset, engine=engine))
    rows = table(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(len(rows_in)))
    prompts = []
    for i in good:
        text, names = rows_in[i]
        images = images_of(photos, names) if names else []
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    refs = api.generate(prompts, PARAMS, use_tqdm=False)
    check_rows(rows, dict(zip(good, refs, strict=True)))
    assert "truncated" in rows[3]["error"]
    assert result.errors == 1


def test_an_openai_batch_file_with_image_parts(tmp_path, family, photos) -> None:  # noqa: F811
    name, folder, api = family
    b, d = photos["images"]["b.png"], photos["images"]["d.png"]

    line, url = batch_line, image_part
    ask = {"type": "text", "text": "what is it"}
    lines = [line("r0", [url(data_url(b)), ask]), line("r1", [url("img/d.png"), ask]),
             line("r2", [url("img/text.png"), ask])]  # fmt: skip
    data = write_jsonl(photos["folder"] / f"requests-{name}.jsonl", lines)
    engine = {**ENGINE, "kv_cache_memory": 2**23, "max_model_len": 256}
    run_job(job(data, folder, tmp_path / "out", engine=engine, sampling={"ignore_eos": True}))
    refs = api.chat(
        [
            [{"role": "user", "content": [url(data_url(b)), ask]}],
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": d}, ask]}],
        ],
        PARAMS,
        use_tqdm=False,
    )
    out = tmp_path / "out"
    answered = [json.loads(x) for x in (out / BATCH_OUTPUT_FILE).read_text().splitlines()]
    errors = [json.loads(x) for x in (out / BATCH_ERRORS_FILE).read_text().splitlines()]
    by_id = {a["custom_id"]: a for a in answered}
    for cid, ref in zip(["r0", "r1"], refs, strict=True):
        assert ref.error is None, ref.error
        body = by_id[cid]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == ref.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert [e["custom_id"] for e in errors] == ["r2"]
    assert "image 0" in errors[0]["error"]["message"]
