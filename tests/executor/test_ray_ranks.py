"""distributed_executor_backend="ray": an engine's ranks 1.. as Ray actors on a placement
group's bundles give the processes' (and one rank's) greedy tokens, and a rank whose actor dies
stops the engine with WorkerDied naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpage import LLM, SamplingParams
from batchpage.distributed.workers import WorkerDied

PROMPTS = [[5, 17, 33, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [250, 3, 250, 3, 90]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def _engine(folder: Path, world: int, **args) -> LLM:
    return LLM(
        str(folder), dtype="float32", kv_cache_memory=4 << 20, tensor_parallel_size=world, **args
    )


def _tokens(llm: LLM) -> list[list[int]]:
    items = [{"prompt_token_ids": p} for p in PROMPTS]
    return [r.outputs[0].token_ids for r in llm.generate(items, GREEDY, use_tqdm=False)]


def test_ray_ranks_give_one_ranks_tokens_and_leave_no_group(tiny_folder, ray_instance) -> None:
    from ray.util import placement_group_table

    one = _tokens(_engine(tiny_folder, 1))
    llm = _engine(tiny_folder, 2, distributed_executor_backend="ray")
    assert llm.workers is not None
    ranks = llm.workers.ranks
    assert ranks.nodes() == [ray_instance.get_runtime_context().get_node_id()]
    assert _tokens(llm) == one
    group = ranks.owned.id.hex()
    assert placement_group_table()[group]["state"] == "CREATED"
    llm.workers.close()
    assert placement_group_table()[group]["state"] == "REMOVED"


def test_a_killed_rank_actor_stops_the_engine_naming_it(tiny_folder, ray_instance) -> None:
    llm = _engine(tiny_folder, 2, distributed_executor_backend="ray")
    assert _tokens(llm)
    assert llm.workers is not None
    ray_instance.kill(llm.workers.ranks.actors[0])
    with pytest.raises(WorkerDied, match=r"tensor-parallel worker rank 1 \(.*\) died"):
        _tokens(llm)
