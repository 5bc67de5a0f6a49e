"""batchpage.lm_eval against lm-eval's own hf backend on the same tiny random weights: local tasks
(a JSON dataset and a task YAML each) for multiple choice, generate_until and
loglikelihood_rolling give the same per-sample scores, generations and metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.extras import require

require("lm_eval", "lm-eval")  # before lm_eval's imports: a missing extra skips or fails
# isort: split
import lm_eval  # noqa: E402
import lm_eval.evaluator  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.utils import postprocess_generated_text  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from batchpage import LLM, SamplingParams  # noqa: E402
from batchpage.lm_eval import BatchpageLM  # noqa: E402
from tests.model_factory import build_hf_model, save_hf_folder, thinking_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Short, so that few-shot contexts get truncated and each perplexity text spans several windows.
MAX_MODEL_LEN = 96
MAX_LENGTH = MAX_MODEL_LEN - 2  # the backend's lm-eval max_length; hf is given the same
ENGINE_ARGS = f"dtype=float32,max_model_len={MAX_MODEL_LEN},kv_cache_memory={2**22}"
TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]
SYSTEM = "Answer with a number."
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A radix tree shares prefixes between requests.",
    "Hello world! How are you today? 0123456789",
]


def write_tasks(folder: Path) -> Path:
    """Three tasks over arithmetic questions and a few paragraphs, as JSON lines + YAML."""
    rows = [
        {"question": f"{a} + {b}", "choices": [str(a + b), str(a + b + 1), str(a * b + 7)]}
        | {"label": 0, "answer": str(a + b)}
        for a in range(1, 7)
        for b in range(2, 5)
    ]
    texts = [{"text": " ".join(_SENTENCES[i:] + _SENTENCES[:i]) * 2} for i in range(3)]
    files = {"train": rows[:4], "test": rows[4:10], "texts": texts}
    for name, records in files.items():
        (folder / f"{name}.json").write_text("\n".join(json.dumps(r) for r in records))

    def data(*splits: str) -> str:
        lines = "".join(f"    {s}: {folder / s}.json\n" for s in splits)
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n{lines}"

    few_shot = f"{data('train', 'test')}training_split: train\nfewshot_split: train\n"
    few_shot += "test_split: test\nnum_fewshot: 2\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{few_shot}output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{few_shot}output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{data('texts')}test_split: texts\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    return folder


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def evaluate(model: str, model_args: str, task_dir: Path, tasks: list[str], **kw: Any) -> dict:
    # Only the local tasks: indexing lm-eval's thousands of bundled ones takes ~45 s here.
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    with pytest.MonkeyPatch.context() as patch:
        # Its environment record runs `pip list` and torch's collect_env (~5 s a call); these
        # tests compare scores, not that record.
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            task_manager=manager,
            device="cpu",
            batch_size=1,
            log_samples=True,
            **kw,
        )


@pytest.fixture(scope="module")
def plain_runs(tiny_folder: Path, task_dir: Path) -> tuple[dict, dict]:
    hf_args = f"pretrained={tiny_folder},dtype=float32,max_length={MAX_LENGTH}"
    ours = evaluate("batchpage", f"pretrained={tiny_folder},{ENGINE_ARGS}", task_dir, TASKS)
    return evaluate("hf", hf_args, task_dir, TASKS), ours


@pytest.fixture(scope="module")
def chat_runs(tiny_folder: Path, task_dir: Path) -> tuple[dict, dict]:
    chat = dict(apply_chat_template=True, system_instruction=SYSTEM)
    tasks = ["tiny_mc", "tiny_gen"]
    hf_args = f"pretrained={tiny_folder},dtype=float32,max_length={MAX_LENGTH}"
    ours = f"pretrained={tiny_folder},{ENGINE_ARGS}"
    return (
        evaluate("hf", hf_args, task_dir, tasks, **chat),
        evaluate("batchpage", ours, task_dir, tasks, **chat),
    )


def assert_close(ref: Any, ours: Any, where: str) -> None:
    """Floats within 1e-3 relative; everything else (greedy flags, text) exactly."""
    if isinstance(ref, list | tuple):
        assert len(ref) == len(ours), where
        for i, (r, o) in enumerate(zip(ref, ours, strict=True)):
            assert_close(r, o, f"{where}[{i}]")
    elif isinstance(ref, float) and not isinstance(ref, bool):
        assert ours == pytest.approx(ref, rel=1e-3), where
    else:
        assert ours == ref, where


def assert_same_task(ref: dict, ours: dict, task: str) -> list[dict]:
    """Per sample: the same requests and the same responses; then the same metrics."""
    ref_samples = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
    our_samples = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
    assert ref_samples and len(ref_samples) == len(our_samples)
    for r, o in zip(ref_samples, our_samples, strict=True):
        assert o["arguments"] == r["arguments"]
        assert_close(r["resps"], o["resps"], f"{task} doc {r['doc_id']}")
    metrics = {k: v for k, v in ref["results"][task].items() if "," in k}
    assert metrics
    for name, value in metrics.items():
        assert_close(value, ours["results"][task][name], f"{task} {name}")
    return our_samples


def test_multiple_choice_scores_match_hf(plain_runs) -> None:
    samples = assert_same_task(*plain_runs, "tiny_mc")
    contexts = [s["arguments"][0][0] for s in samples]
    assert all(c.startswith("Question:") and c.count("Answer:") == 3 for c in contexts)


def test_greedy_generations_match_hf(plain_runs) -> None:
    samples = assert_same_task(*plain_runs, "tiny_gen")
    assert any(s["resps"][0][0] for s in samples), "every generation empty: nothing compared"


def test_rolling_loglikelihood_matches_hf_across_windows(plain_runs, tokenizer) -> None:
    samples = assert_same_task(*plain_runs, "tiny_ppl")
    assert all(len(tokenizer.encode(s["doc"]["text"])) > 2 * MAX_LENGTH for s in samples)


def test_chat_template_and_system_instruction_match_hf(chat_runs) -> None:
    for task in ("tiny_mc", "tiny_gen"):
        samples = assert_same_task(*chat_runs, task)
        prompt = samples[0]["arguments"][0][0]
        assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")


@pytest.fixture(scope="module")
def ours_lm(tiny_folder: Path) -> BatchpageLM:
    return BatchpageLM(
        pretrained=str(tiny_folder),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=2**22,
    )


def test_scores_greedy_flags_and_truncation_match_hf_token_for_token(
    ours_lm: BatchpageLM, tiny_folder: Path
) -> None:
    hf = HFLM(pretrained=str(tiny_folder), dtype="float32", device="cpu", max_length=MAX_LENGTH)
    context = ours_lm.tok_encode("Paged attention stores keys")
    greedy = (
        ours_lm.llm.generate(
            context, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    other = (greedy[2] + 1) % len(ours_lm.tokenizer)
    long_context = ours_lm.tok_encode(" ".join(_SENTENCES) * 3)
    assert len(long_context) > MAX_LENGTH + 1  # left-truncated as hf does
    requests = [
        (("a", "b"), context, list(greedy)),
        (("a", "c"), context, [*greedy[:2], other]),
        (("d", "e"), long_context, greedy[:2]),
        (("f", "g"), [ours_lm.prefix_token_id], context),
    ]
    ref = hf._loglikelihood_tokens(requests, disable_tqdm=True)
    ours = ours_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert_close(ref, ours, "loglikelihood")
    assert ours[0][1] and not ours[1][1]


def test_generation_kwargs_become_sampling_params(ours_lm: BatchpageLM) -> None:
    eos = ours_lm.tokenizer.eos_token
    greedy, until = ours_lm._sampling_params({"until": ["\n"], "max_gen_toks": 5}, eos)
    assert until == ["\n", eos]
    assert (greedy.temperature, greedy.max_tokens, greedy.stop) == (0.0, 5, ["\n", eos])
    sampled, _ = ours_lm._sampling_params(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 6}, eos
    )
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 5)
    assert sampled.max_tokens == 6  # lm-eval's aliases of max_gen_toks count too
    # do_sample=True without a temperature samples at transformers' default of 1.
    assert (
        ours_lm._sampling_params({"do_sample": True, "max_gen_toks": 4}, eos)[0].temperature == 1.0
    )
    with pytest.raises(ValueError, match=r"generation kwargs \['num_beams'\]"):
        ours_lm._sampling_params({"num_beams": 4, "max_gen_toks": 4}, eos)
    with pytest.raises(ValueError, match="max_gen_toks=94 leaves no room"):
        ours_lm._sampling_params({"max_gen_toks": MAX_LENGTH}, eos)


def test_sampled_generation_follows_the_seed(ours_lm: BatchpageLM) -> None:
    kwargs = {"do_sample": True, "temperature": 1.5, "max_gen_toks": 8, "until": ["zzz"]}
    requests = [
        Instance("generate_until", {}, ("Hello world", kwargs | {"seed": s}), idx=0)
        for s in (1, 1, 2, 3, 4)
    ]
    texts = ours_lm.generate_until(requests, disable_tqdm=True)
    assert texts[0] == texts[1]
    assert len(set(texts[1:])) > 1


@pytest.fixture(scope="module")
def r1_folder(tmp_path_factory) -> Path:
    """A tiny random Llama with DeepSeek-R1's markers and template."""
    tok = thinking_tokenizer("deepseek_r1")
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tok))
    return save_hf_folder(hf, tmp_path_factory.mktemp("r1"), tok)


