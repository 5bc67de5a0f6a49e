"""Fixtures shared across the test folders: a tiny random Llama saved as a HF folder (with its
tokenizer), and the bundled SmolLM2 with transformers' copy of it as the reference (each built
once per session)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run in Triton's interpreter, which must be on before triton is
# first imported (transformers imports it): else its standard library is built for a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# isort: split
from batchpage.model import load_model, resolve_model_source
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    """On a machine busier than its cores (a shared runner), run torch single-threaded, here
    and in the jobs the tests start: an OpenMP barrier waits for every thread of the region, and
    with the cores taken by others each of the thousands of small regions of a step stalls for
    a scheduler time slice (measured: a decode step 11x slower with 2 threads than with 1 at a
    load average of 10 on 2 cores). Results do not depend on the thread count: the references
    run in the same process."""
    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer of tests.model_factory."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama (GQA, tied embeddings, 2048 positions) saved as a HF folder."""
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    hf.config.max_position_embeddings = 2048  # HumanEval prompts are long in a tiny vocabulary
    return save_hf_folder(hf, tmp_path_factory.mktemp("tiny"), tokenizer)


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' model and tokenizer from the same GGUF (the independent reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model_source("smollm2").path
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_hf_folder(tmp_path_factory, smollm2_hf):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("smollm2_hf")
    # A GGUF-loaded transformers model refuses save_pretrained (it counts as quantized): copy its
    # dequantized weights into a plain model of the same config and save that.
    config = copy.deepcopy(smollm2_hf[0].config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(smollm2_hf[0].state_dict())
    plain.save_pretrained(folder)
    smollm2_hf[1].save_pretrained(folder)
    return folder


# --- object-storage servers (tests/storage_servers.py) -------------------------------------------
# Read when gcsfs and google-auth are first imported: no gRPC probe of the emulator, and no
# probe of a cloud metadata server (the tests reach 127.0.0.1 only).
for _name, _value in (
    ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false"),
    ("NO_GCE_CHECK", "true"),
    ("GCE_METADATA_HOST", "127.0.0.1:9"),
    ("GCE_METADATA_IP", "127.0.0.1:9"),
):
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 for the session (`.env` for a job's subprocess,
    `.new_bucket()`, reference reads through boto3)."""
    from tests.extras import require

    require("s3fs", "cloud"), require("moto", "dev"), require("boto3", "dev")
    from tests.storage_servers import S3Server

    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    """gcp-storage-emulator (create-only uploads honoured) on 127.0.0.1 for the session;
    reference reads through google-cloud-storage."""
    from tests.extras import require

    require("gcsfs", "cloud"), require("gcp_storage_emulator", "dev")
    require("google.cloud.storage", "dev")
    from tests.storage_servers import GCSServer

    server = GCSServer.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """s3_server, with its environment set in this process for the test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    """gcs_server, with its environment set in this process for the test."""
    for name, value in gcs_server.env.items():
        monkeypatch.setenv(name, value)
    return gcs_server
