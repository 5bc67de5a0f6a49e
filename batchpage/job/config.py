"""The job's config schema: dataclasses registered in Hydra's ConfigStore.

The groups mirror the Python API, so a value means the same thing in both places: `engine.*` are
LLM(...) arguments (EngineConfig), `sampling.*` are SamplingParams fields, `dataset.*` is a
DatasetSpec and `model.path` is what LLM(model=...) takes. Because every node is typed, a mistyped
key or a wrong type fails while Hydra composes, before anything loads. YAML files under conf/
carry values only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from batchpage.data.spec import DatasetSpec
from batchpage.engine.config import EngineConfig
from batchpage.executor.config import ExecutorConfig
from batchpage.job.plan_options import PlanConfig
from batchpage.json_depth import schema_depth_error
from batchpage.pooling_params import PoolingParams
from batchpage.sampling_params import SamplingParams, StructuredOutputsParams
from batchpage.storage.config import StorageConfig, redacted

# SamplingParams fields that the job does not expose: logprobs are not written to the output,
# logit_bias has int keys and early_stopping is a bool-or-str union, which OmegaConf cannot type.
SAMPLING_FIELDS_NOT_IN_JOB = frozenset(
    {"logprobs", "prompt_logprobs", "logit_bias", "early_stopping"}
)


@dataclass
class ModelSpec:
    """A bundled name (smollm2), a Hugging Face model folder or a .gguf file; `loras`: LoRA
    adapters by name (name -> PEFT adapter folder), which dataset.lora_column's values name."""

    path: str = "smollm2"
    loras: dict[str, str] = field(default_factory=dict)


@dataclass
class StructuredOutputsConfig:
    """StructuredOutputsParams for every row (a row's response_format column overrides it): set
    one field, or none for unconstrained output. json is the schema as JSON text, since OmegaConf
    cannot type a dict-or-text field: sampling.structured_outputs.json='{"type": "object", ...}'.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


@dataclass
class SamplingConfig:
    """SamplingParams' simple fields, same names and defaults (tests check that they match).

    seed is the job's base seed: row i samples with a seed derived from (seed, i), so a row's
    completion does not depend on windows, batch order or resume. None: use engine.seed.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    thinking_token_budget: int | None = None
    # Not None by default: Hydra cannot set `sampling.structured_outputs.json=...` on a None node.
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def to_params(self) -> SamplingParams:
        """The validated SamplingParams (raises ValueError naming a bad field)."""
        fields = dataclasses.asdict(self)
        constraint = fields.pop("structured_outputs")
        chosen = {k: v for k, v in constraint.items() if v not in (None, False)}
        if chosen.get("json") is not None:  # before json.loads, which recurses
            too_deep = schema_depth_error(chosen["json"], "sampling.structured_outputs.json")
            if too_deep:
                raise ValueError(too_deep)
        structured = StructuredOutputsParams(**chosen) if chosen else None
        return SamplingParams(**fields, structured_outputs=structured)


@dataclass
class PoolingConfig:
    """PoolingParams for every row of a pooling job (engine.task embed, classify, reward or
    score), same names and defaults: dimensions (Matryoshka truncation, where the model has it),
    normalize, use_activation."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def to_params(self) -> PoolingParams:
        """The validated PoolingParams (raises ValueError naming a bad field)."""
        return PoolingParams(**dataclasses.asdict(self))


@dataclass
class JobConfig:
    """One batch job: `python -m batchpage.run` composes this from conf/ and the command line."""

    model: ModelSpec = field(default_factory=ModelSpec)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    # Options of object stores (s3://, gs://, az:// paths in dataset.path and output_dir).
    storage: StorageConfig = field(default_factory=StorageConfig)
    # None: Hydra's run folder (outputs/<date>/<time>); give a fixed folder to be able to resume.
    output_dir: str | None = None
    # Refuse nothing: delete results of another job found in output_dir and start over.
    overwrite: bool = False
    # Report rows, tokens, shared prefixes and KV blocks without loading weights or generating.
    dry_run: bool = False
    # What the dry run estimates besides (devices to time the job on, output lengths): plan.*.
    plan: PlanConfig = field(default_factory=PlanConfig)
    # Shards are written every flush_rows finished rows or flush_seconds, whichever comes first.
    flush_rows: int = 256
    flush_seconds: float = 30.0
    progress: bool = True
    # "humaneval": after generating, run each completion's tests in the sandbox and report
    # pass@1 (scores.parquet, run.json). Opt-in: it executes model-written code.
    score: str | None = None

    def __post_init__(self) -> None:
        """Ranges of the job's own numbers (each group checks its own), so that a bad value is
        one line while composing, before anything loads."""
        if self.flush_rows < 1:
            raise ValueError(
                f"flush_rows={self.flush_rows} must be >= 1 (finished rows a shard holds)"
            )
        if not math.isfinite(self.flush_seconds) or self.flush_seconds <= 0:
            raise ValueError(f"flush_seconds={self.flush_seconds} must be a number of seconds > 0")


def to_job(cfg: DictConfig) -> JobConfig:
    """The JobConfig of a composed config. Raises ValueError for a key that no field of its
    group has: Hydra's `+key=value` opens the group to add it, and OmegaConf would then set it
    on the dataclass as a stray attribute that nothing reads (a typo run silently). A group
    that is a mapping (model.loras) takes any key. Also ValueError for a bad value (each
    group checks its own when built)."""
    stray = _stray_keys(cfg, "")
    if stray:
        key, group = stray[0]
        name = key.rpartition(".")[2]
        raise ValueError(
            f"{key}: Key {name!r} not in {group!r}; `+` adds keys to a mapping, not to a "
            "group of fixed fields"
        )
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _stray_keys(node: DictConfig, prefix: str) -> list[tuple[str, str]]:
    """(full key, its group's class name) of every key of a typed group that its dataclass
    has no field for, in the config's order."""
    kind = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    found = []
    for key in node:
        full = f"{prefix}{key}"
        if fields is not None and key not in fields:
            found.append((full, kind.__name__))  # type: ignore[union-attr]
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found += _stray_keys(child, f"{full}.")
    return found


def register_configs() -> None:
    """Register the schema as `job_schema` (conf/config.yaml lists it first in its defaults).

    Called from main() rather than at import, so that importing this module has no side effect
    on Hydra's global ConfigStore.
    """
    from hydra.core.config_store import ConfigStore

    schema = OmegaConf.structured(JobConfig)
    # model.loras' keys are names the user picks: Hydra merges `model.loras={a: /p/a}` into the
    # node, which struct mode (set on the whole config) would refuse key by key. Values stay
    # typed.
    OmegaConf.set_struct(schema.model.loras, False)
    ConfigStore.instance().store(name="job_schema", node=schema)


def to_plain(cfg: JobConfig) -> dict[str, Any]:
    """The config as plain JSON-able data (for run.json and the job fingerprint), secrets in
    the storage options hidden."""
    plain = dataclasses.asdict(cfg)
    plain["storage"] = redacted(plain["storage"])
    return plain
