"""UnsupportedModelError, the refusal of a checkpoint batchpage cannot run, in a module of its
own so that every layer that refuses (model configs, quantization schemes) can raise it."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but its architecture or a feature of it is not implemented."""
