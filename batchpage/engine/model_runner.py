"""ModelRunner: executes one step: swaps and block copies, adapter loads, the step's attention
plan, one forward over the flattened tokens, logits of the rows that sample. It holds the model,
the KV pool tensors, the attention backend, the host copies of swapped-out sequences and, with
enable_lora, the adapters read so far and the slots they run in (batchpage/lora)."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import torch

from batchpage.attention.backend import AttentionBackend
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.engine.config import EngineConfig
from batchpage.engine.decode_graphs import DecodeGraphs, ladder
from batchpage.engine.kv_manager import BlockCopy
from batchpage.engine.plan import EnginePlan, available_memory
from batchpage.engine.schedule_output import SchedulerOutput, Swap
from batchpage.engine.step_inputs import StepInputs
from batchpage.lora.adapter import LoRAAdapter
from batchpage.lora.model import LoRAModel
from batchpage.lora.registry import AdapterRegistry
from batchpage.model.causal_lm import BindReport, CausalLM, ImageEmbeds
from batchpage.model.quant_layout import linears
from batchpage.ops.collective import Collective
from batchpage.ops.select import select_model_ops
from batchpage.user_log import heartbeat

log = logging.getLogger(__name__)


def make_attention_backend(
    name: str, device: torch.device, batch_invariant: bool = False
) -> AttentionBackend:
    """auto: Triton kernels on CUDA; on CPU the C++ attention kernels when they build here, else the
    torch implementation of the same layout (with a warning that says why). `batch_invariant`:
    the C++ or Triton kernels in their batch-invariant mode, or an error that says why not."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from batchpage.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention(batch_invariant=batch_invariant)
    from batchpage.attention.torch_backend import TorchPagedAttention

    if name == "torch":
        return TorchPagedAttention()
    if device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' needs device='cpu'; got {device}")
    from batchpage.attention.cpu_backend import CpuPagedAttention
    from batchpage.kernels.cpu_paged_decode import CpuPagedDecode, KernelBuildError
    from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill

    try:
        return CpuPagedAttention(CpuPagedDecode.build(), CpuPagedPrefill.build(), batch_invariant)
    except KernelBuildError as exc:
        if name == "cpu" or batch_invariant:
            raise
        warnings.warn(f"{exc}; using attention_backend='torch'", stacklevel=2)
        return TorchPagedAttention()


def uses_triton_kernels(attention: AttentionBackend) -> bool:
    from batchpage.attention.triton_backend import TritonPagedAttention

    return isinstance(attention, TritonPagedAttention)


def uses_cpu_kernels(attention: AttentionBackend) -> bool:
    """Whether the engine runs the C++ CPU kernels, which the C++ layer ops go with: a CPU
    engine with attention_backend='torch' stays all torch."""
    from batchpage.attention.cpu_backend import CpuPagedAttention

    return isinstance(attention, CpuPagedAttention)


# The share of the memory left once the KV pool is allocated that a quantized model's layers
# may take held dense: a quantized checkpoint is often chosen to fit memory, so its dense form
# is a candidate only when it is small beside what the machine has left.
DENSE_COPY_SHARE = 8


