"""CausalLM: what every family shares: token embedding, rope, the decoder layers, final norm,
lm_head, and loading checkpoint tensors by name.

A family subclass says how to build layer i (`make_layer`) and how its checkpoint names map to
its parameters (`RENAMES`, or `checkpoint_target` for names a table cannot express).

The model sees one engine step at a time: the new tokens of all scheduled sequences flattened
into T rows, with their absolute positions. Attention is delegated to an AttentionBackend, which
writes the rows' K/V into the paged pool and attends through the block tables in `meta`; the
model itself holds no per-request state.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn.utils import skip_init

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig
from batchpage.model.layers import (
    Attention,
    RMSNorm,
    TiedEmbedding,
    UsesLayerOps,
    VocabShardEmbedding,
    linear,
)
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.model.rope import RotaryEmbedding
from batchpage.model.score_head import make_score_head
from batchpage.model.shard import TensorShard
from batchpage.ops.collective import Collective
from batchpage.ops.linear import LinearOp, dtype_format
from batchpage.ops.linear_method import LinearSpec, LinearWeights
from batchpage.ops.select import ModelOps
from batchpage.ops.workspace import Workspace

ShardKey = Hashable | None  # None: the whole parameter


@dataclass(frozen=True)
class BindReport:
    """What bind did: the linears its method replaced, the extra bytes it keeps (a tied
    lm_head's copy in the method's layout), and the layer count per weight format."""

    linears: int
    extra_bytes: int
    weight_formats: dict[str, int]


class ImageEmbeds(NamedTuple):
    """Inputs that replace token embeddings in a step (a prompt's image positions, whose rows
    come from the vision tower): `rows[i]` is the input of token row `index[i]`."""

    index: torch.Tensor  # int64 [K]
    rows: torch.Tensor  # [K, hidden]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x ([T, hidden], the step's token embeddings) with the rows replaced, in place."""
        return x.index_copy_(0, self.index, self.rows.to(x.dtype))


