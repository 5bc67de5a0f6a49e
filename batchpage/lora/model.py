"""LoRAModel: a bound model's attention and MLP projections wrapped in LoRALinear, and the
adapter slots they share.

Which modules take adapters, by PEFT's names: self_attn.q_proj / k_proj / v_proj (the parts of
our fused qkv_proj), self_attn.o_proj, mlp.gate_proj / up_proj (the parts of gate_up_proj) and
mlp.down_proj, in every decoder layer that has them (a mixture-of-experts MLP takes none).
"""

from __future__ import annotations

import warnings

import torch

from batchpage.lora.adapter import LoRAAdapter, TargetShapes
from batchpage.lora.layers import (
    AdapterStep,
    KernelUpdate,
    LoRALinear,
    LoRAUpdate,
    TorchUpdate,
    TritonUpdate,
)
from batchpage.model.causal_lm import CausalLM
from batchpage.model.layers import Attention, GatedMLP


class LoRAModel:
    def __init__(self, model: CausalLM, slots: int, max_rank: int, dtype: torch.dtype) -> None:
        """Wraps model's projections (after bind: the base may be any linear implementation)
        with room for `slots` adapters of rank <= max_rank."""
        self.step = AdapterStep()
        self.slots = slots
        self.max_rank = max_rank
        # (layer, PEFT module name) -> (its LoRALinear, the target's index in it)
        self._where: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        self._layers: list[LoRALinear] = []
        shapes: dict[tuple[int, str], tuple[int, int]] = {}
        device = model.norm.weight.device
        update = choose_update(device, dtype)
        for i, layer in enumerate(model.layers):
            for owner, leaf, names, sizes in _projections(layer):
                base = getattr(owner, leaf)
                targets, start = [], 0
                for size in sizes:
                    targets.append((start, size))
                    start += size
                wrapped = LoRALinear(
                    base, targets, slots, max_rank, dtype, device, self.step, update
                )
                setattr(owner, leaf, wrapped)
                self._layers.append(wrapped)
                for t, (name, size) in enumerate(zip(names, sizes, strict=True)):
                    self._where[(i, name)] = (wrapped, t)
                    shapes[(i, name)] = (base.in_features, size)
        self.targets = TargetShapes(shapes)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` of every wrapped linear (zeros where it targets nothing)."""
        assert 0 <= slot < self.slots
        pieces: dict[LoRALinear, list] = {w: [None] * len(w.targets) for w in self._layers}
        for key, (a, b) in adapter.weights.items():
            wrapped, t = self._where[key]
            dtype = wrapped.lora_a.dtype
            pieces[wrapped][t] = (a.to(dtype), b.to(dtype))
        for wrapped, parts in pieces.items():
            wrapped.load(slot, parts)

    def set_step(self, token_slots: torch.Tensor | None) -> None:
        self.step.set(token_slots)


def choose_update(device: torch.device, dtype: torch.dtype) -> LoRAUpdate:
    """The Triton kernels on a GPU; the C++ kernel on a CPU in float32 or bf16 where it builds
    (else a warning says why); torch's matmuls everywhere else."""
    if device.type == "cuda":
        return TritonUpdate()
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return TorchUpdate()
    from batchpage.kernels.cpu_build import KernelBuildError
    from batchpage.kernels.cpu_lora import CpuLoRA

    try:
        return KernelUpdate(CpuLoRA.build())
    except KernelBuildError as exc:
        warnings.warn(f"{exc}; LoRA updates run on torch's matmuls", stacklevel=2)
        return TorchUpdate()


def _projections(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, list[str], list[int]]]:
    """(owner module, attribute, PEFT names of its targets, their output sizes) of each linear
    of a decoder layer that adapters may target."""
    found = []
    attn = getattr(layer, "self_attn", None)
    if isinstance(attn, Attention):
        found.append(
            (
                attn,
                "qkv_proj",
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                [attn.q_size, attn.kv_size, attn.kv_size],
            )
        )
        found.append((attn, "o_proj", ["self_attn.o_proj"], [attn.hidden]))
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, GatedMLP):
        found.append(
            (
                mlp,
                "gate_up_proj",
                ["mlp.gate_proj", "mlp.up_proj"],
                [mlp.intermediate, mlp.intermediate],
            )
        )
        found.append((mlp, "down_proj", ["mlp.down_proj"], [mlp.hidden]))
    return found
