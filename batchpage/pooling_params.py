"""PoolingParams: per-request options of LLM.embed / classify / score / reward (vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

from batchpage.model.config import HeadConfig


@dataclass(frozen=True)
class PoolingParams:
    # Matryoshka embeddings: keep the first `dimensions` values (before normalizing); only for
    # a checkpoint whose config says it was trained so (is_matryoshka, matryoshka_dimensions).
    dimensions: int | None = None
    # embed: divide by the L2 norm (None: yes).
    normalize: bool | None = None
    # classify and score: softmax over the labels, or a sigmoid for one (None: yes); reward:
    # the same (None: no, the raw outputs).
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an integer >= 1; got {self.dimensions!r}")

    def check_dimensions(self, head: HeadConfig, hidden_size: int) -> str | None:
        """Why `dimensions` does not fit this checkpoint; None when it does (or is unset)."""
        d = self.dimensions
        if d is None:
            return None
        if not head.matryoshka:
            return (
                f"dimensions={d}: this model was not trained for Matryoshka embeddings "
                "(config.json has no is_matryoshka or matryoshka_dimensions); leave it unset"
            )
        allowed = head.matryoshka_dimensions
        if (allowed and d not in allowed) or d > hidden_size:
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            return f"dimensions={d} is not one the model supports: {sizes}"
        return None
