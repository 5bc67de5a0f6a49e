"""OpenMP's wait policy on an idle and on a busy machine (batchpage/omp_wait.py's choice).

    python -m jobs.bench.omp_wait                          # idle, then one busy process beside
    python -m jobs.bench.omp_wait --busy 0,1 --rounds 2 --policies default,PASSIVE,spin:1000

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT when torch loads, so each measurement is a
process of its own, started with the policy in its environment (`default`: neither set, nor
chosen by batchpage, which leaves a set policy alone; `spin:N`: GOMP_SPINCOUNT=N). --busy
spinning processes (`while True: pass`) run beside each measurement. Workloads, each on a fresh
engine after a two-request warm-up, torch's default threads:
- short: the tiny random model, 4,000 prompts of 16-40 random ids, 4 tokens out (rows/s);
- decode: the tiny random model, 256 prompts of 64 ids, 64 out (out tok/s);
- smollm2: the bundled model at its fast dtype, 32 prompts of 32 ids, 64 out (out tok/s).
Prints one markdown row per workload and policy as it comes, with the CPU and the load.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from jobs.bench import report

WORKLOADS = ("short", "decode", "smollm2")


def measure(workload: str) -> float:
    """In this process (its policy set before torch loaded): the workload's figure."""
    from batchpage import LLM, SamplingParams
    from jobs.bench.random_models import random_model_folder

    rng = random.Random(0)
    if workload == "short":
        count, lengths, out, model, dtype = 4000, (16, 40), 4, "tiny", "float32"
    elif workload == "decode":
        count, lengths, out, model, dtype = 256, (64, 64), 64, "tiny", "float32"
    else:
        count, lengths, out, model, dtype = 32, (32, 32), 64, "smollm2", "auto"
    path = str(random_model_folder(model)) if model == "tiny" else model
    high = 1000 if model == "tiny" else 40000
    prompts = [[rng.randrange(3, high) for _ in range(rng.randint(*lengths))] for _ in range(count)]
    llm = LLM(model=path, dtype=dtype, max_model_len=lengths[1] + out, kv_cache_memory=2**30)
    params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    if workload == "short":
        return count / wall
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def run_one(workload: str, policy: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("spin:"):
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin:")
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    # `default` sets nothing: the child imports torch (jobs.bench.report) before batchpage,
    # whose choice then stays out of it, and libgomp spins as it does unasked.
    code = f"from jobs.bench.omp_wait import measure; print(measure({workload!r}))"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900, check=True)  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__, smoke=False)
    p.add_argument("--busy", default="0,1", help="comma list: spinning processes beside")
    p.add_argument("--policies", default="default,PASSIVE,spin:1000,spin:100")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=1, help="each figure's best of this many")
    args = p.parse_args(argv)
    report.print_header("OpenMP's wait policy, idle and busy", report.environment())
    print("| busy | workload | policy | figure (best of rounds) | unit | load at start |")
    print("|---:|---|---|---:|---|---|")
    found = []
    for busy in report.ints(args.busy):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]  # fmt: skip
        try:
            for workload in args.workloads.split(","):
                for policy in args.policies.split(","):
                    load = os.getloadavg()[0]
                    best = max(run_one(workload, policy) for _ in range(args.rounds))
                    unit = "rows/s" if workload == "short" else "out tok/s"
                    print(f"| {busy} | {workload} | {policy} | {best:,.0f} | {unit} | {load:.1f} |",
                          flush=True)  # fmt: skip
                    found.append({"busy": busy, "workload": workload, "policy": policy,
                                  "figure": best, "unit": unit, "load": load})  # fmt: skip
                    if args.out:
                        args.out.write_text(json.dumps(found, indent=1))
        finally:
            for s in spinners:
                s.kill()
                s.wait()


if __name__ == "__main__":
    main()
