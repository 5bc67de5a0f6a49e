"""A step's M-RoPE positions (Qwen2.5-VL): int64 [3, T] for the step builder of a model whose
rope has sections (ModelConfig.mrope_section; model/mrope.py).

Every token at sequence index p is at p + its row's rope_delta on all three axes (a text-only
row's delta is 0), except the prompt tokens of a prompt with images, which take the prompt's
own 3-D positions (Request.mrope). A recomputed sequence (after a preemption) and a prompt that
starts past a prefix-cache hit read the same positions as a first prefill, and drafts and
generated tokens are past the prompt, so every token's positions are the same whichever way its
step was made.
"""

from __future__ import annotations

import numpy as np

from batchpage.engine.input_batch import InputBatch


def step_positions(
    batch: InputBatch,
    rows: np.ndarray,  # int64 [B]: the scheduled rows
    token_rows: np.ndarray,  # int64 [T]: each token's row
    positions: np.ndarray,  # int64 [T]: each token's index in its sequence
    start: np.ndarray,  # int64 [B]: each row's first index this step
    end: np.ndarray,  # int64 [B]: past its last
    query_start: np.ndarray,  # int64 [B + 1]: each row's first token of the step
) -> np.ndarray:  # int64 [3, T]
    """The step's tokens' positions on the three axes."""
    out = np.repeat((positions + batch.rope_delta[token_rows])[None, :], 3, axis=0)
    prompt = np.flatnonzero(batch.has_images[rows] & (start < batch.num_prompt[rows]))
    for i in prompt.tolist():
        mrope = batch.seq_at(int(rows[i])).request.mrope
        assert mrope is not None, "a prompt with images and no M-RoPE positions: this is a bug"
        a = int(start[i])
        b = min(int(end[i]), mrope.positions.shape[1])
        first = int(query_start[i])
        out[:, first : first + b - a] = mrope.positions[:, a:b]
    return out
