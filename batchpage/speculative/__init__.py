"""Draft tokens without weights for speculative decoding: n-gram prompt lookup and suffix
decoding behind one Drafter contract (drafter.py), configured in vLLM's shape (config.py)."""

from batchpage.speculative.config import SpeculativeConfig, build_drafter
from batchpage.speculative.drafter import Drafter
from batchpage.speculative.ngram import NgramDrafter
from batchpage.speculative.suffix import SuffixDrafter

__all__ = ["Drafter", "NgramDrafter", "SpeculativeConfig", "SuffixDrafter", "build_drafter"]
