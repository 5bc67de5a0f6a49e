"""The simulator against what it models: its schedule against the real engine's on the same
requests (steps, peak running, preemptions, prefill computed, KV waste: equal, since it drives
the same scheduler), and a step's work against a FLOP count of HF transformers' forward."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, DynamicCache

from batchpage import LLM, SamplingParams
from batchpage.engine.config import EngineConfig
from batchpage.model.loader import resolve_model_source
from batchpage.simulate.devices import DeviceSpec
from batchpage.simulate.simulator import SimRequest, simulate
from batchpage.simulate.step_cost import Efficiency, ModelShape, StepCost, StepWork
from tests.engine.speculation import Oracle, WeightBound

ENGINE = {"dtype": "float32", "max_model_len": 256, "block_size": 8}


def requests(count: int, seed: int, ignore_eos: bool = True) -> list[SimRequest]:
    """Prompts in groups that share a prefix (so the radix cache takes part), various lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    out = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
        n = rng.randrange(1, 60)
        out.append(SimRequest(prompt, n if ignore_eos else 64, n, ignore_eos))
    return out


def cost_of(folder: Path) -> StepCost:
    cfg = resolve_model_source(str(folder)).config
    unit = DeviceSpec("unit", 1e12, 1e11, 1e9, host_bandwidth=1e10)
    return StepCost(ModelShape.of(cfg, 4, 4), unit, Efficiency())


@pytest.mark.parametrize(
    "engine",
    [
        {"kv_cache_memory": 2**21},  # ample: no preemption
        {"kv_cache_memory": 40 * 8 * 2 * 2 * 2 * 32 * 4, "max_num_seqs": 16},  # 40 blocks: tight
        {"kv_cache_memory": 40 * 8 * 2 * 2 * 2 * 32 * 4, "preemption_mode": "swap"},
        {"kv_cache_memory": 2**20, "kv_allocator": "static"},
        {"kv_cache_memory": 2**21, "prefix_caching": False, "max_num_batched_tokens": 64},
    ],
)
def test_the_simulated_schedule_is_the_engines(tiny_folder: Path, engine: dict) -> None:
    """The tiny model generates exactly max_tokens (ignore_eos); the simulator, told those
    lengths, makes the same steps with the same batches."""
    reqs = requests(40, seed=1)
    llm = LLM(str(tiny_folder), **ENGINE, **engine)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.output_len for r in reqs]
    stats = llm.run_stats
    cfg = EngineConfig(**{**ENGINE, **engine})
    got = simulate(
        reqs, cfg, llm.plan.num_blocks, llm.plan.max_model_len, cost_of(tiny_folder),
        cfg.batched_tokens(torch.device("cpu")),
    )  # fmt: skip
    assert got.steps == stats.steps
    assert got.peak_running == stats.peak_running
    assert got.preemptions == stats.preemptions and got.swaps == stats.swaps
    assert got.generated_tokens == stats.generated_tokens
    assert got.cached_prompt_tokens == stats.cached_prompt_tokens
    prompt_work = stats.prefill_tokens_computed - (stats.prompt_tokens - stats.cached_prompt_tokens)
    assert got.recomputed_tokens == prompt_work
    assert got.kv_waste == pytest.approx(llm.stats["kv_waste"], abs=1e-12)
    if "kv_cache_memory" in engine and engine["kv_cache_memory"] < 2**20:
        assert got.preemptions > 0  # the tight pools do preempt: the case is exercised


