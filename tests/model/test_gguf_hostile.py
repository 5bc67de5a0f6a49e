"""A truncated, damaged or hostile GGUF is refused in one line that names the fault, fast, and
never with a struct error, a huge allocation, a division by zero or a deep recursion.

The hostile files are written byte by byte here (an independent writer, not the reader's code);
the fuzz test mutates a small valid file written by gguf's own GGUFWriter.
"""

from __future__ import annotations

import math
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpage.model.config import UnsupportedModelError
from batchpage.model.gguf_file import CorruptGGUFError, read_gguf_header
from batchpage.model.gguf_loader import load_gguf_model
from batchpage.model.loader import resolve_model_source
from tests.model.hostile_gguf import INTERESTING, MUTATIONS, load_outcome, mutate, tiny_gguf

U32, F32, STR, ARR, U64 = 4, 6, 8, 9, 10
FUZZ_EXAMPLES = 250  # the same files every run; jobs/bench/reliability.py fuzzes at random


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def tensor(name: str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    return s(name) + dims + struct.pack("<IQ", ggml_type, offset)


def gguf_bytes(
    kvs: list[bytes],
    tensors: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    version: int = 3,
    counts: tuple[int, int] | None = None,
    align: int = 32,
) -> bytes:
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs)
    head += b"".join(tensors)
    return head + bytes(-len(head) % align) + data


ARCH = kv("general.architecture", STR, s("llama"))