class CausalLM(nn.Module):
    family: ClassVar[str]
    # Checkpoint module name (between dots) -> (our module name, shard key within it).
    RENAMES: ClassVar[dict[str, tuple[str, ShardKey]]] = {}

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
        shard: TensorShard | None = None,
    ):
        """max_positions: size of the rope tables (default: cfg.max_model_len); pass the
        engine's max_model_len to save memory on long-context checkpoints. With `shard`, this is
        one tensor-parallel rank's model: `cfg` is its share (model/shard.py shard_config),
        the embedding and lm_head hold its rows of the vocabulary, and loading cuts each
        checkpoint tensor to its part."""
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = cfg
        self.shard = shard = shard or TensorShard()
        self.max_positions = max_positions or cfg.max_model_len
        vocab_rows = shard.vocab_rows(cfg.vocab_size)
        self.embed_tokens: nn.Embedding | TiedEmbedding | VocabShardEmbedding = (
            skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
            if shard.world == 1
            else VocabShardEmbedding(
                vocab_rows, shard.vocab_start(cfg.vocab_size), cfg.hidden_size, dtype, device
            )
        )
        self.rotary = RotaryEmbedding(cfg, self.max_positions, device)
        self.layers = nn.ModuleList(
            self.make_layer(i, cfg, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head: LinearOp | None = (
            None
            if cfg.tie_word_embeddings or cfg.head.pools
            else linear(cfg.hidden_size, vocab_rows, False, dtype, device)
        )
        # A pooling checkpoint's head, named as in its files (score.weight; score.0 / score.2).
        self.score: nn.Module | None = make_score_head(cfg, dtype, device)
        # A tied model's lm_head in its linear method's layout, set by bind (the embedding keeps
        # its plain table for lookups); None: the embedding table itself multiplies.
        self.tied_head: LinearOp | None = None
        # A tied model whose file stores the embedding table quantized (a GGUF's Q8_0
        # token_embd): that table as a quantized linear, which bind makes the tied head, as
        # llama.cpp multiplies it. Until bind the embedding holds a dequantized copy; bind
        # drops it, and lookups read the head's rows (TiedEmbedding).
        self.tied_quant: LinearOp | None = None
        self.bound: ModelOps | None = None  # set once, by bind
        self.comm = Collective()  # the tensor-parallel group's, set by bind

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must build its decoder layers")

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T], each token's position ([3, T]: M-RoPE, rope.py)
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
        embeds: ImageEmbeds | None = None,  # rows that replace token embeddings (images)
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        cos, sin = self.rotary(positions, meta)
        residual = self.embed_tokens(input_ids)  # the stream, updated in place by every layer
        if embeds is not None:
            embeds.apply(residual)
        ws = Workspace(residual.shape[0], residual.dtype, residual.device)
        delta = None
        for layer in self.layers:
            delta = layer(delta, residual, cos, sin, meta, kv, attn, ws)
        out = torch.empty_like(residual)
        if delta is None:
            self.norm.norm_into(out, residual)
        else:
            self.norm.add_norm_into(out, residual, delta)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        """The lm_head's output in the model's dtype, as HF computes it; whoever needs float32
        (sampling, logprobs) converts the rows it uses. A greedy step only takes each row's
        argmax, exact in any dtype, and skips a float32 copy of every row. Under tensor
        parallelism every rank computes its vocabulary rows' logits, and every rank gets them
        all (`comm.gather_columns`, the padding rows cut)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)
        elif self.tied_quant is not None:
            logits = self.tied_quant(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        if self.shard.world == 1:
            return logits
        return self.comm.gather_columns(logits)[:, : self.config.vocab_size]

    def head_rows(self, ids: list[int]) -> torch.Tensor:  # float32 [len(ids), hidden]
        """Rows of the lm_head (a tied model's embedding table), dequantized where the head is
        held quantized; before bind."""
        index = torch.tensor(ids)
        head = self.tied_quant if self.tied_quant is not None else self.lm_head
        return self.embed_tokens.weight[index].float() if head is None else head.weight_rows(index)

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> float32 [N, D]
        """A pooling model's output for pooled hidden states: its score head's (labels), or the
        states themselves (an embedding model, D = hidden), in float32."""
        if self.score is None:
            return pooled.float()
        return self.score(pooled.to(next(self.score.parameters()).dtype)).float()

    @torch.no_grad()
    def bind(self, ops: ModelOps) -> BindReport:
        """Bind the loaded model to the engine's ops, once: every linear becomes the module the
        linear method makes from its spec and loaded tensors (`LinearMethod.create`: the
        lm_head included; a tied one gets a copy in the method's layout beside the embedding
        table, unless torch's method multiplies the table itself), and every layer computes
        through `ops.layer`. Call after load_weights: a method that repacks drops the loaded
        tensors. Raises on a second call (a bound model holds no loaded linears)."""
        if self.bound is not None:
            raise RuntimeError("this model is bound already: bind it once, after loading")
        method = ops.linear
        quantized_table = self.tied_quant is not None
        loaded = [(n, m) for n, m in self.named_modules() if isinstance(m, LoadedLinear)]
        for name, module in loaded:
            parent, _, leaf = name.rpartition(".")
            made = method.create(module.spec, module.weights())
            setattr(self.get_submodule(parent), leaf, made)
        extra = 0
        if quantized_table:  # lookups read the quantized head's rows; the dense copy goes
            self.tied_head, self.tied_quant = self.tied_quant, None
            vocab = self.config.vocab_size
            self.embed_tokens = TiedEmbedding(
                self.tied_head,
                self.embed_tokens.weight.dtype,
                self.shard.vocab_start(vocab),
                self.shard.vocab_rows(vocab),
            )
        elif self.lm_head is None and method.make is not None and not self.config.head.pools:
            table = self.embed_tokens.weight  # the head: a copy in the method's layout
            spec = LinearSpec(table.shape[1], (table.shape[0],), False, table.dtype)
            self.tied_head = method.create(spec, LinearWeights(table, None, None))
            extra = table.numel() * table.element_size()
        for module in self.modules():
            if isinstance(module, UsesLayerOps):
                module.ops, module.comm = ops.layer, ops.comm
        self.comm = ops.comm
        self.bound = ops
        return BindReport(len(loaded), extra, self.weight_formats())

    def weight_bytes(self) -> int:
        """Bytes of weights this model holds, in whatever layout each layer keeps them (a
        tensor shared by two modules counted once; rope tables, derived, not counted)."""
        seen: set[int] = set()
        total = 0
        for module in self.modules():
            skip = module._non_persistent_buffers_set
            tensors = [*module._parameters.values()]
            tensors += [b for n, b in module._buffers.items() if n not in skip]
            for t in tensors:
                if t is None or t.is_meta:
                    continue
                # oneDNN's packed weights are opaque (no data pointer), and never shared.
                key = id(t) if t.is_mkldnn else t.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
        return total

    def weight_formats(self) -> dict[str, int]:
        """Linear layers per weight format (e.g. {"bf16": 211}), the lm_head among them."""
        formats: dict[str, int] = {}
        linears = [m for m in self.modules() if isinstance(m, LinearOp)]
        # A layer held in two forms (ops/measured_linear.DenseWithRows) is one layer.
        inner = {id(c) for m in linears for c in m.modules() if c is not m}
        for m in linears:  # the lm_head, or a tied model's copy, among them
            if id(m) not in inner:
                formats[m.weight_format] = formats.get(m.weight_format, 0) + 1
        tied = (self.tied_head, self.tied_quant)
        if self.lm_head is None and tied == (None, None):  # the embedding table multiplies
            name = dtype_format(self.embed_tokens.weight.dtype)
            formats[name] = formats.get(name, 0) + 1
        return formats

    def checkpoint_target(self, name: str) -> tuple[str, ShardKey]:
        """Checkpoint name without `model.` -> (our parameter name, shard key)."""
        for theirs, (ours, shard) in self.RENAMES.items():
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}.", 1), shard
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in the family's HF checkpoint (`model.layers.0.self_attn.q_proj.
        weight`, `lm_head.weight`, ...) into this model, casting to its dtype and device.

        Raises ValueError on unknown names, wrong shapes, or parameters left unloaded. A
        tensor-parallel rank's model takes its part of each (TensorShard.narrow); a tensor that
        fills a merged parameter whole (Phi-3's fused qkv_proj) is cut part by part.
        """
        params = dict(self.named_parameters())
        pending = {(name, key) for name in params for key in self._shard_keys(name)}
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store it; we derive it from the config
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still carry the copy
            target, key = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {ckpt_name!r} for this architecture")
            keys = self._shard_keys(target) if key is None else [key]
            for dest, part in self._destinations(ckpt_name, target, key, keys, tensor):
                if dest.shape != part.shape:
                    raise ValueError(
                        f"weight {ckpt_name!r} has shape {tuple(part.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                dest.copy_(part)
            pending.difference_update((target, k) for k in keys)
        missing = sorted({name for name, _ in pending})
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
        if self.shard.rank:  # a row-parallel bias is added once, by rank 0, before the sum
            for module in self.modules():
                if isinstance(module, Attention) and module.o_proj.bias is not None:
                    module.o_proj.bias.zero_()
        self.requires_grad_(False)  # inference only: the ops write into given outputs

    def _destinations(
        self,
        ckpt_name: str,
        target: str,
        key: ShardKey,
        keys: list[ShardKey],
        tensor: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter view, the part of `tensor` it takes) pairs for one checkpoint tensor."""
        if self.shard.world == 1:
            return [(self._shard_view(target, key), tensor)]
        if key is None and keys != [None]:  # a fused tensor for a merged parameter
            views = [self._shard_view(target, k) for k in keys]
            parts = tensor.split(self._fused_parts(ckpt_name, tensor, views), dim=0)
            return [
                (v, self.shard.narrow(ckpt_name, p, v.shape))
                for v, p in zip(views, parts, strict=True)
            ]
        dest = self._shard_view(target, key)
        vocab = target in ("embed_tokens.weight", "lm_head.weight") or target.startswith(
            "tied_quant."
        )
        return [(dest, self.shard.narrow(ckpt_name, tensor, dest.shape, pad=vocab))]

    def _fused_parts(
        self, ckpt_name: str, tensor: torch.Tensor, views: list[torch.Tensor]
    ) -> list[int]:
        """The checkpoint rows of each part of a fused tensor whose parts this rank holds
        `views` of. The first part (q, gate) is split over every rank; the others (k and v;
        up) too, or are K/V heads replicated over the ranks, C chunks each for some C < world
        that the rows left over give."""
        world = self.shard.world
        first, rest = views[0].shape[0] * world, [v.shape[0] for v in views[1:]]
        left = tensor.shape[0] - first
        chunks = left // sum(rest) if left > 0 and left % sum(rest) == 0 else 0
        if not chunks or world % chunks:
            raise ValueError(
                f"weight {ckpt_name!r} has {tensor.shape[0]} rows: it does not split into "
                f"{len(views)} parts for tensor_parallel_size={world}"
            )
        return [first, *(r * chunks for r in rest)]

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        module, _, leaf = name.rpartition(".")
        return self.get_submodule(module), leaf

    def _shard_keys(self, name: str) -> list[ShardKey]:
        owner, leaf = self._owner(name)
        return owner.shard_keys(leaf) if hasattr(owner, "shard_keys") else [None]

    def _shard_view(self, name: str, key: ShardKey) -> torch.Tensor:
        owner, leaf = self._owner(name)
        if key is None:
            return getattr(owner, leaf)
        if not hasattr(owner, "shard_view"):
            raise ValueError(f"{name} is not a merged parameter")
        return owner.shard_view(leaf, key)
