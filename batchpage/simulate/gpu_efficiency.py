"""How far from their datasheets batchpage runs on GPUs: the shares of peak FLOP/s and
bandwidth that engines typically reach (VLLM_LIKE), with batchpage's own per-step overhead
fitted to its one measured GPU run (BENCHMARKS.md, GPU: Llama-3.2-1B's shapes on one H200).
The named GPUs of an estimate (plan.devices=[h100, l4, ...]) all run under it; a device
calibrated on its own machine (a device file) runs under its own fit instead.
"""

from __future__ import annotations

import random

from batchpage.engine.config import EngineConfig
from batchpage.model.config import ModelConfig
from batchpage.simulate.devices import GPUS
from batchpage.simulate.fit import FitGroup, fit_efficiency
from batchpage.simulate.measured import CalibrationCache, MeasuredDevice
from batchpage.simulate.simulator import SimRequest, simulate
from batchpage.simulate.step_cost import Efficiency, ModelShape, StepCost

# Llama-3.2-1B's config.json sizes (vocab, hidden, intermediate, layers, heads, KV heads,
# head_dim; tied embeddings).
LLAMA_32_1B = ModelConfig(128256, 2048, 8192, 16, 32, 8, 64, tie_word_embeddings=True)
# The one H200 run (BENCHMARKS.md, GPU): Llama-3.2-1B's shapes in float16, 512 prompts of
# 256-512 random tokens generating 256 each (ignore_eos), 512 running, 256,732 KV blocks of 16:
# 13,581 output tok/s. Its replay fits batchpage's per-step overhead on that device.
H200_RUN = {"model": "llama-3.2-1b", "requests": 512, "prompt_lens": (256, 512), "out": 256,
            "num_blocks": 256_732, "max_num_seqs": 512, "tok_s": 13_581.0}  # fmt: skip
# An engine whose own work per step is vLLM's (well under a millisecond, vLLM PRs #42131,
# #46112), its kernels at typical shares of the peaks.
VLLM_LIKE = Efficiency(compute=0.6, memory=0.8, overhead_s=0.5e-3)


def h200_measured(use_cache: bool = True) -> Efficiency:
    """VLLM_LIKE with the per-step overhead that makes the H200 run's replay take its measured
    time; cached (cache_dir()/step_costs), since the replay takes seconds."""
    cache = CalibrationCache({"fit": "h200-run", "run": repr(sorted(H200_RUN.items()))})
    if use_cache and (found := cache.get()) is not None:
        return found.efficiency
    rng = random.Random(0)
    lo, hi = H200_RUN["prompt_lens"]
    n, out = H200_RUN["requests"], H200_RUN["out"]
    # Prompts of one repeated token each, a different one per prompt: none shares a block.
    requests = [SimRequest([3 + i] * rng.randint(lo, hi), out, out) for i in range(n)]
    engine = EngineConfig(block_size=16, max_num_seqs=H200_RUN["max_num_seqs"], max_model_len=2048)
    cost = StepCost(ModelShape.of(LLAMA_32_1B, 2, 2), GPUS["h200"], VLLM_LIKE)
    sim = simulate(requests, engine, H200_RUN["num_blocks"], 2048, cost, 2048, keep_steps=True)
    measured = n * out / H200_RUN["tok_s"]
    eff = fit_efficiency([FitGroup(sim.works, measured)], cost, free=("overhead_s",))
    cache.put(MeasuredDevice(GPUS["h200"], eff, "the H200 run of BENCHMARKS.md", key=cache.key))
    return eff
