"""Reasoning models: the thinking split, the thinking budget, and structured outputs on the answer.

The tiny random Llama runs with a tokenizer that has ``<think>`` / ``</think>`` as added tokens
and the real Qwen3 or DeepSeek-R1 chat template (tests/model/templates). References: the split
is checked against ``split_reference``, a whole-output statement of where the thinking ends
written independently of the token-by-token tracker; a budgeted output's answer is HF
transformers' greedy continuation of the prompt, the thinking and the forced end marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage import LLM, SamplingParams, StructuredOutputsParams
from batchpage.engine.reasoning import (
    Phase,
    ReasoningMarkers,
    ThinkingTracker,
    prompt_phase,
    resolve_markers,
)
from tests.model_factory import build_hf_model, hf_greedy, save_hf_folder, thinking_tokenizer

QUESTION = [{"role": "user", "content": "What is 2+2?"}]
START, END = 900, 901  # marker ids of the unit tests' made-up vocabulary


def split_reference(
    phase: Phase, implicit: bool, ids: list[int]
) -> tuple[list[int] | None, list[int]]:
    """(reasoning ids or None, answer ids) of a whole output that starts in ``phase``."""
    if phase is Phase.ANSWER:
        return None, ids
    if phase is Phase.BEFORE:
        if ids[:1] == [START]:
            ids = ids[1:]
        elif not implicit or not ids:
            return None, ids  # no token opened a thinking block
    if END in ids:
        cut = ids.index(END)
        return ids[:cut], ids[cut + 1 :]
    return ids, []


@settings(max_examples=300, deadline=None)
@given(
    phase=st.sampled_from(list(Phase)),
    implicit=st.booleans(),
    ids=st.lists(st.sampled_from([START, END, 5, 6, 7]), max_size=12),
)
def test_the_tracker_token_by_token_splits_as_the_whole_output_does(phase, implicit, ids) -> None:
    tracker = ThinkingTracker(ReasoningMarkers("t", START, END, implicit), phase, budget=None)
    in_answer = [tracker.append(t) for t in ids]
    reasoning, answer = split_reference(phase, implicit, ids)
    assert tracker.reasoning_ids(ids) == reasoning
    start = tracker.answer_start
    assert (ids[start:] if start is not None else []) == answer
    assert sum(in_answer) == len(answer)
    assert tracker.num_thinking == (len(reasoning) if reasoning is not None else 0)


def test_the_budget_forces_the_end_marker_after_n_thinking_tokens() -> None:
    for budget in (0, 1, 3):
        tracker = ThinkingTracker(ReasoningMarkers("t", START, END, False), Phase.BEFORE, budget)
        assert tracker.forced_token is None and tracker.answer_may_start
        tracker.append(START)
        for _ in range(budget):
            assert tracker.forced_token is None and not tracker.answer_may_start
            tracker.append(5)
        assert tracker.forced_token == END
        tracker.append(END)
        assert tracker.forced_token is None and tracker.answer_may_start
        assert tracker.reasoning_ids([START, *[5] * budget, END, 7]) == [5] * budget


def test_prompt_phase_from_the_real_templates() -> None:
    for family, kwargs, want in [
        ("qwen3", {}, Phase.BEFORE),  # the model opens its own <think>
        ("qwen3", {"enable_thinking": False}, Phase.ANSWER),  # the template closes an empty one
        ("deepseek_r1", {}, Phase.THINKING),  # the template opens it
    ]:
        tok = thinking_tokenizer(family)
        text = tok.apply_chat_template(
            QUESTION, add_generation_prompt=True, tokenize=False, **kwargs
        )
        ids = tok.encode(text, add_special_tokens=False)
        markers = resolve_markers("auto", lambda s, t=tok: _single(t, s))
        assert markers is not None and markers.name == family

        def blank(i: int, t=tok) -> bool:
            return not t.decode([i]).strip()

        assert prompt_phase(markers, ids, blank) is want, (family, kwargs)


def _single(tok, text: str) -> int | None:
    ids = tok.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@pytest.fixture(scope="module")
def r1(tmp_path_factory) -> tuple[Path, object, object]:
    """A tiny random Llama with DeepSeek-R1's template and markers, its folder, HF model and
    tokenizer."""
    tok = thinking_tokenizer("deepseek_r1")
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tok))
    return save_hf_folder(hf, tmp_path_factory.mktemp("r1"), tok), hf, tok


def _llm(folder: Path, **kwargs) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256, **kwargs}
    return LLM(str(folder), **args)


CHATS = [
    [{"role": "user", "content": text}]
    for text in ["What is 2+2?", "Hello world", "The quick brown fox", "A radix tree"]
]


def test_the_split_does_not_change_the_tokens_and_matches_the_reference(r1) -> None:
    folder, _, tok = r1
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _llm(folder).chat(CHATS, params, use_tqdm=False)
    split = _llm(folder, reasoning_parser="deepseek_r1").chat(CHATS, params, use_tqdm=False)
    for a, b in zip(plain, split, strict=True):
        ids = b.outputs[0].token_ids
        assert ids == a.outputs[0].token_ids
        assert a.outputs[0].reasoning is None
        reasoning, answer = split_reference(Phase.THINKING, True, ids)
        assert b.outputs[0].reasoning == tok.decode(reasoning, skip_special_tokens=True)
        assert b.outputs[0].text == tok.decode(answer, skip_special_tokens=True)


@pytest.mark.parametrize("budget", [0, 3, 8])
def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows_as_in_hf(r1, budget) -> None:
    folder, hf, tok = r1
    end = tok.convert_tokens_to_ids("</think>")
    llm = _llm(folder, reasoning_parser="auto")
    free = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=24, thinking_token_budget=budget)
    outs = llm.chat(CHATS, params, use_tqdm=False)
    for out, unbudgeted in zip(outs, free, strict=True):
        ids = out.outputs[0].token_ids
        assert ids[:budget] == unbudgeted.outputs[0].token_ids[:budget]
        assert end not in ids[:budget] and ids[budget] == end
        assert out.outputs[0].reasoning == tok.decode(ids[:budget], skip_special_tokens=True)
        assert out.outputs[0].text == tok.decode(ids[budget + 1 :], skip_special_tokens=True)
        continuation = hf_greedy(hf, out.prompt_token_ids + ids[: budget + 1], 24 - budget - 1)
        answer = ids[budget + 1 :]
        assert answer == continuation[: len(answer)]
        assert len(answer) == 24 - budget - 1 or answer[-1] in llm.engine.eos_ids


def test_the_budget_holds_for_sampled_samples_prefix_caching_and_preemption(r1) -> None:
    folder, _, tok = r1
    end = tok.convert_tokens_to_ids("</think>")
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, thinking_token_budget=5
    )
    runs = []
    small_pool = {"kv_cache_memory": 20 * 2048, "block_size": 4, "max_model_len": 64}  # 20 blocks
    for kwargs in ({}, {"prefix_caching": False}, small_pool):
        llm = _llm(folder, reasoning_parser="deepseek_r1", **kwargs)
        llm.engine.check_integrity_each_step = True
        outs = llm.chat(CHATS * 3, params, use_tqdm=False)
        if kwargs is small_pool:
            assert llm.stats["preemptions"] > 0
        runs.append([[(o.token_ids, o.text, o.reasoning) for o in out.outputs] for out in outs])
        for out in outs:
            for o in out.outputs:
                assert o.token_ids[5] == end and end not in o.token_ids[:5]
    assert runs[0] == runs[1] == runs[2]


def test_stop_strings_and_structured_outputs_apply_to_the_answer_only(r1) -> None:
    folder, _, tok = r1
    llm = _llm(folder, reasoning_parser="deepseek_r1")
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, thinking_token_budget=6)
    out = llm.chat(CHATS[:1], base, use_tqdm=False)[0].outputs[0]
    # A stop string taken from the thinking's text does not stop the thinking.
    stop = out.reasoning[1:3]
    assert stop and stop in out.reasoning
    stopped = llm.chat(CHATS[:1], base.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.reasoning == out.reasoning
    assert stop not in stopped.text
    # A choice constrains the answer, not the thinking before it.
    choice = base.replace(
        ignore_eos=False, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    outs = llm.chat(CHATS, choice, use_tqdm=False)
    for o in (out.outputs[0] for out in outs):
        assert o.text in ("yes", "no") and o.finish_reason == "stop"
        assert o.token_ids.index(tok.convert_tokens_to_ids("</think>")) <= 6


def test_qwen3_may_open_its_thinking_under_a_constraint(tmp_path: Path) -> None:
    """Qwen3's prompt leaves the choice to the model: in BEFORE the constraint's first tokens
    and <think> are allowed. A logit bias towards <think> makes the model open it."""
    tok = thinking_tokenizer("qwen3")
    start = tok.convert_tokens_to_ids("<think>")
    folder = save_hf_folder(build_hf_model("qwen3_tied", vocab_size=len(tok)), tmp_path / "m", tok)
    llm = _llm(folder, reasoning_parser="qwen3")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(
        temperature=0.0, max_tokens=20, thinking_token_budget=4, structured_outputs=choice
    )
    plain = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert plain.text in ("yes", "no")
    biased = llm.chat(QUESTION, params.replace(logit_bias={start: 100.0}), use_tqdm=False)
    o = biased[0].outputs[0]
    assert o.token_ids[0] == start and o.text in ("yes", "no")
    assert o.reasoning == "<think>" * 4  # the bias keeps writing it while thinking
    off = llm.chat(
        QUESTION, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False}
    )
    assert off[0].outputs[0].reasoning is None and off[0].outputs[0].text in ("yes", "no")


def test_beam_search_outputs_are_split_too(r1) -> None:
    folder, _, tok = r1
    params = SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=8)
    plain = _llm(folder).chat(CHATS[:1], params, use_tqdm=False)[0]
    split = _llm(folder, reasoning_parser="deepseek_r1").chat(CHATS[:1], params, use_tqdm=False)
    for a, b in zip(plain.outputs, split[0].outputs, strict=True):
        assert a.token_ids == b.token_ids
        reasoning, answer = split_reference(Phase.THINKING, True, b.token_ids)
        assert b.text == tok.decode(answer, skip_special_tokens=True)
    with pytest.raises(ValueError, match="thinking_token_budget cannot be combined"):
        params.replace(thinking_token_budget=4)


def test_refusals_name_the_fix(r1, tiny_folder: Path) -> None:
    folder, _, _ = r1
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        _llm(folder, reasoning_parser="r1")
    with pytest.raises(ValueError, match="lacks them"):
        _llm(tiny_folder, reasoning_parser="qwen3")
    assert _llm(tiny_folder, reasoning_parser="auto").engine.reasoning is None
    out = _llm(tiny_folder).generate("Hi", SamplingParams(thinking_token_budget=3), use_tqdm=False)
    assert "needs a reasoning parser" in out[0].error
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