def dense_copy_fits(model: CausalLM, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the model's integer-quantized linears, every one held dense in `dtype`, take at
    most 1 / DENSE_COPY_SHARE of the memory available now (measured choice may then hold a
    layer dense where that is faster: ops/measured_linear.py)."""
    layers = [m for _, m in linears(model) if m.spec.scheme and m.spec.scheme.integer]
    if not layers:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    dense = sum(m.out_features * m.in_features * size for m in layers)
    return dense * DENSE_COPY_SHARE <= available_memory(device)


class StepOutput(NamedTuple):
    """What a step's forward gives. `logits`: [N, vocab] for inputs.sample_seqs, in that order,
    in the dtype `CausalLM.compute_logits` gives (the model's, or float32); for a pooling model,
    their hidden states [N, hidden] instead (the last prompt position's). `prompt_logits`:
    [P, vocab] for inputs.prompt_rows, None when no sequence asked for prompt logprobs.
    `pooled`: hidden states [R, hidden] of inputs.pool_rows, None when there are none."""

    logits: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    pooled: torch.Tensor | None = None


class ForwardStep(NamedTuple):
    """What a rank needs to run one step: the block moves, then the forward's tensors. It holds
    no sequence, so it is the one message a tensor-parallel driver sends its workers a step."""

    swap_out: list[Swap]
    swap_in: list[Swap]
    copies: list[BlockCopy]
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]; an M-RoPE model's [3, T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [N]
    prompt_rows: torch.Tensor | None  # int64 [P]; None: no row scores its prompt
    pool_rows: torch.Tensor | None  # int64 [R]; None: no row is pooled
    lora_loads: list[tuple[int, LoRAAdapter]]  # adapters into their slots, before the forward
    token_lora: torch.Tensor | None  # int64 [T]: each token's slot (-1 base); None: no adapter
    embeds: ImageEmbeds | None  # rows that replace token embeddings (images); None: none

    @classmethod
    def of(
        cls,
        inputs: StepInputs,
        decision: SchedulerOutput,
        adapters: AdapterRegistry | None,
        embeds: ImageEmbeds | None = None,
    ) -> ForwardStep:
        loads = []
        if decision.lora_loads:
            assert adapters is not None
            loads = [(slot, adapters.get(lora)) for slot, lora in decision.lora_loads]
        return cls(
            decision.swap_out,
            decision.swap_in,
            decision.copies,
            inputs.input_ids,
            inputs.positions,
            inputs.meta,
            inputs.logits_indices,
            inputs.prompt_rows if inputs.prompt_targets else None,
            inputs.pool_rows if inputs.pool_owners else None,
            loads,
            inputs.token_lora,
            embeds,
        )


class Peers(Protocol):
    """The other ranks of a tensor-parallel group, driven from rank 0 (distributed/workers.py)."""

    @property
    def comm(self) -> Collective:
        """The group's collectives, which rank 0's model is bound to."""

    def send(self, step: ForwardStep) -> None:
        """Hand every worker this step, which it runs with rank 0's."""

    def failure(self, error: Exception) -> Exception:
        """What to raise when a step's collectives failed: names the rank that died."""

    def rank_threads(self) -> AbstractContextManager[None]:
        """Rank 0's share of the host's threads, while it runs a step."""


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        attention: AttentionBackend,
        decode_graphs: DecodeGraphs | None = None,
        pooling: bool = False,
        peers: Peers | None = None,
        lora: LoRAModel | None = None,
    ) -> None:
        """With decode_graphs, a step of decodes alone (each sampling, none scoring its prompt)
        of at most its largest size runs through them (decode_graphs.py). `pooling`: the model
        is a pooling model, whose steps give hidden states rather than logits. `peers`: this is
        rank 0 of a tensor-parallel group, whose other ranks run every step with it. `lora`: the
        model's projections wrapped for adapters (enable_lora); the registry of the adapters
        read is `adapters`."""
        self.model = model
        self.kv = kv
        self.attention = attention
        self.decode_graphs = decode_graphs
        self.peers = peers
        self.head = _hidden if pooling else model.compute_logits
        self.swapped: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.lora = lora
        self.adapters = None if lora is None else AdapterRegistry(lora.targets, lora.max_rank)

    def execute(
        self, inputs: StepInputs, decision: SchedulerOutput, embeds: ImageEmbeds | None = None
    ) -> StepOutput:
        """The step's logits (or a pooling model's hidden states): see StepOutput. `embeds`:
        the encoder rows of the image positions the step computes (engine/encoder_cache.py)."""
        step = ForwardStep.of(inputs, decision, self.adapters, embeds)
        if self.peers is None:
            return self.run(step)
        try:
            with self.peers.rank_threads():
                self.peers.send(step)
                return self.run(step)
        except RuntimeError as e:  # a collective whose peer is gone
            raise self.peers.failure(e) from e

    @torch.inference_mode()
    def run(self, step: ForwardStep) -> StepOutput:
        """One step on this rank (a tensor-parallel worker calls it with the driver's step)."""
        # Order matters: a block swapped out this step may be handed out again this step.
        for s in step.swap_out:
            self.swapped[s.seq_id] = self.kv.swap_out(s.blocks)
        for s in step.swap_in:
            self.kv.swap_in(s.blocks, self.swapped.pop(s.seq_id))
        for c in step.copies:
            self.kv.copy_block(c.src, c.dst)
        if self.lora is not None:
            for slot, adapter in step.lora_loads:
                self.lora.load(slot, adapter)
            self.lora.set_step(step.token_lora)
        graphs, meta = self.decode_graphs, step.meta
        if (
            graphs is not None
            and meta.is_decode_only
            and meta.num_seqs <= graphs.max_size
            and step.logits_indices.numel() == meta.num_seqs
            and step.prompt_rows is None
            and step.embeds is None
        ):
            return StepOutput(graphs.run(step.input_ids, step.positions, meta))
        # What every layer's attention does depends only on the step's metadata: planned once.
        attention = self.attention.plan(meta)
        hidden = self.model(step.input_ids, step.positions, meta, self.kv, attention, step.embeds)
        # index_select rather than advanced indexing: a plain row gather costs far less per step.
        # A step of decodes alone samples every row, in order: no gather at all.
        rows = step.logits_indices
        sampled = hidden if rows.numel() == hidden.shape[0] else hidden.index_select(0, rows)
        logits = self.head(sampled)
        prompt = None
        if step.prompt_rows is not None:
            prompt = self.head(hidden.index_select(0, step.prompt_rows))
        pooled = None if step.pool_rows is None else hidden.index_select(0, step.pool_rows)
        return StepOutput(logits, prompt, pooled)


def _hidden(rows: torch.Tensor) -> torch.Tensor:
    return rows


class BuiltRunner(NamedTuple):
    runner: ModelRunner
    bind_report: BindReport
    argmax: Callable[[torch.Tensor], torch.Tensor]  # the bound layer ops' greedy argmax
    race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # and their sampled draw
    linear_methods: dict[str, str]  # the implementation bound per linear shape
    linear_measurement: dict[str, Any]  # how those were chosen (ModelOps.linear_measurement)


def build_model_runner(
    model: CausalLM,
    cfg: EngineConfig,
    plan: EnginePlan,
    peers: Peers | None = None,
    comm: Collective | None = None,
) -> BuiltRunner:
    """This rank's KV pool (its share of the K/V heads, the plan's block ids), attention
    backend and ops, the model bound to them, and the runner: what the engine and every
    tensor-parallel worker set up alike. CUDA graphs of decode steps where the device is CUDA,
    enforce_eager is off and the model is on one device. `comm`: a worker's group; rank 0's is
    its peers'."""
    mc = model.config  # a tensor-parallel rank's share
    # CUDA graphs of decode steps pad them onto one block beyond the pool's (decode_graphs.py).
    # (Adapters change per step what a decode computes: such an engine runs eagerly.)
    graphs_on = (
        plan.device.type == "cuda"
        and not cfg.enforce_eager
        and model.shard.world == 1
        and not cfg.enable_lora
    )
    kv = KVCache.allocate(
        mc.num_layers,
        plan.num_blocks + int(graphs_on),
        cfg.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        plan.dtype,
        plan.device,
    )
    attention = make_attention_backend(cfg.attention_backend, plan.device, cfg.batch_invariant)
    if peers is not None:
        comm = peers.comm
    # The row counts a linear runs at: a decode step's few rows up to a full batch.
    rows = tuple(sorted({1, 8, 64, cfg.max_num_seqs}))
    dense_ints = cfg.quantized_weights == "auto" and dense_copy_fits(model, plan.dtype, plan.device)
    cpu_kernels = uses_cpu_kernels(attention)
    ops = select_model_ops(
        cfg.linear_backend,
        cpu_kernels,
        plan.dtype,
        plan.device,
        comm,
        rows,
        dense_ints,
        cfg.batch_invariant,
        uses_triton_kernels(attention),
        dequantize=cfg.quantized_weights is False,
    )
    if cfg.enable_lora:  # an adapter updates gate and up before the activation: unfused
        ops = replace(ops, linear=replace(ops.linear, silu_mul=None))
    # Every linear repacked (a quantized one dequantized, where its dense form was chosen), and
    # on a new setup each shape measured first: the longest step between the weights and the
    # first step.
    with heartbeat(log, "making the linears"):
        report = model.bind(ops)
    lora = None
    if cfg.enable_lora:
        lora = LoRAModel(model, cfg.max_loras, cfg.max_lora_rank, plan.dtype)
    if ops.measured is not None and ops.measured.choices:
        m = ops.measured
        how = f"measured {m.measured}" if m.measured else "all cached"
        shapes = ", ".join(f"{shape} {name}" for shape, name in m.choices.items())
        log.info(
            "linears by measurement (%s, %.1f s; %s): %s", how, m.seconds, m.cache.path, shapes
        )
        untrusted = [s for s, n in ops.linear_measurement().get("shapes", {}).items()
                     if n["how"] in ("provisional", "kept")]  # fmt: skip
        if untrusted:  # a busy or noisy machine: these choices are not cached as measured
            log.warning(
                "%d linear shapes could not be measured reliably (a busy machine?): what they "
                "measured is not cached, the next start measures them again (%s)",
                len(untrusted), ", ".join(untrusted),
            )  # fmt: skip
    graphs = None
    if graphs_on:
        sizes = ladder(cfg.max_num_seqs)
        graphs = DecodeGraphs(
            model, kv, attention, sizes, plan.max_model_len, plan.num_blocks, capture=True
        )
        log.info("capturing CUDA graphs of decode steps for %d batch sizes", len(sizes))
        start = time.perf_counter()
        graphs.capture_all()
        log.info("CUDA graphs captured in %.1f s", time.perf_counter() - start)
    pooling = plan.task != "generate"
    runner = ModelRunner(model, kv, attention, graphs, pooling=pooling, peers=peers, lora=lora)
    return BuiltRunner(
        runner,
        report,
        ops.layer.argmax,
        ops.layer.race,
        ops.linear_methods(),
        ops.linear_measurement(),
    )
