"""Decode steps at static shapes: padded to a ladder of batch sizes, captured as CUDA graphs.

A decode step's forward launches the same kernels every step; on a GPU their launch costs more
than their work at small batches. As vLLM does, the forward of a decode step of B sequences is
captured once per size of a ladder (1, 2, 4, then steps of 8 up to max_num_seqs) and replayed:
the step's inputs are copied into static buffers padded to the next size up, the graph replays,
and the first B rows of its logits are the step's.

Padding rows are sequences of one token at position 0 whose K/V slot and context is the pad
block, a block of the pool that the block pool never hands out: every backend writes and reads
it like any other block, and no real sequence sees it. The planned attention of a graph is
sized for max_model_len (the kernels take it as an upper bound on the context), so one capture
serves every context length.

An M-RoPE model's (Qwen2.5-VL's) positions are [3, B] (engine/mrope_steps.py: a one-token step
of a prompt may be an image's row), captured as such; padding rows are at 0 on every axis.

Without capture (another device, or enforce_eager) the same padded forward runs eagerly: the
CPU tests check it gives exactly the unpadded step's logits and K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.backend import AttentionBackend
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.causal_lm import CausalLM


def ladder(max_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_size (which ends it when it is not one)."""
    sizes = [s for s in (1, 2, 4) if s < max_size]
    sizes += range(8, max_size, 8)
    return [*sizes, max_size]


@dataclass
class _Graph:
    logits: torch.Tensor  # [size, vocab]: what a replay writes
    graph: torch.cuda.CUDAGraph


class DecodeGraphs:
    """Static-shape decode forwards for the batch sizes of `sizes` (ascending).

    Owns its input buffers; `run` copies a step's decode inputs into them, so the caller's
    tensors are never captured. Contract: `pad_block` is a block of `kv` that no sequence ever
    holds (its contents are garbage by design)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        attention: AttentionBackend,
        sizes: list[int],
        max_model_len: int,
        pad_block: int,
        capture: bool,
    ) -> None:
        if sizes != sorted(set(sizes)) or not sizes or sizes[0] < 1:
            raise ValueError(f"decode graph sizes must ascend from >= 1; got {sizes}")
        self.model, self.kv, self.attention = model, kv, attention
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = kv.block_size
        self.pad_slot = pad_block * self.block_size
        device = kv.k[0].device
        n, max_blocks = sizes[-1], -(-max_model_len // self.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        axes = (3,) if model.config.mrope_section else ()
        self.positions = torch.zeros((*axes, n), dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.tables = torch.full((n, max_blocks), pad_block, dtype=torch.int32, device=device)
        self.capture = capture
        self._graphs: dict[int, _Graph] = {}
        self._pool = None  # one CUDA memory pool shared by every size's graph

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        assert self.capture, "nothing to capture: this instance runs eagerly"
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size)

    def run(
        self,
        input_ids: torch.Tensor,  # int64 [B]
        positions: torch.Tensor,  # int64 [B]; an M-RoPE model's [3, B]
        meta: AttentionMetadata,  # a decode step of B sequences
    ) -> torch.Tensor:  # [B, vocab]: a view, valid until the next run
        batch = input_ids.shape[0]
        assert meta.is_decode_only and meta.num_seqs == batch <= self.max_size
        size = self.size_for(batch)
        graph = self._graphs.get(size)
        if graph is None and self.capture:  # capture_all was not called: this size now
            graph = self._graphs[size] = self._capture(size)
        width = meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[..., :batch].copy_(positions, non_blocking=True)
        self.slots[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        # Columns past this step's width may hold an earlier, longer step's blocks: harmless,
        # as each row reads only the blocks its seq_len covers.
        self.tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        self._reset_padding(batch, size)
        if graph is not None:
            graph.graph.replay()
            return graph.logits[:batch]
        return self._forward(size, self._meta(size, meta.seq_lens_cpu))[:batch]

    def _reset_padding(self, batch: int, size: int) -> None:
        # Rows batch..size are padding: a one-token sequence on the pad block.
        if batch < size:
            self.input_ids[batch:size].zero_()
            self.positions[..., batch:size].zero_()
            self.slots[batch:size].fill_(self.pad_slot)
            self.seq_lens[batch:size].fill_(1)
            self.tables[batch:size, 0].fill_(self.pad_slot // self.block_size)

    def _meta(self, size: int, seq_lens_cpu: tuple[int, ...]) -> AttentionMetadata:
        """The static buffers' first `size` rows as a step; `seq_lens_cpu` are the host copies
        the backend plans with (padding rows count 1)."""
        lens = tuple(seq_lens_cpu) + (1,) * (size - len(seq_lens_cpu))
        return AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=self.query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.tables[:size],
            block_size=self.block_size,
            query_lens_cpu=(1,) * size,
            seq_lens_cpu=lens,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        plan = self.attention.plan(meta)
        positions = self.positions[..., :size]
        hidden = self.model(self.input_ids[:size], positions, meta, self.kv, plan)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int) -> _Graph:
        # Planned for the longest context: a replay serves any context up to max_model_len.
        self._reset_padding(0, size)
        meta = self._meta(size, (self.max_model_len,) * size)
        self._forward(size, meta)  # warm up: kernels compiled and autotuned outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size, meta)
        self._pool = graph.pool()
        return _Graph(logits, graph)
