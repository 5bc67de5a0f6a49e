"""Images through the job (issue #72) on a tiny random LLaVA with real photographs: an image
column of relative paths (JSONL, Parquet), of bytes (a binary column, HF's {bytes, path}
struct), a list per row; image parts in a messages column and in OpenAI Batch bodies. Every row
equals the API's answer for the same prompt and images (LLM.generate with multi_modal_data, or
LLM.chat with image parts; the API is checked against transformers in tests/test_llm_images.py),
bad images are their rows' errors while the other rows complete, a missing image column stops
the job before the model loads, and a resumed job duplicates nothing."""

from __future__ import annotations

import base64
import gc
import io
import json
import subprocess
import weakref
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage import LLM, SamplingParams
from batchpage.data.images import load_image
from batchpage.job import JobConfigError, row_images, run_job
from batchpage.job.dry_run import dry_run
from batchpage.job.row_images import image_order
from batchpage.output.files import BATCH_ERRORS_FILE, BATCH_OUTPUT_FILE
from tests.data.test_url_inputs import jsonl, put
from tests.job.test_loop import Spy, job, never, table, write_jsonl
from tests.job.test_run_cli import cli, tiny_job_args
from tests.vision_factory import llava_folder, sample_images

MAX_NEW = 5
# The job's engine (tests.job.test_loop.job) with a step budget that splits images over chunks.
ENGINE = {"max_num_batched_tokens": 32, "max_num_seqs": 8}
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    folder, _, _ = llava_folder(tmp_path_factory.mktemp("llava"))
    return folder