def test_with_a_reasoning_parser_until_cuts_the_answer_not_the_thinking(r1_folder: Path) -> None:
    engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory": 2**22}
    llm = LLM(str(r1_folder), reasoning_parser="deepseek_r1", **engine)
    params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=6)
    whole = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0]
    stop = whole.reasoning[1:3]  # text inside the thinking: as an engine stop it would cut it
    assert stop and stop not in whole.text
    lm = BatchpageLM(pretrained=str(r1_folder), reasoning_parser="deepseek_r1", **engine)
    kwargs = {"until": [stop], "max_gen_toks": 20, "thinking_token_budget": 6}
    texts = lm.generate_until([Instance("generate_until", {}, ("Hello world", kwargs), idx=0)])
    assert texts == [whole.text]


def test_think_end_token_scores_the_text_after_it_with_until_applied_there(
    r1_folder: Path,
) -> None:
    """Without a parser the markers are in the text (added, not special, tokens): lm-eval's
    think_end_token takes what follows the last one, and `until` is applied to that only, so
    it is not an engine stop (which could cut the thinking)."""
    engine = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "kv_cache_memory": 2**22}
    lm = BatchpageLM(pretrained=str(r1_folder), think_end_token="</think>", **engine)
    eos = lm.tokenizer.eos_token
    params, until = lm._sampling_params({"until": ["\n\n"], "max_gen_toks": 12}, eos)
    assert params.stop == [] and until == ["\n\n", eos]
    raw = LLM(str(r1_folder), **engine).generate(
        ["Hello world", "A radix tree"],
        SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )
    kwargs = {"until": ["\n\n"], "max_gen_toks": 12}
    requests = [
        Instance("generate_until", {}, (p, kwargs), idx=0) for p in ("Hello world", "A radix tree")
    ]
    texts = lm.generate_until(requests, disable_tqdm=True)
    assert texts == [postprocess_generated_text(o.outputs[0].text, until, "</think>") for o in raw]


