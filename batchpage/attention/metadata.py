"""The step's attention inputs: everything a backend needs to read and write paged K/V.

One step runs B sequences; their new tokens are flattened into T rows (sequence after sequence).
Sequence b owns rows query_start_loc[b]:query_start_loc[b+1]. Those rows are the *last* q_len
positions of a context of seq_lens[b] tokens, so prefill, prefill over a cached prefix, a chunk of
a long prompt and a decode step are all the same case: the new tokens' K/V are written into the
pool first (slot_mapping), then every query row attends to the paged context up to and including
its own position (causal), read through block_tables[b].

Bidirectional image spans (Gemma 3's image rows see each other both ways): `key_end`, when set,
bounds each query row's keys by position instead of causality: row i sees the context positions
before key_end[i] (and, on a sliding-window layer, from its window's start on, as ever). A row
inside such a span has its span's end there; every other row its own position + 1 (causal).
None, the case of every text step, is causal for every row at no cost. The scheduler never ends
a chunk inside such a span, so key_end never passes a row's seq_len; `span_seqs` names the
sequences with a row that sees past itself, so that a backend plans them apart (attention/
spans.py) without reading key_end back from the device.

Slots: slot = block_id * block_size + offset_in_block. Token i of sequence b (0-based position in
its context) lives in block block_tables[b, i // block_size] at offset i % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: where each new token's K/V is stored
    query_start_loc: torch.Tensor  # int32 [B + 1]: cu_seqlens of the query rows
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks]: padded with 0 past each table's end
    block_size: int
    # Host copies, so that backends can plan without a device sync.
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # int32 [T]: the exclusive end of the context positions each row sees (see above); None:
    # causal for every row.
    key_end: torch.Tensor | None = None
    # The sequences (indices into the step's B) with a row whose key_end passes its position + 1,
    # in order; () when key_end is None.
    span_seqs: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