@pytest.fixture(scope="module")
def reference(llava) -> LLM:
    """The API on the same folder with the job's engine options (tests.job.test_loop.job)."""
    return LLM(str(llava), dtype="float32", kv_cache_memory=2**22, max_model_len=256, **ENGINE)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Any]:
    """PNG files of the sample photographs (a.png .. d.png) under <data>/img/, with the data
    folder they are relative to, and broken files beside them."""
    data = tmp_path_factory.mktemp("data")
    (data / "img").mkdir()
    images = sample_images()  # 512x512, 451x300, 600x400, 71x47
    names = ["a.png", "b.png", "c.png", "d.png"]
    for name, image in zip(names, images, strict=True):
        image.save(data / "img" / name)
    png = (data / "img" / "b.png").read_bytes()
    (data / "img" / "cut.png").write_bytes(png[: len(png) // 2])  # truncated
    (data / "img" / "text.png").write_text("not an image at all")
    return {"folder": data, "names": names, "images": dict(zip(names, images, strict=True))}


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_part(u: str, detail: str | None = None) -> dict[str, Any]:
    """An OpenAI image_url content part."""
    url: dict[str, Any] = {"url": u} if detail is None else {"url": u, "detail": detail}
    return {"type": "image_url", "image_url": url}


def batch_line(cid: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """An OpenAI Batch request line: one user turn of `parts`, 5 tokens out."""
    body = {"model": "x", "messages": [{"role": "user", "content": parts}], "max_tokens": 5}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def images_of(photos: dict[str, Any], names: str | list[str]) -> list[Any]:
    names = [names] if isinstance(names, str) else names
    return [photos["images"][n.removeprefix("img/")] for n in names]


def check_rows(rows: list[dict[str, Any]], refs: dict[int, Any]) -> None:
    """Rows at refs' indices equal the reference outputs (text, prompt tokens); others failed."""
    for i, row in enumerate(rows):
        if i not in refs:
            assert row["error"] is not None and row["completion"] is None, row
            continue
        ref = refs[i]
        assert ref.error is None, ref.error
        assert row["error"] is None, row["error"]
        assert row["completion"] == ref.outputs[0].text, i
        assert row["prompt_tokens"] == len(ref.prompt_token_ids), i
        assert row["completion_tokens"] == MAX_NEW


# (prompt, image column value): raw prompts hold their <image> placeholders themselves.
PATH_ROWS: list[tuple[str, Any]] = [
    ("<image>\nwhat is this", "img/b.png"),
    ("the cat <image> and <image>?", ["img/d.png", "img/b.png"]),  # a list per row
    ("no image here", None),
    ("<image>\nwhere", "img/d.png"),
    ("<image>\nwhy", "img/b.png"),  # the same picture again, in another window
    ("<image>\nmissing", "img/nowhere.png"),
    ("<image>\ncut", "img/cut.png"),
    ("<image> and <image>", ["img/d.png", "img/text.png"]),  # its image 1 is no image
    ("<image>\ntoo big", "img/a.png"),  # 512 x 512: over dataset.max_image_pixels
    ("one placeholder, no image here", "img/d.png"),  # the engine's error: 0 placeholders
    ("<image>\nwho", "img/d.png"),
]
GOOD = [0, 1, 2, 3, 4, 10]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_image_column_of_relative_paths(tmp_path, llava, reference, photos, fmt) -> None:
    folder = photos["folder"]
    records = [{"prompt": p, "image": im} for p, im in PATH_ROWS]
    data = folder / f"rows.{fmt}"
    if fmt == "jsonl":
        write_jsonl(data, records)
    else:  # a list<string> column: one image is a list of one
        for r in records:
            r["image"] = [r["image"]] if isinstance(r["image"], str) else r["image"]
        pq.write_table(pa.Table.from_pylist(records), data)
    # The engine's own bound is below the photographs': the job's dataset.max_image_pixels is
    # the one that counts (the LLM it makes takes what that allowed).
    dataset = {"image_column": "image", "max_image_pixels": 200_000}
    engine = {**ENGINE, "max_image_pixels": 100 * 100}
    cfg = job(data, llava, tmp_path / "out", dataset=dataset, engine=engine)
    result = run_job(cfg)
    rows = table(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(len(PATH_ROWS)))
    assert "image" not in rows[0]  # consumed, as the prompt is
    prompts = []
    for i in GOOD:
        text, names = PATH_ROWS[i]
        images = images_of(photos, names) if names else []
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    refs = reference.generate(prompts, PARAMS, use_tqdm=False)
    check_rows(rows, dict(zip(GOOD, refs, strict=True)))
    assert rows[5]["error"].startswith("image 0: image file ") and "not found" in rows[5]["error"]
    assert "truncated" in rows[6]["error"]
    assert rows[7]["error"].startswith("image 1: ") and "not an image" in rows[7]["error"]
    assert "dataset.max_image_pixels=200000" in rows[8]["error"]
    assert "0 image placeholders" in rows[9]["error"] and "1 images" in rows[9]["error"]
    assert rows[2]["prompt"] == "no image here" and rows[0]["prompt"] == PATH_ROWS[0][0]
    assert result.errors == len(PATH_ROWS) - len(GOOD)


def test_an_image_column_of_bytes_through_the_chat_template(
    tmp_path, llava, reference, photos
) -> None:
    """A Parquet binary column, and HF datasets' {bytes, path} struct (bytes, or a path beside
    the file), each row a user turn with its images before the prompt's text."""
    b, d = photos["images"]["b.png"], photos["images"]["d.png"]
    questions = ["what is it", "where is it", "and now", "two of them", "the path one"]
    binary = pa.table({
        "q": questions[:4],
        "pic": pa.array([png_bytes(b), png_bytes(d), None, png_bytes(b)], pa.binary()),
    })  # fmt: skip
    cell = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    structs = pa.table({
        "q": questions,
        "pic": pa.array([
            [{"bytes": png_bytes(b), "path": "b.png"}],
            [{"bytes": png_bytes(d), "path": None}],
            [],
            [{"bytes": png_bytes(d), "path": None}, {"bytes": png_bytes(b), "path": None}],
            [{"bytes": None, "path": "img/d.png"}],
        ], pa.list_(cell)),
    })  # fmt: skip
    picked = {"binary": [[b], [d], [], [b]], "structs": [[b], [d], [], [d, b], [d]]}
    for name, data in (("binary", binary), ("structs", structs)):
        path = photos["folder"] / f"{name}.parquet"
        pq.write_table(data, path)
        dataset = {"prompt_column": "q", "image_column": "pic", "chat_template": "true"}
        run_job(job(path, llava, tmp_path / name, dataset=dataset, engine=ENGINE))
        rows = table(tmp_path / name)
        chats = []
        for q, images in zip(questions, picked[name], strict=False):
            parts = [{"type": "image_pil", "image_pil": im} for im in images]
            chats.append([{"role": "user", "content": [*parts, {"type": "text", "text": q}]}])
        refs = reference.chat(chats, PARAMS, use_tqdm=False)
        check_rows(rows, dict(enumerate(refs)))
        assert rows[0]["prompt"].count("<image>") == 1 and rows[2]["prompt"].count("<image>") == 0


def test_image_parts_in_a_messages_column(tmp_path, llava, reference, photos) -> None:
    """image_url parts with a data: URL or a path (relative to the data file), bare image parts
    filled from the image column, and a row with both (its error)."""
    folder = photos["folder"]
    b, d = photos["images"]["b.png"], photos["images"]["d.png"]

    url = image_part

    def text(t: str) -> dict[str, Any]:
        return {"type": "text", "text": t}

    chats = [
        [{"role": "user", "content": [url(data_url(b)), text("describe it")]}],
        [{"role": "system", "content": "be brief"},
         {"role": "user", "content": [text("compare"), url("img/d.png"), url(data_url(b))]}],
        [{"role": "user", "content": [{"type": "image"}, text("from the column")]}],
        [{"role": "user", "content": "no picture"}],
        [{"role": "user", "content": [url("img/d.png"), text("both")]}],
        [{"role": "user", "content": [url("img/absent.png"), text("gone")]}],
    ]  # fmt: skip
    column = [None, None, "img/d.png", None, "img/b.png", None]
    data = write_jsonl(folder / "chats.jsonl", [
        {"messages": m, "image": c} for m, c in zip(chats, column, strict=True)
    ])  # fmt: skip
    dataset = {"messages_column": "messages", "image_column": "image"}
    run_job(job(data, llava, tmp_path / "out", dataset=dataset, engine=ENGINE))
    rows = table(tmp_path / "out")
    # The API reads paths from the current folder: the reference names them in full.
    absolute = str(folder / "img" / "d.png")
    expected = [
        chats[0],
        [chats[1][0], {"role": "user", "content": [text("compare"), url(absolute),
                                                   url(data_url(b))]}],
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": d},
                                      text("from the column")]}],
        chats[3],
    ]  # fmt: skip
    refs = reference.chat(expected, PARAMS, use_tqdm=False)
    check_rows(rows, dict(enumerate(refs)))
    assert "both in its image column and in its chat's image parts" in rows[4]["error"]
    assert rows[5]["error"].startswith("image 0: ") and "not found" in rows[5]["error"]


