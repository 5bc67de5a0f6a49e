"""The padded static-shape decode step (what CUDA graphs replay) against the unpadded step: the
same logits, bit for bit, and the same K/V written, on every CPU attention backend and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.engine.decode_graphs import DecodeGraphs, ladder
from batchpage.ops.onednn_linear import onednn_packs
from tests.engine.test_engine import random_prompts
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer


def test_ladder() -> None:
    assert ladder(1) == [1]
    assert ladder(3) == [1, 2, 3]
    assert ladder(8) == [1, 2, 4, 8]
    assert ladder(20) == [1, 2, 4, 8, 16, 20]
    assert ladder(32) == [1, 2, 4, 8, 16, 24, 32]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = tiny_tokenizer()
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    return save_hf_folder(hf, tmp_path_factory.mktemp("m") / "m", tokenizer)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padded_decode_equals_the_unpadded_step(folder: Path, backend: str, dtype: str) -> None:
    # One linear implementation throughout, and one whose rows do not depend on how many there
    # are (oneDNN's; a BLAS may block 5 rows and 8 differently): padding must change nothing.
    packs = onednn_packs(getattr(torch, dtype), torch.device("cpu"))
    llm = LLM(
        model=str(folder),
        dtype=dtype,
        device="cpu",  # the CPU backends' padded step (a GPU machine's own runs the CUDA cases)
        block_size=4,
        kv_cache_memory=2**22,
        attention_backend=backend,
        max_model_len=64,
        linear_backend="onednn" if packs else "torch",
    )
    engine = llm.engine
    prompts = random_prompts(5, 300, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_requests([llm._make_request(i, p, params) for i, p in enumerate(prompts)])
    for _ in range(4):  # the prompts, then a few decodes: contexts of several blocks
        engine.step()
    pool = engine.kv_manager.pool
    pad_block = next(b for b in reversed(range(pool.num_blocks)) if pool.refcount(b) == 0)
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv, runner.attention, ladder(8), 64, pad_block, capture=False
    )
    for batch in (5, 3, 1):  # padded to 8, 4 and 1 rows
        out = engine.scheduler.schedule()
        scheduled = out.scheduled[:batch]
        inputs = engine.step_builder.build(out.rows[:batch], out.num_new[:batch])
        assert inputs.meta.is_decode_only and inputs.logits_indices.numel() == batch
        before = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]
        want = runner.execute(inputs, out).logits
        want_kv = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]
        for t, saved in zip((*runner.kv.k, *runner.kv.v), before, strict=True):
            t.copy_(saved)
        with torch.inference_mode():
            got = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        assert torch.equal(got, want)
        for t, expected in zip((*runner.kv.k, *runner.kv.v), want_kv, strict=True):
            real = torch.ones(t.shape[0], dtype=torch.bool)
            real[pad_block] = False
            assert torch.equal(t[real], expected[real])
        for row, s in enumerate(scheduled):  # the step happened: its tokens are computed
            s.seq.num_computed_tokens += 1
            s.seq.append_token(int(want[row].argmax()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_give_the_eager_outputs(folder: Path) -> None:
    """On a GPU: decode steps replayed from CUDA graphs against enforce_eager, greedy."""
    prompts = random_prompts(24, 300, seed=4)  # ragged: padded to several ladder sizes
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = []
    for eager in (False, True):
        llm = LLM(
            model=str(folder), dtype="float32", block_size=16, max_model_len=96, max_num_seqs=24,
            kv_cache_memory=2**26, enforce_eager=eager,
        )  # fmt: skip
        assert (llm.engine.runner.decode_graphs is None) == eager
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
