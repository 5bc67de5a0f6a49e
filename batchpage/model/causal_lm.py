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
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, GatedMLP, RMSNorm, linear
from batchpage.model.packed_linear import (
    ONEDNN_PACKING,
    LinearPacking,
    PackReport,
    pack_linear_modules,
)
from batchpage.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from batchpage.kernels.cpu_layer_ops import CpuLayerOps
    from batchpage.model.direct_forward import DirectForward

ShardKey = Hashable | None  # None: the whole parameter


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
    ):
        """max_positions: size of the rope tables (default: cfg.max_model_len); pass the
        engine's max_model_len to save memory on long-context checkpoints."""
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = cfg
        self.max_positions = max_positions or cfg.max_model_len
        self.embed_tokens = skip_init(
            nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.rotary = RotaryEmbedding(cfg, self.max_positions, device)
        self.layers = nn.ModuleList(
            self.make_layer(i, cfg, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.direct: DirectForward | None = None  # set by use_direct_forward
        self.lm_head: nn.Module | None = (
            None
            if cfg.tie_word_embeddings
            else linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        )
        # A tied model's lm_head in a packed layout, set by prepack_linears (the embedding keeps
        # its plain table for lookups).
        self.tied_head: nn.Module | None = None

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must build its decoder layers")

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T], absolute position of each token in its sequence
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        if self.direct is not None:
            return self.direct(input_ids, positions, meta, kv, attn)
        cos, sin = self.rotary(positions, meta)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta, kv, attn)
        return self.norm(x) if residual is None else self.norm.add_norm(x, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        """The lm_head's output in the model's dtype, as HF computes it; whoever needs float32
        (sampling, logprobs) converts the rows it uses. A greedy step only takes each row's
        argmax, exact in any dtype, and skips a float32 copy of every row (64 x 49152 floats
        for SmolLM2 at 64 running sequences)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_head is not None:
            return self.tied_head(hidden)
        return F.linear(hidden, self.embed_tokens.weight)

    def prepack_linears(self, packing: LinearPacking = ONEDNN_PACKING) -> PackReport:
        """Move every linear, the lm_head included, to a prepacked layout: oneDNN's by default,
        or the modules `packing` makes (see model/packed_linear.py, `linear_packing`, which
        checks that it applies here); where it fuses SiLU(gate) * up, each SiLU GatedMLP's
        gate/up linear becomes one that returns the activation. Inference only: the plain
        weights are dropped, so load_weights no longer applies. Packing twice is a no-op."""
        self.direct = None  # it called the old linears: use_direct_forward builds it anew
        fused = 0
        if packing.silu_mul is not None:
            for mlp in self.modules():
                if isinstance(mlp, GatedMLP) and mlp.silu_gated:
                    gate_up = mlp.gate_up_proj
                    if isinstance(gate_up, nn.Linear) and gate_up.bias is None:
                        mlp.gate_up_proj = packing.silu_mul(gate_up.weight)
                        mlp.gate_up_activated = True
                        fused += 1
        packed = fused + pack_linear_modules(self, packing.linear)
        if self.lm_head is not None or self.tied_head is not None:  # untied, or packed before
            return PackReport(packed, 0)
        table = self.embed_tokens.weight
        self.tied_head = packing.linear(table, None)
        return PackReport(packed + 1, table.numel() * table.element_size())

    def use_layer_ops(self, ops: CpuLayerOps | None) -> int:
        """Run the layers' norms, gated activations and rope through the CPU ops (C++,
        kernels/cpu_layer_ops.py; None: back to torch). Returns how many modules took them.
        Families with their own norm or activation (Gemma's) keep those in torch. Drops the
        direct path, which called the previous ops."""
        users = [m for m in self.modules() if isinstance(m, (RMSNorm, GatedMLP, Attention))]
        for m in users:
            m.layer_ops = ops
        self.direct = None  # it called the old ops: use_direct_forward builds it anew
        return len(users)

    def use_direct_forward(self) -> bool:
        """Run forward as direct calls into the CPU kernels (model/direct_forward.py: the same
        kernels and values without the modules' Python) where every layer allows it; call after
        prepack_linears and use_layer_ops. Returns whether it applies."""
        from batchpage.model.direct_forward import DirectForward

        own = type(self).forward is CausalLM.forward  # not Gemma's, say: its stack is its own
        self.direct = DirectForward.build(self) if own else None
        return self.direct is not None

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

        Raises ValueError on unknown names, wrong shapes, or parameters left unloaded.
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
            dest = self._shard_view(target, key)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            keys = self._shard_keys(target) if key is None else [key]
            pending.difference_update((target, k) for k in keys)
        missing = sorted({name for name, _ in pending})
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

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
