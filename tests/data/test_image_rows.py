"""Rows' images as the data gives them (issue #72, the job's side), nothing decoded: the image
column's shapes, image parts of chats and OpenAI Batch bodies, each row's data folder, the
image options checked before the model loads, and which paths need a folder to be read."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.data import DatasetSpec, validate
from batchpage.data.image_sources import column_images
from batchpage.data.images import relative_path
from batchpage.data.readers import DatasetError
from batchpage.data.spec import iter_rows


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_an_image_column_cell_is_one_image_a_list_or_none() -> None:
    cell = {"bytes": b"\x89PNG", "path": "a.png"}
    assert column_images(None) == ([], None)
    assert column_images("  ") == ([], None)  # a blank CSV cell
    assert column_images([]) == ([], None)
    assert column_images("a.png") == (["a.png"], None)
    assert column_images(b"\x89PNG") == ([b"\x89PNG"], None)
    assert column_images(cell) == ([cell], None)
    assert column_images(["a.png", cell]) == (["a.png", cell], None)
    images, error = column_images(["a.png", None])
    assert images == [] and error is not None and "item 1 is null" in error
    images, error = column_images(7)
    assert images == [] and error is not None and "holds a int" in error


@pytest.mark.parametrize(
    ("source", "relative"),
    [
        ("img/a.png", "img/a.png"),
        ("a.png", "a.png"),
        ("/abs/a.png", None),
        (Path("img/a.png"), "img/a.png"),
        ("data:image/png;base64,AAAA", None),
        ("http://example.com/a.png", None),
        ("HTTPS://example.com/a.png", None),
        ("file:///abs/a.png", None),
        ("s3://bucket/a.png", None),  # a URL load_image refuses: no folder makes it readable
        ({"bytes": None, "path": "img/a.png"}, "img/a.png"),
        ({"bytes": b"\x89PNG", "path": "img/a.png"}, None),  # read from its bytes
        (b"\x89PNG", None),
    ],
)
def test_which_sources_are_paths_relative_to_a_folder(source, relative) -> None:
    assert relative_path(source) == relative


def test_rows_take_their_images_and_their_data_files_folder(tmp_path) -> None:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "what"},
        {"type": "image_url", "image_url": {"url": "b.png"}},
    ]
    write_jsonl(tmp_path / "set" / "one" / "a.jsonl", [
        {"messages": [{"role": "user", "content": parts}], "image": None},
        {"messages": [{"role": "user", "content": "plain"}], "image": ["x.png", "y.png"]},
    ])  # fmt: skip
    write_jsonl(tmp_path / "set" / "two" / "b.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image"}, "hi"]}], "image": "z.png"},
        {"messages": [{"role": "user", "content": parts}], "image": "z.png"},
        {"messages": [{"role": "user", "content": "no image"}], "image": None},
    ])  # fmt: skip
    spec = DatasetSpec(path=str(tmp_path / "set"), messages_column="messages",
                       image_column="image")  # fmt: skip
    info = validate(spec)
    assert "image" not in info.carried  # consumed (it may hold bytes), unless keep_columns
    rows = list(iter_rows(spec, info))
    assert [r.images for r in rows] == [
        ["data:image/png;base64,AAAA", "b.png"],
        ["x.png", "y.png"],
        ["z.png"],
        None,
        None,
    ]
    one, two = str(tmp_path / "set" / "one"), str(tmp_path / "set" / "two")
    assert [r.image_folder for r in rows] == [one, one, two, None, None]
    assert rows[0].messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"},
                                     {"type": "image"}]},
    ]  # fmt: skip
    assert rows[2].messages[0]["content"][0] == {"type": "image"}  # where the column's goes
    assert rows[3].error is not None and "both in its image column and in its chat" in rows[3].error
    assert rows[4].error is None


def test_an_openai_batch_body_s_image_parts_are_its_row_s_images(tmp_path) -> None:
    url = {"type": "image_url", "image_url": {"url": "img/a.png", "detail": "high"}}
    body = {"messages": [{"role": "user", "content": [url, {"type": "text", "text": "hi"}]}]}
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    data = write_jsonl(tmp_path / "b" / "requests.jsonl", [line])
    (row,) = iter_rows(DatasetSpec(path=str(data)))
    assert row.error is None and row.images == ["img/a.png"]
    assert row.image_folder == str(tmp_path / "b")
    with pytest.raises(DatasetError, match="drop dataset.image_column"):
        validate(DatasetSpec(path=str(data), image_column="image"))


def test_image_bytes_do_not_count_towards_the_prompt_bound(tmp_path) -> None:
    """max_prompt_bytes bounds a chat's text; its images are bounded by max_image_bytes."""
    big = "data:image/png;base64," + "A" * 4000
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}},
                                         {"type": "text", "text": "short"}]}]  # fmt: skip
    table = pa.table(
        {"messages": [json.dumps(chat), json.dumps([{"role": "user", "content": "x" * 600}])]}
    )
    pq.write_table(table, tmp_path / "c.parquet")
    spec = DatasetSpec(path=str(tmp_path / "c.parquet"), messages_column="messages",
                       max_prompt_bytes=512)  # fmt: skip
    first, second = iter_rows(spec)
    assert first.error is None and first.images == [big]
    assert second.error is not None and "max_prompt_bytes=512" in second.error


def test_image_options_and_the_image_column_are_checked_before_the_model_loads(tmp_path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "picture": "a.png"}])
    bad = [
        ("max_image_pixels", 0),
        ("max_image_bytes", -1),
        ("image_http_timeout_s", 0.0),
        ("image_http_timeout_s", float("inf")),
    ]
    for name, value in bad:
        with pytest.raises(DatasetError, match=f"dataset.{name}="):
            validate(DatasetSpec(path=str(data), **{name: value}))
    with pytest.raises(DatasetError, match="column 'image' not found.*dataset.image_column="):
        validate(DatasetSpec(path=str(data), image_column="image"))
    # What decides which rows' images are read is part of the job's identity; defaults are not.
    plain = validate(DatasetSpec(path=str(data))).fingerprint
    with_images = validate(DatasetSpec(path=str(data), image_column="picture")).fingerprint
    bounded = validate(
        DatasetSpec(path=str(data), image_column="picture", max_image_pixels=1000)
    ).fingerprint
    assert "image_column" not in plain and "max_image_pixels" not in plain
    assert with_images["image_column"] == "picture"
    assert bounded["max_image_pixels"] == 1000 and bounded != with_images


def test_an_hf_datasets_image_feature_is_read_as_its_stored_cells(tmp_path) -> None:
    """A saved dataset's Image column arrives as {bytes, path} cells (not decoded while the
    rows are read), which load_image decodes to the pixels that were saved."""
    import datasets
    import numpy as np
    from PIL import Image

    from batchpage.data.images import ImageLimits, load_image

    pixels = np.random.default_rng(3).integers(0, 256, (9, 13, 3), dtype=np.uint8)
    features = datasets.Features({"q": datasets.Value("string"), "pic": datasets.Image()})
    ds = datasets.Dataset.from_dict(
        {"q": ["a", "b"], "pic": [Image.fromarray(pixels), None]}, features=features
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    spec = DatasetSpec(path=str(tmp_path / "saved"), prompt_column="q", image_column="pic")
    first, second = iter_rows(spec)
    (cell,) = first.images
    assert isinstance(cell, dict) and isinstance(cell["bytes"], bytes)
    assert first.image_folder == str(tmp_path / "saved") and second.images is None
    assert np.array_equal(np.asarray(load_image(cell, ImageLimits())), pixels)
