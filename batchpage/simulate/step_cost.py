"""What one engine step costs: its work (FLOPs, bytes moved, bytes all-reduced) from the model's
shape and the step's sequences, and its time on a device (a roofline with efficiency factors).

Work of a step whose sequences compute `new` tokens each after `context` cached ones:
- linears: 2 FLOPs per weight per token (q, k, v, o and the MLP of every layer; a MoE layer's
  active experts only), and the lm_head for each row that samples (the last of a prompt's
  tokens, every decode token);
- attention: per layer and query token, q.k and p.v over the keys before it: 4 * heads *
  head_dim FLOPs per key; a chunk of `new` tokens after `context` sees context + (new + 1) / 2
  keys on average (causal);
- bytes: every weight once (the step's matmuls stream them), each sequence's K/V read
  (context + new tokens) and written (new tokens), except that a block several of the step's
  sequences read (a shared prefix's, from the radix cache) is read from memory once: the other
  reads find it in the CPU's caches or the GPU's L2;
- under tensor parallelism each rank holds 1/tp of the weights, heads and K/V, and each layer
  all-reduces its attention and MLP outputs: 2 all-reduces of [tokens, hidden] a layer.

Time = overhead + per_seq * sequences + per_prefill * prefilling sequences + max(linear FLOPs /
(peak FLOP/s * compute_eff) + attention FLOPs / (peak FLOP/s * attention_eff, decode_attention_eff
for one-token rows), bytes / (peak bandwidth * memory_eff)) +
all-reduce bytes * 2 (tp - 1) / tp / link bandwidth (a ring all-reduce moves that much through
each link) + link latency per all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from batchpage.model.config import ModelConfig
from batchpage.simulate.devices import DeviceSpec


@dataclass(frozen=True)
class ModelShape:
    """The sizes a step's cost depends on, and the bytes of one weight and one K/V element."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 1  # experts a MoE layer holds (1: a dense MLP)
    active_experts: int = 1  # experts each token runs through
    weight_bytes: float = 2.0  # per weight: 2 for bf16, 4 for float32, about 0.56 for int4 g128
    kv_bytes: int = 2  # per K/V element
    tied_embeddings: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bytes: float, kv_bytes: int) -> ModelShape:
        moe = cfg.moe
        return cls(
            layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=moe.intermediate_size if moe else cfg.intermediate_size,
            vocab=cfg.vocab_size,
            experts=moe.num_experts if moe else 1,
            active_experts=moe.top_k if moe else 1,
            weight_bytes=weight_bytes,
            kv_bytes=kv_bytes,
            tied_embeddings=cfg.tie_word_embeddings,
        )

    @property
    def attention_weights(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        return q_and_o + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def token_weights(self) -> int:
        """Weights each token multiplies, the lm_head apart."""
        mlp = 3 * self.hidden * self.intermediate * self.active_experts
        return self.layers * (self.attention_weights + mlp)

    @property
    def num_weights(self) -> int:
        mlp = 3 * self.hidden * self.intermediate * self.experts
        tables = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        norms = (2 * self.layers + 1) * self.hidden
        return self.layers * (self.attention_weights + mlp) + tables + norms

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes


class StepWork:
    """The work of one step (per rank under tensor parallelism), summed as sequences join."""

    def __init__(self, shape: ModelShape, tp: int = 1) -> None:
        self.shape, self.tp = shape, tp
        self.flops = 0.0  # the linears'
        self.attention_flops = 0.0
        self.decode_attention_flops = 0.0  # of attention_flops: one-token rows' (decodes)
        self.bytes = shape.num_weights * shape.weight_bytes / tp
        self.tokens = 0
        self.seqs = 0
        self.prefills = 0  # sequences computing prompt tokens (more than one, or their first)

    def add(self, new: int, context: int, samples: bool) -> None:
        """A sequence computing `new` tokens after `context` computed ones; `samples`: its
        last row goes through the lm_head."""
        s = self.shape
        keys = context + (new + 1) / 2
        attention = 4 * s.layers * s.heads * s.head_dim * new * keys
        linear = 2 * new * s.token_weights + (2 * s.vocab * s.hidden if samples else 0)
        self.flops += linear / self.tp
        self.attention_flops += attention / self.tp
        if new == 1:
            self.decode_attention_flops += attention / self.tp
        self.bytes += (context + 2 * new) * s.kv_bytes_per_token / self.tp
        self.tokens += new
        self.seqs += 1
        self.prefills += new > 1 or context == 0

    def read_once(self, tokens: int) -> None:
        """`tokens` of the context `add` counted are read again by another sequence of the step
        (blocks of a shared prefix): the step reads their K/V from memory once, not again."""
        self.bytes -= tokens * self.shape.kv_bytes_per_token / self.tp

    @property
    def allreduce_bytes(self) -> float:
        """Bytes each rank all-reduces this step (two [tokens, hidden] a layer, activations in
        the weights' float width, at least 2 bytes)."""
        if self.tp == 1:
            return 0.0
        width = max(2.0, min(4.0, self.shape.weight_bytes))
        return 2 * self.shape.layers * self.tokens * self.shape.hidden * width


@dataclass(frozen=True)
class Efficiency:
    """How far from its datasheet a device runs this engine, fitted to measured runs."""

    compute: float = 0.5  # share of peak FLOP/s the linears' matmuls reach
    attention: float = 0.3  # share of peak FLOP/s attention over the paged K/V reaches
    # the same for one-token rows, which a decode kernel runs (other kernels than a prompt's)
    decode_attention: float = 0.3
    memory: float = 0.7  # share of peak bandwidth the weight and K/V reads reach
    overhead_s: float = 0.0  # per step: the engine's own work, launches, the host round trip
    per_seq_s: float = 0.0  # per running sequence per step: input building, sampling, stops
    # per sequence computing prompt tokens in a step: its admission (KV blocks, the radix cache)
    per_prefill_s: float = 0.0


class StepCost:
    """Seconds of a step on `device` with `tp` ranks."""

    def __init__(self, shape: ModelShape, device: DeviceSpec, eff: Efficiency, tp: int = 1):
        if tp > device.max_tp:
            raise ValueError(f"tp={tp}: a {device.name} node has {device.max_tp} devices")
        self.shape, self.device, self.eff, self.tp = shape, device, eff, tp

    def work(self, seqs: Iterable[tuple[int, int, bool]]) -> StepWork:
        work = StepWork(self.shape, self.tp)
        for new, context, samples in seqs:
            work.add(new, context, samples)
        return work

    def seconds(self, work: StepWork, eff: Efficiency | None = None) -> Any:
        """The step's time under self.eff, or under `eff`, whose values may be 0-d tensors
        (a fit differentiates the time through them)."""
        d, e = self.device, eff or self.eff
        compute = work.flops / (d.flops * e.compute)
        prompt_attention = work.attention_flops - work.decode_attention_flops
        compute = compute + prompt_attention / (d.flops * e.attention)
        compute = compute + work.decode_attention_flops / (d.flops * e.decode_attention)
        memory = work.bytes / (d.bandwidth * e.memory)
        if not d.overlap:
            busy = compute + memory
        elif torch.is_tensor(compute):
            busy = torch.maximum(compute, memory)
        else:
            busy = max(compute, memory)
        per_step = e.overhead_s + e.per_seq_s * work.seqs + e.per_prefill_s * work.prefills
        return per_step + busy + self.comm_seconds(work)

    def comm_seconds(self, work: StepWork) -> float:
        """The step's all-reduces over the node's links (no efficiency factor applies)."""
        if self.tp == 1:
            return 0.0
        d = self.device
        ring = 2 * (self.tp - 1) / self.tp
        return (
            work.allreduce_bytes * ring / d.link_bandwidth
            + 2 * self.shape.layers * d.link_latency_s
        )
