"""ModelRunner: executes one step: block copies, one forward over the flattened tokens, logits of
the rows that sample. It holds the model, the KV pool tensors and the attention backend."""

from __future__ import annotations

import torch

from batchpage.attention.backend import AttentionBackend
from batchpage.cache.kv_cache import KVCache
from batchpage.cache.kv_manager import BlockCopy
from batchpage.engine.step_inputs import StepInputs
from batchpage.model.llama import LlamaForCausalLM


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton kernels on CUDA, the torch implementation of the same layout elsewhere."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from batchpage.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    from batchpage.attention.torch_backend import TorchPagedAttention

    return TorchPagedAttention()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, attention: AttentionBackend) -> None:
        self.model = model
        self.kv = kv
        self.attention = attention

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, copies: list[BlockCopy]) -> torch.Tensor:
        """Returns float32 logits [N, vocab] for inputs.sample_seqs, in that order."""
        for c in copies:
            self.kv.copy_block(c.src, c.dst)
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.meta, self.kv, self.attention
        )
        return self.model.compute_logits(hidden[inputs.logits_indices])