def test_an_openai_batch_file_with_image_parts(tmp_path, llava, reference, photos) -> None:
    folder = photos["folder"]
    b, d = photos["images"]["b.png"], photos["images"]["d.png"]

    line = batch_line

    def url(u: str) -> dict[str, Any]:
        return image_part(u, detail="low")

    ask = {"type": "text", "text": "what is it"}
    lines = [
        line("r0", [url(data_url(b)), ask]),
        line("r1", [url("img/d.png"), ask]),
        line("r2", [url("img/cut.png"), ask]),
        line("r3", [ask]),
    ]
    data = write_jsonl(folder / "requests.jsonl", lines)
    run_job(job(data, llava, tmp_path / "out", engine=ENGINE, sampling={"ignore_eos": True}))
    refs = reference.chat(
        [
            [{"role": "user", "content": [url(data_url(b)), ask]}],
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": d}, ask]}],
            [{"role": "user", "content": [ask]}],
        ],
        PARAMS,
        use_tqdm=False,
    )
    out = tmp_path / "out"
    answered = [json.loads(x) for x in (out / BATCH_OUTPUT_FILE).read_text().splitlines()]
    errors = [json.loads(x) for x in (out / BATCH_ERRORS_FILE).read_text().splitlines()]
    by_id = {a["custom_id"]: a for a in answered}
    for cid, ref in zip(["r0", "r1", "r3"], refs, strict=True):
        body = by_id[cid]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == ref.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert [e["custom_id"] for e in errors] == ["r2"]
    assert "image 0" in errors[0]["error"]["message"]


