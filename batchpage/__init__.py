"""batchpage: offline batch inference over a paged, prefix-shared KV cache.

The public names load on first use, so that importing one submodule (the kernels, the cache)
does not pull in the model loaders and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchpage.omp_wait import set_wait_policy
from batchpage.user_log import configure_package_logging

if TYPE_CHECKING:
    from batchpage.llm import LLM
    from batchpage.lora.request import LoRARequest
    from batchpage.pooling_params import PoolingParams
    from batchpage.request_outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from batchpage.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "LoRARequest",
]
__version__ = "0.1.0"

# Before anything here imports torch, whose OpenMP reads its wait policy as it loads (omp_wait.py).
set_wait_policy()
# A kernel build or a tokenizer conversion at first use says so, also to a program that set up
# no logging (see user_log.py).
configure_package_logging()

_HOMES = {
    "LLM": "batchpage.llm",
    "SamplingParams": "batchpage.sampling_params",
    "BeamSearchParams": "batchpage.sampling_params",
    "StructuredOutputsParams": "batchpage.sampling_params",
    "RequestOutput": "batchpage.request_outputs",
    "CompletionOutput": "batchpage.request_outputs",
    "PoolingParams": "batchpage.pooling_params",
    "PoolingRequestOutput": "batchpage.request_outputs",
    "LoRARequest": "batchpage.lora.request",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'batchpage' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
