"""plan_job: everything that can be wrong with a job, found before the model loads.

The dataset is validated (schemas and first records only), the sampling values and the engine
plan are checked (the same `plan_engine` that LLM(...) calls), and the job's fingerprint is
built: what its results depend on, so that a rerun into the same output_dir resumes only the
same job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchpage.data.spec import DatasetInfo, validate
from batchpage.engine.config import EngineConfig
from batchpage.engine.plan import EnginePlan, plan_engine
from batchpage.fileio import file_digest
from batchpage.job.config import JobConfig
from batchpage.job.prompts import PromptPlan
from batchpage.job.score import SCORERS
from batchpage.model.loader import ModelSource, load_tokenizer, resolve_model_source
from batchpage.sampling_params import SamplingParams

# Bump when the way prompts are built changes: old output_dirs then refuse to resume into a mix.
PROMPT_FORMAT = 2
# Weight files are replaced whole, not edited: their ends and size tell checkpoints apart
# without reading gigabytes at every start.
_WEIGHT_SAMPLE_BYTES = 1 << 16


class JobConfigError(ValueError):
    """The job cannot start (bad path, column, model, pool size, output_dir). The message says
    how to fix it; nothing was generated."""


@dataclass(frozen=True)
class JobPlan:
    info: DatasetInfo
    source: ModelSource
    engine: EnginePlan
    params: SamplingParams  # the job's; rows may override some fields
    base_seed: int
    prompts: PromptPlan
    style: str | None  # instruct | completion for a code-completion prompt set, else None
    fingerprint: dict[str, Any]


def plan_job(cfg: JobConfig) -> JobPlan:
    """Validate dataset, sampling, model and KV pool; raise JobConfigError with the fix."""
    try:
        info = validate(cfg.dataset)
        params = cfg.sampling.to_params()
        source = resolve_model_source(cfg.model.path)
        engine_cfg = EngineConfig(**asdict(cfg.engine))  # validated again: cfg may be hand-built
        engine = plan_engine(engine_cfg, source)
        if cfg.score is not None and cfg.score not in SCORERS:
            raise ValueError(f"score={cfg.score!r} is unknown; use one of {', '.join(SCORERS)}")
        style, prompts = _prompt_plan(cfg, info, source)
        if style == "completion" and info.styles is not None:
            stops = [*(params.stop or []), *info.styles.completion_stop]
            params = params.replace(stop=list(dict.fromkeys(stops)))
    except (ValueError, OSError) as e:
        raise JobConfigError(str(e)) from None
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else engine_cfg.seed
    # What the results depend on; engine knobs such as block_size only change the speed, and
    # engine.seed matters only to random sampling without a sampling.seed.
    engine_seed = engine_cfg.seed if cfg.sampling.seed is None and not params.is_greedy else None
    fingerprint = {
        # The files, not the path: the same model named another way resumes, while a
        # checkpoint replaced at the same path is another job.
        "model": model_identity(source),
        "sampling": asdict(cfg.sampling),
        "engine_seed": engine_seed,
        "dataset": info.fingerprint,
        "max_model_len": engine.max_model_len,
        "prompt_format": PROMPT_FORMAT,
        "style": style,
        "instruct": prompts.instruct,
    }
    return JobPlan(info, source, engine, params, base_seed, prompts, style, fingerprint)


def _prompt_plan(
    cfg: JobConfig, info: DatasetInfo, source: ModelSource
) -> tuple[str | None, PromptPlan]:
    """Settle dataset.style (auto: instruct when the model has a chat template, which costs
    reading its tokenizer, not its weights) and check that chats have a template to go into."""
    if info.messages_column is not None and info.chat_template == "false":
        raise ValueError(
            "a messages column needs the chat template, and dataset.chat_template=false: "
            "set dataset.chat_template=auto"
        )
    if info.styles is None:
        return None, PromptPlan(info.chat_template)
    style = cfg.dataset.style
    if style == "auto":
        style = "instruct" if load_tokenizer(source).has_chat_template else "completion"
    instruct = info.styles.instruct if style == "instruct" else None
    return style, PromptPlan(info.chat_template, instruct)


def model_identity(source: ModelSource) -> list[Any]:
    """Name, size and a hash of the ends of each weight file."""
    path = source.path
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return [file_digest(f, sample_bytes=_WEIGHT_SAMPLE_BYTES) for f in files]