def test_registered_and_unknown_model_args_refused(tiny_folder: Path) -> None:
    assert get_model("batchpage") is BatchpageLM
    with pytest.raises(
        TypeError, match=r"unknown batchpage model_args \['blocksize'\].*block_size"
    ):
        get_model("batchpage").create_from_arg_string(f"pretrained={tiny_folder},blocksize=4")


def test_vllm_model_args_are_taken_renamed_or_ignored(tiny_folder: Path, caplog) -> None:
    """What lm-eval's vLLM users paste: the length, the prefix cache, tensor parallelism and
    the memory share have meanings here; trust_remote_code and the like are ignored, saying
    so; anything else is refused naming what is taken."""
    args = (
        f"pretrained={tiny_folder},dtype=float32,kv_cache_memory=4194304,max_length=128,"
        "enable_prefix_caching=False,tensor_parallel_size=2,gpu_memory_utilization=0.8,"
        "trust_remote_code=True"
    )
    with caplog.at_level("WARNING"):
        lm = get_model("batchpage").create_from_arg_string(args)
    config = lm.llm.config
    assert (config.max_model_len, config.prefix_caching) == (128, False)
    assert config.tensor_parallel_size == 2 and config.kv_cache_memory == 4194304
    assert lm.llm.engine.runner.peers is not None  # a second rank, in a worker
    warned = caplog.text
    assert "trust_remote_code=True ignored" in warned
    assert "gpu_memory_utilization=0.8 ignored" in warned
    with pytest.raises(TypeError, match=r"\['lora_local_path'\].*gpu_memory_utilization"):
        get_model("batchpage").create_from_arg_string(f"pretrained={tiny_folder},lora_local_path=x")


def test_without_lm_eval_the_import_names_the_install_command() -> None:
    hide = "import sys; sys.modules['lm_eval'] = None; import batchpage.lm_eval"
    done = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0
    assert "pip install 'batchpage[lm_eval]'" in done.stderr.splitlines()[-1]


@pytest.mark.slow
def test_cli_runs_a_local_task(
    tiny_folder: Path, task_dir: Path, tmp_path: Path, plain_runs
) -> None:
    """`python -m batchpage.lm_eval` is lm-eval's CLI with the backend registered; without
    --device it gets lm-eval's default cuda:0, which falls back to this machine's CPU."""
    out = tmp_path / "out"
    args = ["--model", "batchpage", "--model_args", f"pretrained={tiny_folder},{ENGINE_ARGS}"]
    args += ["--tasks", "tiny_gen", "--include_path", str(task_dir)]
    args += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.lm_eval", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (samples_file,) = out.rglob("samples_tiny_gen_*.jsonl")
    cli = {s["doc_id"]: s["resps"] for s in map(json.loads, samples_file.read_text().splitlines())}
    in_process = {s["doc_id"]: s["resps"] for s in plain_runs[1]["samples"]["tiny_gen"]}
    assert cli == in_process
