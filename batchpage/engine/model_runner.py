"""ModelRunner: executes one step: swaps and block copies, the step's attention plan, one forward
over the flattened tokens, logits of the rows that sample. It holds the model, the KV pool
tensors, the attention backend and the host copies of swapped-out sequences."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from batchpage.attention.backend import AttentionBackend
from batchpage.cache.kv_cache import KVCache
from batchpage.engine.decode_graphs import DecodeGraphs
from batchpage.engine.scheduler import SchedulerOutput
from batchpage.engine.step_inputs import StepInputs
from batchpage.model.causal_lm import CausalLM


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton kernels on CUDA; on CPU the C++ attention kernels when they build here, else the
    torch implementation of the same layout (with a warning that says why)."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from batchpage.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    from batchpage.attention.torch_backend import TorchPagedAttention

    if name == "torch":
        return TorchPagedAttention()
    if device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' needs device='cpu'; got {device}")
    from batchpage.attention.cpu_backend import CpuPagedAttention
    from batchpage.kernels.cpu_paged_decode import CpuPagedDecode, KernelBuildError
    from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill

    try:
        return CpuPagedAttention(CpuPagedDecode.build(), CpuPagedPrefill.build())
    except KernelBuildError as exc:
        if name == "cpu":
            raise
        warnings.warn(f"{exc}; using attention_backend='torch'", stacklevel=2)
        return TorchPagedAttention()


def uses_cpu_kernels(attention: AttentionBackend) -> bool:
    """Whether the engine runs the C++ CPU kernels, which the C++ layer ops go with: a CPU
    engine with attention_backend='torch' stays all torch."""
    from batchpage.attention.cpu_backend import CpuPagedAttention

    return isinstance(attention, CpuPagedAttention)


class StepOutput(NamedTuple):
    """What a step's forward gives. `logits`: [N, vocab] for inputs.sample_seqs, in that order,
    in the dtype `CausalLM.compute_logits` gives (the model's, or float32); for a pooling model,
    their hidden states [N, hidden] instead (the last prompt position's). `prompt_logits`:
    [P, vocab] for inputs.prompt_rows, None when no sequence asked for prompt logprobs.
    `pooled`: hidden states [R, hidden] of inputs.pool_rows, None when there are none."""

    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    pooled: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        attention: AttentionBackend,
        decode_graphs: DecodeGraphs | None = None,
        pooling: bool = False,
    ) -> None:
        """With decode_graphs, a step of decodes alone (each sampling, none scoring its prompt)
        of at most its largest size runs through them (decode_graphs.py). `pooling`: the model
        is a pooling model, whose steps give hidden states rather than logits."""
        self.model = model
        self.kv = kv
        self.attention = attention
        self.decode_graphs = decode_graphs
        self.head = _hidden if pooling else model.compute_logits
        self.swapped: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, decision: SchedulerOutput) -> StepOutput:
        """The step's logits (or a pooling model's hidden states): see StepOutput."""
        # Order matters: a block swapped out this step may be handed out again this step.
        for s in decision.swap_out:
            self.swapped[s.seq_id] = self.kv.swap_out(s.blocks)
        for s in decision.swap_in:
            self.kv.swap_in(s.blocks, self.swapped.pop(s.seq_id))
        for c in decision.copies:
            self.kv.copy_block(c.src, c.dst)
        graphs, meta = self.decode_graphs, inputs.meta
        if (
            graphs is not None
            and meta.is_decode_only
            and meta.num_seqs <= graphs.max_size
            and inputs.logits_indices.numel() == meta.num_seqs
            and not inputs.prompt_targets
        ):
            return StepOutput(graphs.run(inputs.input_ids, inputs.positions, meta))
        # What every layer's attention does depends only on the step's metadata: planned once.
        attention = self.attention.plan(inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv, attention)
        # index_select rather than advanced indexing: a plain row gather costs far less per step.
        # A step of decodes alone samples every row, in order: no gather at all.
        rows = inputs.logits_indices
        sampled = hidden if rows.numel() == hidden.shape[0] else hidden.index_select(0, rows)
        logits = self.head(sampled)
        prompt = None
        if inputs.prompt_targets:
            prompt = self.head(hidden.index_select(0, inputs.prompt_rows))
        pooled = hidden.index_select(0, inputs.pool_rows) if inputs.pool_owners else None
        return StepOutput(logits, prompt, pooled)


def _hidden(rows: torch.Tensor) -> torch.Tensor:
    return rows
