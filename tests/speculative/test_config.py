"""SpeculativeConfig.from_dict: vLLM's keys and defaults, and a ValueError naming the key for
anything else; build_drafter builds the method's drafter with the config's values."""

from __future__ import annotations

import math

import pytest

from batchpage.speculative.config import SpeculativeConfig, build_drafter
from batchpage.speculative.ngram import NgramDrafter
from batchpage.speculative.suffix import SuffixDrafter


def test_ngram_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    only_max = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    c = SpeculativeConfig.from_dict(only_max)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    only_min = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    c = SpeculativeConfig.from_dict(only_min)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert c.suffix_decoding_max_tree_depth is None


def test_suffix_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "suffix"})
    assert c.num_speculative_tokens == c.suffix_decoding_max_tree_depth == 24
    assert c.suffix_decoding_max_cached_requests == 10000
    assert c.suffix_decoding_max_spec_factor == 1.0
    assert c.suffix_decoding_min_token_prob == 0.1
    assert c.prompt_lookup_min is None and c.prompt_lookup_max is None
    c = SpeculativeConfig.from_dict(
        {"method": "suffix", "suffix_decoding_max_tree_depth": 16, "num_speculative_tokens": 4}
    )
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth) == (4, 16)


def test_build_drafter() -> None:
    ngram = build_drafter(
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
        )
    )  # fmt: skip
    assert isinstance(ngram, NgramDrafter) and (ngram.min_n, ngram.max_n) == (1, 3)
    suffix = build_drafter(
        SpeculativeConfig.from_dict(
            {"method": "suffix", "suffix_decoding_max_tree_depth": 12,
             "suffix_decoding_max_cached_requests": 7, "suffix_decoding_max_spec_factor": 2,
             "suffix_decoding_min_token_prob": 0.25}
        )
    )  # fmt: skip
    assert isinstance(suffix, SuffixDrafter)
    assert (suffix.max_tree_depth, suffix.max_cached_requests) == (12, 7)
    assert (suffix.max_spec_factor, suffix.min_token_prob) == (2.0, 0.25)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix"}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({**NGRAM, "prompt_lookup_maximum": 3}, "prompt_lookup_maximum"),  # a typo
        ({**NGRAM, "model": "[ngram]"}, "model"),  # vLLM's key, not batchpage's
        ({**NGRAM, "suffix_decoding_max_tree_depth": 8}, "suffix_decoding_max_tree_depth"),
        ({**SUFFIX, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 4}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": "5"}, "prompt_lookup_max"),
        ({**SUFFIX, "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
        ({**SUFFIX, "suffix_decoding_max_tree_depth": None}, "suffix_decoding_max_tree_depth"),
        (
            {**SUFFIX, "suffix_decoding_max_cached_requests": -1},
            "suffix_decoding_max_cached_requests",
        ),
        ({**SUFFIX, "suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor"),
        (
            {**SUFFIX, "suffix_decoding_max_spec_factor": math.inf},
            "suffix_decoding_max_spec_factor",
        ),
        ({**SUFFIX, "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
        ({**SUFFIX, "suffix_decoding_min_token_prob": math.nan}, "suffix_decoding_min_token_prob"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_dict(options)


def test_messages_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="ngram, suffix"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        SpeculativeConfig.from_dict({**SUFFIX, "suffix_decoding_min_token_prob": 2})
    with pytest.raises(ValueError, match="the keys are .*prompt_lookup_max"):
        SpeculativeConfig.from_dict({**NGRAM, "n": 3})
    with pytest.raises(ValueError, match="mapping"):
        SpeculativeConfig.from_dict([("method", "ngram")])  # type: ignore[arg-type]


def test_direct_construction_is_checked_and_frozen() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", 4)
    c = SpeculativeConfig.from_dict(NGRAM)
    assert SpeculativeConfig(**vars(c)) == c
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 8  # type: ignore[misc]