def test_image_rows_for_a_model_that_takes_none(tmp_path, tiny_folder, photos) -> None:
    """An image column with a text model stops the job before it loads; a chat's image parts
    are their row's error, and the other rows run."""
    folder = photos["folder"]
    rows = [{"prompt": "<image> hi", "image": "img/b.png"}]
    data = write_jsonl(folder / "text_model.jsonl", rows)
    cfg = job(data, tiny_folder, tmp_path / "a", dataset={"image_column": "image"})
    with pytest.raises(JobConfigError, match="takes no images: use a vision-language model"):
        run_job(cfg, llm_factory=never)
    parts = [
        {"type": "image_url", "image_url": {"url": "img/b.png"}},
        {"type": "text", "text": "x"},
    ]
    chats = [{"messages": [{"role": "user", "content": parts}]},
             {"messages": [{"role": "user", "content": "hello"}]}]  # fmt: skip
    data = write_jsonl(folder / "text_chats.jsonl", chats)
    run_job(job(data, tiny_folder, tmp_path / "b", dataset={"messages_column": "messages"}))
    out = table(tmp_path / "b")
    assert "takes none" in out[0]["error"] and out[0]["completion"] is None
    assert out[1]["error"] is None and out[1]["completion"]


def test_a_missing_image_column_is_exit_2_before_the_model_loads(tmp_path, llava) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image> hi", "picture": "a.png"}])
    args = [*tiny_job_args(data, llava, tmp_path / "out"), "dataset.image_column=image"]
    proc = cli(args, tmp_path, stderr=subprocess.PIPE)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "column 'image' not found" in lines[0], stderr
    assert "dataset.image_column" in lines[0] and "picture" in lines[0]
    assert not (tmp_path / "out" / "completions.parquet").exists()


def test_a_resumed_job_generates_each_row_once(tmp_path, llava, photos) -> None:
    """A first run stopped after some rows (dataset.limit is not part of the job's identity),
    then the whole job: the rows of the first run are kept, the others generated once, and
    the output equals a clean run's."""
    records = [{"prompt": p, "image": im} for p, im in PATH_ROWS]
    data = write_jsonl(photos["folder"] / "resume.jsonl", records)
    dataset = {"image_column": "image", "max_image_pixels": 200_000}
    run_job(job(data, llava, tmp_path / "out", dataset={**dataset, "limit": 4}, engine=ENGINE))
    spy = Spy()
    result = run_job(job(data, llava, tmp_path / "out", dataset=dataset, engine=ENGINE), spy)
    assert result.rows_resumed == 4 and spy.loads == 1
    failed_before_engine = 4  # missing, truncated, not an image, too many pixels
    assert spy.prompts == len(PATH_ROWS) - 4 - failed_before_engine
    run_job(job(data, llava, tmp_path / "clean", dataset=dataset, engine=ENGINE))
    compared = ["index", "id", "prompt", "completion", "prompt_tokens", "error"]
    resumed = [{k: r[k] for k in compared} for r in table(tmp_path / "out")]
    clean = [{k: r[k] for k in compared} for r in table(tmp_path / "clean")]
    assert resumed == clean and len(resumed) == len(PATH_ROWS)


def test_rows_of_the_same_images_run_together() -> None:
    """The window's order groups rows by their images as given, without decoding: bytes by
    content, paths by name and folder; rows without images keep their place first."""
    from batchpage.data.rows import Row

    class P:
        def __init__(self, index: int, images: list[Any] | None, folder: str | None = "/d"):
            self.row = Row(index=index, id=str(index), images=images, image_folder=folder)

    rows = [
        P(0, ["a.png"]),
        P(1, None),
        P(2, [b"\x89PNG one"]),
        P(3, ["a.png"], "/elsewhere"),  # another file's a.png: another picture
        P(4, [bytearray(b"\x89PNG one")]),  # equal bytes
        P(5, ["a.png"]),
        P(6, ["a.png", "b.png"]),
        P(7, [{"bytes": b"\x89PNG one", "path": "x.png"}]),
        P(8, None),
    ]
    order = [p.row.index for p in image_order(rows)]
    assert order == [1, 8, 0, 5, 2, 4, 7, 3, 6]


def test_relative_image_paths_of_data_in_object_storage_are_their_rows_errors(
    tmp_path, s3_env, llava, reference, photos
) -> None:
    """A data file in object storage has no folder to read a relative path from (not yet):
    such a row fails saying so, while bytes and absolute local paths are read."""
    b = photos["images"]["b.png"]
    absolute = str(photos["folder"] / "img" / "b.png")
    url = s3_env.url(s3_env.new_bucket(), "in/rows.jsonl")
    records = [
        {"prompt": "<image>\nhere", "image": "img/b.png"},
        {"prompt": "<image>\nfull path", "image": absolute},
        {"prompt": "<image>\ninline", "image": data_url(b)},
    ]
    put(s3_env, url, jsonl(records))
    run_job(job(url, llava, tmp_path / "out", dataset={"image_column": "image"}, engine=ENGINE))
    rows = table(tmp_path / "out")
    prompts = [{"prompt": r["prompt"], "multi_modal_data": {"image": b}} for r in records[1:]]
    refs = reference.generate(prompts, PARAMS, use_tqdm=False)
    check_rows(rows, {1: refs[0], 2: refs[1]})
    assert rows[0]["error"].startswith("image 0: 'img/b.png' is a path relative to a dataset in")
    assert "object storage" in rows[0]["error"] and "not read yet" in rows[0]["error"]


