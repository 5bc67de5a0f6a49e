"""plan_job: everything that can be wrong with a job, found before the model loads.

The dataset is validated (schemas and first records only), the sampling values and the engine
plan are checked (the same `plan_engine` that LLM(...) calls), and the job's fingerprint is
built: what its results depend on, so that a rerun into the same output_dir resumes only the
same job.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchpage.data.dataset_path import input_root
from batchpage.data.image_sources import image_limits
from batchpage.data.images import ImageLimits
from batchpage.data.spec import DatasetInfo, validate
from batchpage.engine.config import EngineConfig
from batchpage.engine.grammar_cache import check_constraint
from batchpage.engine.plan import EnginePlan, plan_engine
from batchpage.engine.reasoning import resolve_markers
from batchpage.executor.config import replica_bundles
from batchpage.fileio import file_digest
from batchpage.job.adapters import JobAdapters
from batchpage.job.config import JobConfig
from batchpage.job.humaneval_scores import check_scorable, code_schema
from batchpage.job.pooled_columns import POOLING_JOB_TASKS, pool_schema
from batchpage.job.prompts import PromptPlan, check_template
from batchpage.model.config import ModelConfig
from batchpage.model.loader import ModelSource, load_tokenizer, resolve_model_source
from batchpage.model.tokenizer import check_chat_template_kwargs, resolve_chat_template
from batchpage.output.batch_files import batch_schema
from batchpage.output.files import output_schema
from batchpage.pooling_params import PoolingParams
from batchpage.sampling_params import SamplingParams
from batchpage.storage import Stores, is_url

# Bump when the way prompts are built changes: old output_dirs then refuse to resume into a mix.
PROMPT_FORMAT = 2
# Weight files are replaced whole, not edited: their ends and size tell checkpoints apart
# without reading gigabytes at every start.
_WEIGHT_SAMPLE_BYTES = 1 << 16


class JobConfigError(ValueError):
    """The job cannot start (bad path, column, model, pool size, output_dir). The message says
    how to fix it; nothing was generated."""


class JobStoppedError(JobConfigError):
    """The job stopped part-way on a problem outside it (the disk is full, an input file
    changed): the rows saved so far are kept, and the message says how to go on. A
    JobConfigError, so the command line prints it as one line and exits 2."""


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
    # completion and finish_reason are lists (one per sample) in every row: the job's n > 1, an
    # `n` column, or an OpenAI Batch file (whose bodies may set n); in an embedding job, the
    # embedding column (one per input of an OpenAI Batch line).
    listed: bool = False
    # The output's columns after batchpage's own: derived (code; url and logprobs of an OpenAI
    # Batch file), then the carried input columns.
    extra_schema: pa.Schema | None = None
    # The engine's reasoning parser, resolved against the model's tokenizer; None: off (no
    # `reasoning` column, the completion holds any thinking).
    reasoning: str | None = None
    # A pooling job's (engine.task other than generate) PoolingParams, from pooling.*.
    pooling: PoolingParams = PoolingParams()
    # The LoRA adapters rows name (dataset.lora_column); None: the job runs the base model.
    adapters: JobAdapters | None = None
    # Where the job's files live (local disks, object storage): its inputs and output_dir.
    stores: Stores = field(default_factory=Stores)

    @property
    def openai_batch(self) -> bool:
        return self.info.format == "openai_batch"


def plan_job(cfg: JobConfig) -> JobPlan:
    """Validate dataset, sampling, model and KV pool; raise JobConfigError with the fix."""
    stores = Stores(cfg.storage)
    try:
        if cfg.output_dir and not cfg.dry_run:  # a dry run writes nothing there
            _check_apart(str(cfg.output_dir), cfg.dataset.path, stores)
        info = validate(cfg.dataset, stores)
        params = cfg.sampling.to_params()
        pooling = cfg.pooling.to_params()
        source = resolve_model_source(cfg.model.path)
        engine_cfg = EngineConfig(**asdict(cfg.engine))  # validated again: cfg may be hand-built
        engine = plan_engine(engine_cfg, source)
        if cfg.executor.kind == "ray":
            replica_bundles(cfg.executor, engine_cfg.tensor_parallel_size)
        if cfg.score is not None:
            check_scorable(cfg.score, info, cfg.dataset, stores.store_for(info.files[0]))
        style, prompts = _prompt_plan(cfg, info, source)
        prompts = replace(prompts, image_limits=_image_limits(cfg, info, source, engine.task))
        if style == "completion" and info.styles is not None:
            stops = [*(params.stop or []), *info.styles.completion_stop]
            params = params.replace(stop=list(dict.fromkeys(stops)))
        listed = params.n > 1 or "n" in info.override_columns or info.format == "openai_batch"
        reasoning = _reasoning(engine_cfg, source)
        if engine.task != "generate":
            _check_pooling_job(engine.task, cfg, info, pooling, source.config)
            if params.structured_outputs is not None:
                raise ValueError(
                    f"sampling.structured_outputs constrains generated text; engine.task="
                    f"{engine.task} generates none: drop sampling.structured_outputs"
                )
            # An OpenAI Batch embeddings line may have several inputs: a list of embeddings.
            listed, reasoning = info.format == "openai_batch", None
        elif pooling != PoolingParams():
            raise ValueError(
                "pooling.* is for pooling jobs (engine.task=embed, classify, reward or score); "
                "this job generates: drop the pooling.* settings"
            )
        else:
            _check_sampling(params, engine_cfg.reasoning_parser, reasoning, source.config)
        extra = _extra_schema(cfg, info, style, listed, reasoning is not None, engine.task,
                              pooling, source.config)  # fmt: skip
        adapters = _adapters(cfg, engine_cfg, engine.task)
    except (ValueError, OSError) as e:
        raise JobConfigError(str(e)) from None
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else engine_cfg.seed
    # What the results depend on; engine knobs such as block_size only change the speed, and
    # engine.seed matters only to random sampling without a sampling.seed.
    engine_seed = engine_cfg.seed if cfg.sampling.seed is None and not params.is_greedy else None
    sampling = asdict(cfg.sampling)
    if sampling["thinking_token_budget"] is None:  # jobs without one keep their identity
        del sampling["thinking_token_budget"]
    fingerprint = {
        # The files, not the path: the same model named another way resumes, while a
        # checkpoint replaced at the same path is another job.
        "model": model_identity(source),
        "sampling": sampling,
        "engine_seed": engine_seed,
        "dataset": info.fingerprint,
        "max_model_len": engine.max_model_len,
        "prompt_format": PROMPT_FORMAT,
        "style": style,
        "instruct": prompts.instruct,
    }
    if prompts.template is not None:  # only then: jobs without an override keep their identity
        fingerprint["chat_template"] = hashlib.sha256(prompts.template.encode()).hexdigest()[:16]
    if reasoning is not None:  # the completion is then the answer only
        fingerprint["reasoning_parser"] = reasoning
    if engine.task != "generate":  # generation jobs keep their identity
        fingerprint["task"] = engine.task
        fingerprint["pooling_type"] = engine_cfg.pooling_type
        if engine_cfg.classifier_from_token is not None:  # the head is made of these tokens
            fingerprint["classifier_from_token"] = list(engine_cfg.classifier_from_token)
        chosen = {k: v for k, v in asdict(pooling).items() if v is not None}
        if chosen:  # only then: jobs with the defaults keep their identity
            fingerprint["pooling"] = chosen
        del fingerprint["sampling"]  # nothing is sampled
    if adapters is not None and cfg.model.loras:  # only then: other jobs keep their identity
        fingerprint["loras"] = adapters.fingerprint()
    return JobPlan(
        info,
        source,
        engine,
        params,
        base_seed,
        prompts,
        style,
        fingerprint,
        listed,
        extra,
        reasoning,
        pooling,
        adapters,
        stores,
    )


def _adapters(cfg: JobConfig, engine_cfg: EngineConfig, task: str) -> JobAdapters | None:
    """The adapters of a job with dataset.lora_column (model.loras' checked), or None."""
    if cfg.dataset.lora_column is None:
        if cfg.model.loras:
            raise ValueError(
                "model.loras names adapters, but no dataset.lora_column says which rows run "
                "them: set dataset.lora_column"
            )
        return None
    if not engine_cfg.enable_lora:
        raise ValueError(
            "dataset.lora_column runs rows on LoRA adapters: set engine.enable_lora=true (and "
            "engine.max_loras, engine.max_lora_rank as the adapters need)"
        )
    if task != "generate":
        raise ValueError(
            f"dataset.lora_column in a pooling job (engine.task={task}) is not supported yet: "
            "use LLM.embed / classify with lora_request, or drop dataset.lora_column"
        )
    return JobAdapters(dict(cfg.model.loras), engine_cfg.max_lora_rank)


def _image_limits(
    cfg: JobConfig, info: DatasetInfo, source: ModelSource, task: str
) -> ImageLimits | None:
    """How the rows' images are read; None where the job takes none (a text model, a pooling
    job, Ray replicas): then an image column is the job's error, a chat's image parts their
    row's."""
    if source.config.vision is None:
        why = (
            f"model {cfg.model.path} takes no images: use a vision-language model (LLaVA, "
            "Idefics3 / SmolVLM, Gemma 3)"
        )
    elif task != "generate":
        why = f"engine.task={task} takes no images yet: images go to generation jobs"
    elif cfg.executor.kind != "local":
        why = f"executor={cfg.executor.kind} takes no images yet: run it with executor=local"
    else:
        return image_limits(cfg.dataset)
    if info.image_column is not None:
        raise ValueError(f"dataset.image_column={info.image_column} gives rows images, and {why}")
    return None


def _check_sampling(
    params: SamplingParams, parser: str | None, reasoning: str | None, model: ModelConfig
) -> None:
    """What in the job's own sampling settings would fail every row once the model is loaded:
    token ids outside the vocabulary, a constraint xgrammar cannot parse, a thinking budget
    without thinking markers (`parser`: engine.reasoning_parser; `reasoning`: what it found)."""
    try:
        params.verify_vocab(model.vocab_size)
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from None
    if params.thinking_token_budget is not None and reasoning is None:
        why = (
            "engine.reasoning_parser is not set"
            if parser in (None, "none")
            else f"engine.reasoning_parser={parser} found no thinking markers in this model's "
            "vocabulary"
        )
        raise ValueError(
            "sampling.thinking_token_budget needs a reasoning model's thinking markers, and "
            f"{why}: set engine.reasoning_parser (auto, qwen3, deepseek_r1, mistral) for a "
            "reasoning model, or drop sampling.thinking_token_budget"
        )


def _reasoning(engine_cfg: EngineConfig, source: ModelSource) -> str | None:
    """The reasoning parser's name for this model's tokenizer (ValueError for a named parser
    whose markers it lacks), or None."""
    if engine_cfg.reasoning_parser in (None, "none"):
        return None
    markers = resolve_markers(engine_cfg.reasoning_parser, load_tokenizer(source).single_token_id)
    return None if markers is None else markers.name


def _prompt_plan(
    cfg: JobConfig, info: DatasetInfo, source: ModelSource
) -> tuple[str | None, PromptPlan]:
    """Settle dataset.style (auto: instruct when the model has a chat template, which costs
    reading its tokenizer, not its weights) and check that chats have a template to go into."""
    chats = info.messages_column is not None or info.format == "openai_batch"
    if chats and info.chat_template == "false":
        what = "an OpenAI Batch file" if info.messages_column is None else "a messages column"
        raise ValueError(
            f"{what} needs the chat template, and dataset.chat_template=false: "
            "set dataset.chat_template=auto"
        )
    template = resolve_chat_template(cfg.engine.chat_template)
    kwargs = dict(cfg.dataset.chat_template_kwargs or {})
    check_chat_template_kwargs(kwargs)
    bound = cfg.dataset.max_prompt_bytes
    style = None
    instruct = None
    if info.styles is not None:
        style = cfg.dataset.style
        if style == "auto":
            has_template = template is not None or load_tokenizer(source).has_chat_template
            style = "instruct" if has_template else "completion"
        instruct = info.styles.instruct if style == "instruct" else None
    plan = PromptPlan(info.chat_template, instruct, template, kwargs, bound)
    if chats or instruct is not None or info.chat_template == "true" or cfg.dataset.system_prompt:
        system = cfg.dataset.system_prompt
        check_template(load_tokenizer(source), plan, system, chats)  # one that fails every row
    return style, plan


def _check_pooling_job(
    task: str, cfg: JobConfig, info: DatasetInfo, pooling: PoolingParams, model: ModelConfig
) -> None:
    """What a pooling job cannot do, refused before the model loads."""
    assert task in POOLING_JOB_TASKS, task  # EngineConfig checks the name
    bad_dims = pooling.check_dimensions(model.head, model.hidden_size)
    if bad_dims is not None:
        raise ValueError(f"pooling.{bad_dims}")
    if task == "score":
        _check_score_job(cfg, info)
    if (info.format == "openai_batch" and task != "embed") or cfg.score is not None:
        raise ValueError(
            f"engine.task={task} takes a prompt or messages dataset, without score= (an OpenAI "
            "Batch file is for generation or /v1/embeddings, HumanEval scoring for generation)"
        )


def _check_score_job(cfg: JobConfig, info: DatasetInfo) -> None:
    """A score job pairs two texts of each row, as they are (the tokenizer's pair encoding, or
    two embeddings): a prompt column and dataset.response_column, no chat."""
    if info.response_column is None:
        raise ValueError(
            "engine.task=score scores each row's prompt (data_1) against a second text (data_2): "
            "name that column with dataset.response_column=<column>"
        )
    chat = info.messages_column is not None or info.chat_template == "true"
    if chat or cfg.dataset.system_prompt:
        raise ValueError(
            "engine.task=score pairs two plain texts: use dataset.prompt_column (not "
            "messages_column), without dataset.system_prompt or dataset.chat_template=true"
        )


def _extra_schema(
    cfg: JobConfig,
    info: DatasetInfo,
    style: str | None,
    listed: bool,
    reasoning: bool,
    task: str,
    pooling: PoolingParams,
    model: ModelConfig,
) -> pa.Schema | None:
    """Derived columns, then the carried ones; a carried column named like one of batchpage's
    is refused here, before the model loads."""
    text = pa.list_(pa.string()) if listed else pa.string()
    derived = pa.schema([("reasoning", text)] if reasoning else [])
    if task != "generate":
        derived = pool_schema(task, model, pooling, listed)
    if style is not None:
        derived = pa.schema([*derived, *code_schema(2 if listed else 1)])  # lists for n > 1
    if info.format == "openai_batch":
        derived = pa.schema([*derived, *batch_schema()])
    taken = {*output_schema().names, *derived.names}
    clash = [c for c in info.carried if c in taken]
    if clash:
        hint = ""
        if "id" in clash and info.id_column is None:
            hint = " To use it as each row's id, set dataset.id_column=id."
        which = "every input column" if cfg.dataset.keep_columns is None else "dataset.keep_columns"
        raise ValueError(
            f"input column(s) {', '.join(clash)} would be carried into completions.parquet "
            f"({which}), which has its own column(s) of that name: rename them in the data, or "
            f"choose the columns to carry with dataset.keep_columns=[...] ([] for none).{hint}"
        )
    schema = pa.schema([*derived, *info.carried_schema])
    return schema if len(schema) else None


def model_identity(source: ModelSource) -> list[Any]:
    """Name, size and a hash of the ends of each weight file."""
    path = source.path
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return [file_digest(f, sample_bytes=_WEIGHT_SAMPLE_BYTES) for f in files]


def _check_apart(output_dir: str, dataset_path: str, stores: Stores) -> None:
    """The job's folder and what it reads must not overlap: an output_dir that is, holds or lies
    in the input folder (or prefix) would read the job's own files as input (and see its input
    change as it writes), and one that holds the input file may write over it. Local paths are
    compared resolved, URLs as written (s3a:// as s3://, gcs:// as gs://)."""
    root = input_root(dataset_path, stores)
    if root is None:
        return
    where, is_folder = root
    if is_url(output_dir) != is_url(where):
        return  # one on local disk, the other in object storage
    local = not is_url(output_dir)
    out = str(Path(output_dir).expanduser().resolve()) if local else _canonical(output_dir)
    where = where if local else _canonical(where)
    if is_folder:
        overlap = _within(out, where) or _within(where, out)
    else:
        overlap = where != out and _within(where, out)
    if overlap:
        what = "folder" if is_folder else "file"
        raise ValueError(
            f"output_dir={output_dir} overlaps the input {what} of dataset.path={dataset_path} "
            f"({where}): the job would read its own files or write over its input; give an "
            "output_dir outside the input (e.g. a sibling folder)"
        )


def _within(inner: str, outer: str) -> bool:
    """Whether `inner` is `outer` or lies below it (both absolute paths, or both URLs)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _canonical(url: str) -> str:
    """A URL spelled one way: its scheme's usual name, lower case, no trailing slash."""
    scheme, _, rest = url.partition("://")
    scheme = {"s3a": "s3", "gcs": "gs"}.get(scheme.lower(), scheme.lower())
    return f"{scheme}://{rest.rstrip('/')}"
