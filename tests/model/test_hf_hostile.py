"""A broken or hostile Hugging Face folder is refused in one line that names the fault (a
ValueError from the API, exit 2 from the job), fast, before anything is allocated from its
sizes: never a traceback, a terabyte allocation or a crash in the safetensors reader.

The hostile headers are written byte by byte here (an independent writer, not the reader's
code); the fuzz tests mutate the tiny model's header and config.json with hypothesis.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpage.engine.config import EngineConfig
from batchpage.engine.plan import plan_engine
from batchpage.llm import LLM
from batchpage.model.loader import load_model, resolve_model_source

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"
FUZZ_EXAMPLES = 100  # each fuzz test about 2 s


def split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join_safetensors(header: dict[str, Any], data: bytes, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def copy_of(folder: Path, into: Path) -> Path:
    target = into / "model"
    shutil.copytree(folder, target)
    return target


def edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def edit_header(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        header, data = split_safetensors((folder / WEIGHTS).read_bytes())
        change(header)
        (folder / WEIGHTS).write_bytes(join_safetensors(header, data))

    return edit


def first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


def truncate(folder: Path) -> None:
    raw = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(raw[: len(raw) // 2])


def header_length(length: int) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(struct.pack("<Q", length) + raw[8:])

    return edit


def index_naming(weight_map: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    return edit


HOSTILE = [
    (edit_config(vocab_size=10**10), "vocab_size must be an integer from 0 to 2,147,483,647"),
    (edit_config(vocab_size=1e10), "vocab_size must be an integer"),
    (edit_config(hidden_size=2**30), r"expected \(\d+, 1073741824\) \(vocab_size="),
    (edit_config(intermediate_size=2**31 - 1), "config.json and the weights disagree"),
    (edit_config(num_hidden_layers=10**6), "says 1000000 layers .* only \\d+ tensors"),
    (edit_config(num_attention_heads=0, head_dim=None), "wrong type or range .*ZeroDivision"),
    (edit_config(rms_norm_eps=[1]), "rms_norm_eps must be a number > 0, got \\[1\\]"),
    (edit_config(rope_theta="ten"), "rope_theta must be a number > 0, got 'ten': use the"),
    (edit_config(rope_theta=float("nan")), "rope_theta must be a number > 0, got nan"),
    (edit_config(rope_parameters={"rope_type": "default", "rope_theta": -1}), "rope_theta must"),
    (edit_config(rope_parameters=[1, 2]), "wrong type or range .*AttributeError"),
    (truncate, "not a valid safetensors file .*not fully covered"),
    (header_length(2**62), "header claims 4,611,686,018,427,387,904 bytes, but the file holds"),
    (header_length(0), "not a valid safetensors file"),
    (lambda f: (f / WEIGHTS).write_bytes(b"\x01"), "has 1 bytes, too few for a safetensors"),
    (
        edit_header(lambda h: first_tensor(h).update(shape=[2**40, 2**40])),
        "not a valid safetensors file",
    ),
    (
        edit_header(lambda h: first_tensor(h).update(data_offsets=[0, 2**50])),
        "not a valid safetensors file",
    ),
    (edit_header(lambda h: first_tensor(h).update(dtype="F99")), "not a valid safetensors file"),
    (
        edit_header(lambda h: h.update(extra=dict(first_tensor(h)))),
        "not a valid safetensors file",  # two tensors over the same bytes
    ),
    (index_naming({"w": "../../etc/passwd"}), "names weight files outside its folder"),
    (index_naming([1, 2]), "is not a safetensors index"),
    (lambda f: (f / "config.json").write_text("[" * 100_000), "is not valid JSON"),
]


@pytest.mark.parametrize(("damage", "match"), HOSTILE)
def test_a_hostile_folder_is_refused_in_one_line(tmp_path, tiny_folder, damage, match) -> None:
    folder = copy_of(tiny_folder, tmp_path)
    damage(folder)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=match) as info:
        resolve_model_source(str(folder))
    assert time.perf_counter() - started < 2.0
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
    with pytest.raises(ValueError, match=match):  # the API: LLM(...) checks before it loads
        LLM(str(folder), dtype="float32", kv_cache_memory=2**22)


def test_weights_replaced_after_the_check_fail_in_one_line(tmp_path, tiny_folder) -> None:
    """A file damaged between the check and the load (load_model given a checked source)."""
    folder = copy_of(tiny_folder, tmp_path)
    source = resolve_model_source(str(folder))
    header, data = split_safetensors((folder / WEIGHTS).read_bytes())
    (folder / WEIGHTS).write_bytes(join_safetensors(header, data[:-64]))
    with pytest.raises(ValueError, match="reading the weights failed") as info:
        load_model(source, dtype="float32")
    assert "\n" not in str(info.value)


def test_the_job_exits_2_with_one_line(tmp_path, tiny_folder) -> None:
    folder = copy_of(tiny_folder, tmp_path)
    edit_config(hidden_size=2**30)(folder)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    args = [f"model.path={folder}", f"dataset.path={data}", f"output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "batchpage.run", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "config.json and the weights disagree" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def load_outcome(folder: Path) -> str:
    """'loaded', or the one-line ValueError; anything else raises (and fails the test)."""
    try:
        source = resolve_model_source(str(folder))
        plan = plan_engine(EngineConfig(dtype="float32", kv_cache_memory=2**22), source)
        load_model(source, plan.dtype, plan.device, max_positions=plan.max_model_len)
    except ValueError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    return "loaded"


def fuzzed(tiny_folder: Path, damage: Callable[[Path], None]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = copy_of(tiny_folder, Path(tmp))
        damage(folder)
        started = time.perf_counter()
        outcome = load_outcome(folder)
        assert time.perf_counter() - started < 5.0, outcome
        return outcome


VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 7, 2**31, 2**32, 2**62, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-3, 2**40), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
TENSOR_FIELDS = st.sampled_from(["shape", "data_offsets", "dtype"])


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_safetensors_headers_load_or_are_refused_in_one_line(tiny_folder, data) -> None:
    def damage(folder: Path) -> None:
        raw = (folder / WEIGHTS).read_bytes()
        header, payload = split_safetensors(raw)
        names = sorted(header)
        kind = data.draw(st.sampled_from(["field", "length", "truncate", "bytes"]))
        if kind == "field":
            name = data.draw(st.sampled_from(names))
            if name == "__metadata__":
                header[name] = data.draw(VALUES)
            else:
                header[name][data.draw(TENSOR_FIELDS)] = data.draw(VALUES)
            raw = join_safetensors(header, payload)
        elif kind == "length":
            raw = join_safetensors(header, payload, data.draw(st.integers(0, 2**64 - 1)))
        elif kind == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        else:  # bytes overwritten anywhere in the header
            end = 8 + struct.unpack("<Q", raw[:8])[0]
            at = data.draw(st.integers(0, end - 1))
            patch = data.draw(st.binary(min_size=1, max_size=8))
            raw = raw[:at] + patch + raw[at + len(patch) :]
        (folder / WEIGHTS).write_bytes(raw)

    fuzzed(tiny_folder, damage)


CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "tie_word_embeddings", "eos_token_id", "bos_token_id", "model_type",
    "torch_dtype", "attention_bias", "sliding_window", "hidden_act", "partial_rotary_factor",
]  # fmt: skip


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), VALUES, min_size=1, max_size=3))
def test_fuzzed_config_fields_load_or_are_refused_in_one_line(tiny_folder, changes) -> None:
    fuzzed(tiny_folder, edit_config(**changes))