def test_the_dry_run_counts_images_as_the_engine_places_them(
    tmp_path, llava, reference, photos
) -> None:
    """Prompt tokens with each image's placeholders expanded, and shared prefixes that run
    through an image only between rows of the same picture: against a brute force over the
    API's prompt ids, each placeholder labelled by which photograph it stands for."""
    questions = ["what", "where is it", "why"]
    records = [{"prompt": f"<image>\n{q}", "image": f"img/{n}"}
               for n in ("b.png", "d.png") for q in questions]  # fmt: skip
    records += [{"prompt": "<image>\nwhat", "image": "img/cut.png"}, {"prompt": "plain text"}]
    data = write_jsonl(photos["folder"] / "dry.jsonl", records)
    cfg = job(data, llava, tmp_path / "out", dataset={"image_column": "image"}, engine=ENGINE)
    report = dry_run(cfg)
    good = [r for r in records if r.get("image") != "img/cut.png"]
    prompts = [
        {"prompt": r["prompt"], "multi_modal_data": {"image": images_of(photos, r["image"])}}
        if "image" in r else r["prompt"]
        for r in good
    ]  # fmt: skip
    outs = reference.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    placeholder = reference.model_config.vision.image_token_id
    keys = []
    for r, out in zip(good, outs, strict=True):
        label = -1 - ["img/b.png", "img/d.png"].index(r["image"]) if "image" in r else 0
        keys.append(tuple(label if t == placeholder else t for t in out.prompt_token_ids))

    def lcp(a: tuple, b: tuple) -> int:
        return next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )

    shared = [max(lcp(k, o) for j, o in enumerate(keys) if j != i) for i, k in enumerate(keys)]
    prefixes = {k[:n] for k in keys for n in range(1, len(k) + 1)}
    assert report["rows_with_errors"] == 1 and report["rows_to_generate"] == len(good)
    assert report["prompt_tokens"] == sum(len(k) for k in keys)
    assert report["shared_prefix_tokens"] == sum(shared)
    assert report["unique_prefix_tokens"] == len(prefixes)
    assert report["longest_shared_prefix"] == max(shared)


def test_a_window_s_images_are_dropped_once_it_has_generated(
    tmp_path, llava, photos, monkeypatch
) -> None:
    """Decoded images live from their window's preparation to the end of its generate call:
    while a window's images are decoded, no image of an earlier window is alive."""
    records = [{"prompt": "<image>\nq", "image": f"img/{n}"} for n in ("b.png", "d.png") * 3]
    data = write_jsonl(photos["folder"] / "windows.jsonl", records)
    generated: list[weakref.ref] = []  # the images of every generate call so far
    alive_at_decode: list[int] = []

    def decoding(source: Any, limits: Any) -> Any:
        gc.collect()
        alive_at_decode.append(sum(r() is not None for r in generated))
        return load_image(source, limits)

    def factory(model: str, **engine: Any) -> LLM:
        llm = LLM(model, **engine)
        generate = llm.generate

        def watching(prompts: list, *args: Any, **kwargs: Any) -> Any:
            images = [im for p in prompts for im in p["multi_modal_data"]["image"]]
            generated.extend(weakref.ref(im) for im in images)
            return generate(prompts, *args, **kwargs)

        llm.generate = watching  # type: ignore[method-assign]
        return llm

    monkeypatch.setattr(row_images, "load_image", decoding)
    dataset = {"image_column": "image", "window_rows": 2}
    run_job(job(data, llava, tmp_path / "out", dataset=dataset, engine=ENGINE), factory)
    assert len(generated) == 6 and alive_at_decode == [0] * 6
    assert all(r["error"] is None for r in table(tmp_path / "out"))