def header_error(tmp_path: Path, content: bytes) -> str:
    """read_gguf_header's refusal of `content`: a CorruptGGUFError, one line, naming the file,
    within a second."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    started = time.perf_counter()
    with pytest.raises(CorruptGGUFError) as info:
        read_gguf_header(path)
    assert time.perf_counter() - started < 1.0
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"GGU", "not a GGUF file"),
        (b"", "not a GGUF file"),
        (
            gguf_bytes([ARCH])[:40],
            "a metadata key needs 20 bytes at offset 32 but the file ends at 40",
        ),
        (gguf_bytes([ARCH], version=1), "version 1 is too old"),
        (gguf_bytes([ARCH], version=7), "version 7 is unknown"),
        # Counts and lengths far beyond the file: refused before a loop or an allocation.
        (gguf_bytes([ARCH], counts=(0, 2**62)), "4,611,686,018,427,387,904 metadata keys cannot"),
        (gguf_bytes([ARCH], counts=(2**40, 1)), "1,099,511,627,776 tensors cannot fit"),
        (
            gguf_bytes([struct.pack("<Q", 4_000_000_000) + b"key"]),
            "a metadata key needs 4,000,000,000 bytes",
        ),
        (
            gguf_bytes(
                [ARCH, kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 4 * 10**9))]
            ),
            "4,000,000,000 items of array 'tokenizer.ggml.tokens' cannot fit",
        ),
        (
            gguf_bytes([kv("v", ARR, struct.pack("<IQ", U32, 10**9))]),
            "1,000,000,000 items of array 'v' cannot fit",
        ),
        (
            gguf_bytes(
                [ARCH, kv("t", ARR, struct.pack("<IQ", STR, 2) + s("a") + s("b" * 999)[:9])]
            ),
            "a string in array 't' runs past the end",
        ),
        (
            gguf_bytes([kv("deep", ARR, struct.pack("<IQ", ARR, 1) * 5000)]),
            "array 'deep' nests more than 4 deep",
        ),
        (gguf_bytes([kv("x", 77, b"\0" * 8)]), "key 'x' has unknown value type 77"),
        (gguf_bytes([kv("x", ARR, struct.pack("<IQ", 13, 1))]), "unknown item type 13"),
        (gguf_bytes([ARCH, ARCH]), "key 'general.architecture' appears twice"),
        (gguf_bytes([u32("general.alignment", 0)]), "general.alignment is 0: it must be a power"),
        (gguf_bytes([u32("general.alignment", 48)]), "general.alignment is 48"),
        (gguf_bytes([kv("general.alignment", STR, s("32"))]), "general.alignment is '32'"),
        # Tensors: dimensions, types and where their bytes are.
        (gguf_bytes([ARCH], [tensor("w", ())], bytes(64)), "tensor 'w' has 0 dimensions"),
        (gguf_bytes([ARCH], [tensor("w", (1,) * 9)]), "tensor 'w' has 9 dimensions"),
        (gguf_bytes([ARCH], [tensor("w", (4, 0))]), r"tensor 'w' has shape \[4, 0\]"),
        (gguf_bytes([ARCH], [tensor("w", (4,), ggml_type=99)]), "'w' has unknown type 99"),
        (gguf_bytes([ARCH], [tensor("w", (33,), ggml_type=2)]), "33 values, not a multiple of"),
        (
            gguf_bytes([ARCH], [tensor("w", (2**31, 2**31))], bytes(64)),
            r"'w' \(18,446,744,073,709,551,616 bytes at data offset 0\) ends past the end",
        ),
        (gguf_bytes([ARCH], [tensor("w", (4,), offset=2**63)], bytes(64)), "ends past the end"),
        (gguf_bytes([ARCH], [tensor("w", (4,), offset=4)], bytes(64)), "is not 32-aligned"),
        (
            gguf_bytes([ARCH], [tensor("a", (16,)), tensor("b", (16,), offset=32)], bytes(128)),
            "tensors 'a' and 'b' overlap",
        ),
        (
            gguf_bytes([ARCH], [tensor("a", (4,)), tensor("a", (4,), offset=32)], bytes(64)),
            "tensor 'a' appears twice",
        ),
        # A damaged length makes a megabyte "name": the message shows its start.
        (gguf_bytes([kv("k" * 10**6, 77, bytes(4))]), r"key 'k{55}\.\.\.' has unknown value type"),
    ],
)
def test_a_hostile_header_is_one_clear_error(tmp_path, content: bytes, match: str) -> None:
    message = header_error(tmp_path, content)
    assert re.search(match, message), message
    assert len(message) < 400


def test_a_valid_hand_written_header_reads_back(tmp_path) -> None:
    """The byte writer above is right: the same layout with sane numbers is accepted."""
    nested = struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", U32, 2) + bytes(8)
    content = gguf_bytes(
        [ARCH, u32("general.alignment", 64), kv("n", ARR, nested)],
        [tensor("a", (16,)), tensor("b", (32, 2), ggml_type=2, offset=64)],  # F32, then Q4_0
        data=bytes(64 + 2 * 18),
        align=64,
    )
    path = tmp_path / "ok.gguf"
    path.write_bytes(content)
    header = read_gguf_header(path)
    assert header.meta == {"general.architecture": "llama", "general.alignment": 64, "n": 1}
    assert [(t.name, t.shape, t.nbytes) for t in header.tensors] == [
        ("a", (16,), 64),
        ("b", (32, 2), 36),
    ]
    assert header.data_start == len(content) - 100 and header.data_start % 64 == 0
    path.write_bytes(content[:-1])  # one byte short of tensor b's last block
    assert "'b' (36 bytes at data offset 64) ends past" in header_error(tmp_path, content[:-1])


def refused_at_load(path: Path, error: type[ValueError], match: str) -> str:
    """Loading `path` (config, then weights) fails with `error`, one line naming the file."""
    started = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        resolve_model_source(str(path))
        load_gguf_model(path, torch.float32, "cpu")
    assert time.perf_counter() - started < 10.0  # the first meta-device build warms torch up
    message = str(info.value)
    assert "\n" not in message and path.name in message
    return message


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        # vocab 4e9 was a 65 TB allocation; head_count 0 a ZeroDivisionError
        ({"vocab_size": 4_000_000_000}, "llama.vocab_size is 4000000000 .*from 1 to"),
        ({"attention__head_count": 0}, "llama.attention.head_count is 0 .*from 1 to"),
        ({"context_length": 2**30}, "llama.context_length is 1073741824"),
        # In range, but more parameters than the file holds weights: refused before building.
        ({"vocab_size": 2**30}, "describes a model of .* parameters but the file holds"),
        (
            {"block_count": 2**31 - 1},
            r"says 2147483647 layers \(llama.block_count\) but the file holds only 21 tensors",
        ),
        # Sizes that disagree with a tensor the loader reshapes: named, not numpy's message.
        ({"attention__key_length": 4}, "tensor 'blk.0.attn_q.weight' has 32 rows, expected 4"),
    ],
)
def test_sizes_that_cannot_be_the_files_are_refused(tmp_path, sizes, match) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", sizes)
    refused_at_load(path, ValueError, match)


def test_metadata_of_the_wrong_type_is_refused(tmp_path) -> None:
    import gguf

    for key, add, value, match in [
        ("llama.embedding_length", "add_string", "abc", "embedding_length is 'abc' \\(str\\)"),
        ("llama.rope.freq_base", "add_float32", math.nan, "freq_base is nan"),
        ("llama.attention.layer_norm_rms_epsilon", "add_float32", -1.0, "epsilon is -1.0"),
        ("tokenizer.ggml.eos_token_id", "add_string", "2", "eos_token_id is '2'"),
    ]:
        path = tmp_path / f"{key}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for k, v in [("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 8),
                     ("attention.head_count", 2), ("vocab_size", 4)]:  # fmt: skip
            if f"llama.{k}" != key:
                w.add_uint32(f"llama.{k}", v)
        getattr(w, add)(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        refused_at_load(path, CorruptGGUFError, match)


def test_a_type_batchpage_cannot_dequantize_is_unsupported_not_a_crash(tmp_path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", int8=("blk.1.ffn_up",))
    refused_at_load(path, UnsupportedModelError, "'blk.1.ffn_up.weight' is stored as I8")


def test_a_file_cut_after_its_header_was_read_names_the_tensor(tmp_path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf")
    header = read_gguf_header(path)
    path.write_bytes(path.read_bytes()[: header.data_start + 100])
    from batchpage.model.gguf_file import read_named_tensor

    with pytest.raises(CorruptGGUFError, match="tensor 'output.weight' ends at byte .* replaced"):
        read_named_tensor(path, header, "output.weight")


# --- fuzzing -------------------------------------------------------------------------------------


class Valid:
    """The tiny model's bytes and its header length (a short repr for hypothesis' reports)."""

    def __init__(self, path: Path) -> None:
        self.data, self.header_bytes = path.read_bytes(), read_gguf_header(path).data_start

    def __repr__(self) -> str:
        return f"Valid(<{len(self.data)} bytes>)"


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Valid:
    """A file that loads (which also warms torch up before the timed examples)."""
    path = tiny_gguf(tmp_path_factory.mktemp("fuzz") / "valid.gguf")
    assert load_outcome(path) == "loaded"
    return Valid(path)


edit = st.tuples(
    st.sampled_from(MUTATIONS),
    st.integers(min_value=0, max_value=2**20),
    st.one_of(st.sampled_from(INTERESTING), st.integers(min_value=0, max_value=2**64 - 1)),
)


@settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,  # the same files on every run; the reliability job fuzzes at random
    database=None,
    deadline=2000,  # "raised fast": a refusal never waits on a loop over a hostile count
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(edits=st.lists(edit, min_size=1, max_size=3))
def test_mutated_files_load_or_are_refused_cleanly(tmp_path, valid, edits) -> None:
    """1-3 edits inside the header of a valid file: loading succeeds or raises batchpage's own
    one-line ValueError (load_outcome re-raises anything else, which fails the test)."""
    data = valid.data
    for op, pos, value in edits:
        data = mutate(data, op, pos % valid.header_bytes, value)
    path = tmp_path / "mutated.gguf"
    path.write_bytes(data)
    outcomes = {"loaded", "CorruptGGUFError", "UnsupportedModelError", "ValueError"}
    assert load_outcome(path) in outcomes
