"""host_memory.older_objects_frozen, which LLM runs its steps in: objects older than the block
are left out of the cyclic collector's walks while it runs, and handed back after it, so that a
cycle of them dropped meanwhile is freed by a later collection (weak references as the
reference: what the collector frees and when)."""

from __future__ import annotations

import gc
import weakref

from batchpage import LLM, SamplingParams
from batchpage.host_memory import older_objects_frozen


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_older_cycles_wait_for_the_block_to_end_newer_ones_do_not() -> None:
    assert gc.get_freeze_count() == 0
    older = _cycle()  # unreachable already, but not collected yet
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
        newer = _cycle()
        gc.collect()
        assert older() is not None  # frozen: the collector does not walk it
        assert newer() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert older() is None


def test_an_applications_own_freeze_is_left_as_it_is() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_an_llm_dropped_after_its_run_is_freed(tiny_folder) -> None:
    """The engine holds cycles; after generate hands its objects back, dropping the LLM and
    one collection free its model."""
    llm = LLM(model=str(tiny_folder), dtype="float32", max_model_len=128, kv_cache_memory=2**22)
    out = llm.generate(["hello there"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and gc.get_freeze_count() == 0
    model = weakref.ref(llm.engine.model)
    del llm, out
    gc.collect()
    assert model() is None