@pytest.mark.parametrize(
    ("acceptance", "memory"),
    [(1.0, {"kv_cache_memory": 2**21}), (0.0, {"kv_cache_memory": 2**21}),
     (0.0, {"kv_cache_memory": 24 * 8 * 2 * 2 * 2 * 32 * 4, "max_num_seqs": 16})],
    ids=["all-right", "all-wrong", "all-wrong-tight"],
)  # fmt: skip
def test_a_speculative_run_is_the_engines_step_for_step(
    tiny_folder: Path, acceptance: float, memory: dict
) -> None:
    """Every draft right (an oracle drafter in the engine, acceptance 1 in the simulator), or
    every draft wrong (acceptance 0: each row's drafts take KV slots and give their computed
    count back), in an ample pool and a tight one (24 blocks: preemptions): the same steps,
    batches and tokens, drafts run after each decode row's newest token."""
    reqs = requests(24, seed=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = {**ENGINE, **memory, "speculative_config": spec}
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    prompts = [r.prompt_token_ids for r in reqs]
    plain = LLM(str(tiny_folder), **ENGINE, **memory)
    answers = {
        tuple(p): o.outputs[0].token_ids
        for p, o in zip(prompts, plain.generate(prompts, params, use_tqdm=False), strict=True)
    }
    llm = LLM(str(tiny_folder), **engine)
    assert llm.engine.drafts is not None
    llm.engine.drafts.cost = WeightBound()  # type: ignore[assignment]
    llm.engine.drafts.drafter = Oracle(answers, wrong=1.0 - acceptance, seed=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [answers[tuple(p)] for p in prompts]
    stats = llm.run_stats
    assert stats.draft_tokens > 0
    assert stats.accepted_draft_tokens == acceptance * stats.draft_tokens
    cfg = EngineConfig(**engine)
    got = simulate(
        reqs, cfg, llm.plan.num_blocks, llm.plan.max_model_len, cost_of(tiny_folder),
        cfg.batched_tokens(torch.device("cpu")), acceptance=acceptance,
    )  # fmt: skip
    assert got.steps == stats.steps
    if acceptance == 1.0:
        assert stats.steps < plain.run_stats.steps
    assert got.peak_running == stats.peak_running
    assert got.preemptions == stats.preemptions and got.swaps == stats.swaps
    assert got.generated_tokens == stats.generated_tokens
    assert got.kv_waste == pytest.approx(llm.stats["kv_waste"], abs=1e-12)
    if "max_num_seqs" in memory:
        assert got.preemptions > 0  # the tight pool does preempt: the case is exercised


def test_an_eos_the_engine_does_not_know_in_advance(tiny_folder: Path) -> None:
    """Without ignore_eos the engine admits on max_tokens and the sequence ends early: the
    simulator ends it at output_len, through the same StopChecker."""
    reqs = requests(12, seed=2, ignore_eos=False)
    cfg = EngineConfig(**ENGINE, kv_cache_memory=2**21)
    got = simulate(reqs, cfg, 512, 256, cost_of(tiny_folder), 512)
    assert got.generated_tokens == sum(r.output_len for r in reqs)
    with pytest.raises(ValueError, match="output_len must be in"):
        simulate([SimRequest([5, 6], 4, 9, False)], cfg, 512, 256, cost_of(tiny_folder), 512)


@torch.no_grad()
def test_a_decode_steps_flops_are_hf_transformers(tiny_folder: Path) -> None:
    """One decode token after C cached ones, lm_head on that row only: FlopCounterMode over
    HF's forward counts the same FLOPs as StepWork (linears, attention over C + 1 keys)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="eager").eval()
    context = 37
    ids = torch.randint(3, 300, (1, context + 1))
    cache = DynamicCache(config=hf.config)
    hf(ids[:, :context], past_key_values=cache, use_cache=True)
    with FlopCounterMode(display=False) as counter:
        hf(ids[:, context:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    cost = cost_of(tiny_folder)
    work = cost.work([(1, context, True)])
    total = work.flops + work.attention_flops
    assert total == pytest.approx(counter.get_total_flops(), rel=1e-9)
    shape = cost.shape
    assert shape.num_weights == sum(p.numel() for p in hf.parameters())
    assert asdict(shape)["kv_heads"] == hf.config.num_key_value_heads


def test_a_shared_prefix_is_read_once_a_step(tiny_folder: Path) -> None:
    """Sequences behind one prefix of 5 full blocks (block size 8): once the first has
    published it, the others take it from the radix cache, and a step's K/V bytes count it
    once: brute force from each step's (new, context) rows, the prefix's 40 tokens subtracted
    for every sequence past the first that reads them."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 300) for _ in range(40)]
    tails = [[rng.randrange(3, 300) for _ in range(3 + i)] for i in range(6)]
    reqs = [SimRequest(prefix + t, 4, 4) for t in tails]
    cfg = EngineConfig(**ENGINE, kv_cache_memory=2**21)
    base = cost_of(tiny_folder)
    steps: list[tuple[list[tuple[int, int, bool]], StepWork]] = []

    class Recorded(StepCost):
        def work(self, seqs: Iterable[tuple[int, int, bool]]) -> StepWork:
            rows = list(seqs)
            done = super().work(rows)
            steps.append((rows, done))
            return done

    got = simulate(reqs, cfg, 512, 256, Recorded(base.shape, base.device, base.eff), 512)
    assert got.cached_prompt_tokens == 40 * (len(reqs) - 1)
    per_token = base.shape.kv_bytes_per_token
    weights = base.shape.num_weights * base.shape.weight_bytes
    shared_steps = 0
    for rows, work in steps:
        readers = sum(context >= 40 for _, context, _ in rows)
        repeats = max(0, readers - 1) * 40
        shared_steps += repeats > 0
        listed = sum(context + 2 * new for new, context, _ in rows)
        assert work.bytes == pytest.approx(weights + (listed - repeats) * per_token)
    assert shared_steps >= 3
