"""Megatron-style tensor parallelism: which part of each weight a rank holds.

A rank's model is its family's model built from the rank's config (`shard_config`): a 1/world
share of the query heads, of the K/V heads (each rank one whole K/V head, replicated, where there
are fewer K/V heads than ranks), of the MLP's and each expert's intermediate size, and of the
vocabulary (embedding and lm_head rows, padded to a multiple of the ranks). Loading then cuts
each checkpoint tensor to the shape of the rank's parameter (`TensorShard.narrow`): along the one
dimension where the two differ, the rank takes its chunk. That one rule covers column-parallel
weights (q/k/v, gate/up, the vocabulary: rows), row-parallel ones (o, down: columns), biases,
and replicated K/V heads, since a tensor of C chunks across W ranks gives rank r chunk r*C // W
(C = W: its own; C < W: a K/V head shared by W / C consecutive ranks, whose query heads are that
head's group). Tensors of equal shape (norms, the router, a pooling head) are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchpage.model.config import ModelConfig

# The linears whose inputs the ranks split (each rank's partial outputs are summed).
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class TensorShard:
    """This process's place in a tensor-parallel group: rank `rank` of `world` (1: no
    parallelism, every tensor whole)."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    def vocab_rows(self, vocab_size: int) -> int:
        """Embedding / lm_head rows per rank: the vocabulary split evenly, padded."""
        return -(-vocab_size // self.world)

    def vocab_start(self, vocab_size: int) -> int:
        return self.rank * self.vocab_rows(vocab_size)

    def narrow(
        self, name: str, tensor: torch.Tensor, shape: torch.Size, pad: bool = False
    ) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` for a parameter of `shape`: the whole
        tensor when the shapes agree, else its chunk along the one dimension that differs.
        `pad` (the vocabulary's rows only): the last chunks may run past the tensor and are
        padded with zero rows. ValueError when no chunk fits."""
        if tensor.shape == shape or self.world == 1:
            return tensor
        dims = [d for d in range(tensor.dim()) if tensor.shape[d] != shape[d]]
        if tensor.dim() != len(shape) or len(dims) != 1:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected a tensor-parallel "
                f"share of shape {tuple(shape)}"
            )
        dim = dims[0]
        full, local = tensor.shape[dim], shape[dim]
        if full % local == 0 and self.world % (full // local) == 0:
            chunks = full // local
            return tensor.narrow(dim, self.rank * chunks // self.world * local, local)
        if pad and local == -(-full // self.world):  # padded to world * local rows
            start = self.rank * local
            part = tensor.narrow(dim, start, max(0, min(local, full - start)))
            pad = list(tensor.shape)
            pad[dim] = local - part.shape[dim]
            return torch.cat([part, tensor.new_zeros(pad)], dim=dim)
        raise ValueError(
            f"weight {name!r} has {full} entries along dimension {dim}: it does not split into "
            f"{self.world} tensor-parallel shares of {local}"
        )


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config a rank's model is built from (the vocabulary stays whole: the embedding and
    lm_head take their rows from TensorShard.vocab_rows). ValueError naming the size that does
    not divide."""
    if world == 1:
        return cfg

    def check(name: str, value: int) -> None:
        if value % world:
            raise ValueError(
                f"tensor_parallel_size={world} does not divide this model's {name}={value}: "
                "use a tensor_parallel_size that does"
            )

    check("num_attention_heads", cfg.num_heads)
    check("intermediate_size", cfg.intermediate_size)
    if cfg.num_kv_heads >= world:
        check("num_key_value_heads", cfg.num_kv_heads)
        kv_heads = cfg.num_kv_heads // world
    elif world % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world} is neither a divisor nor a multiple of this model's "
            f"num_key_value_heads={cfg.num_kv_heads}: use one that is"
        )
    else:
        kv_heads = 1  # each K/V head replicated on world / num_kv_heads ranks
    moe = cfg.moe
    if moe is not None:
        check("moe_intermediate_size", moe.intermediate_size)
        moe = replace(moe, intermediate_size=moe.intermediate_size // world)
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=kv_heads,
        intermediate_size=cfg.intermediate_size // world,
        moe=moe,
    )
