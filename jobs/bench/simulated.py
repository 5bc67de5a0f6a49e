"""python -m jobs.bench.simulated: the engine's schedule on a device, a model or a pool it does
not run here. The real scheduler, KV manager and radix cache (batchpage/simulate) step through the
requests; each step costs what a roofline of the device says, with efficiency factors fitted
to measured runs.

    python -m jobs.bench.simulated fit --runs jobs/bench/results/sim_calibration.json \
        --out jobs/bench/results/sim_fit_cpu.json
    python -m jobs.bench.simulated validate --runs jobs/bench/results/kv_sweep.json \
        --fit jobs/bench/results/sim_fit_cpu.json
    python -m jobs.bench.simulated predict --model llama-13b --device a100-80gb --requests 1000
    python -m jobs.bench.simulated predict --model llama-2-70b --device h100 --tp 8 --requests 1000

fit: the efficiency factors (share of peak FLOP/s, of peak bandwidth, per-step and per-sequence
overhead) that make the simulated times of the runs of jobs.bench.kv_sweep --calibrate the
measured ones (least squares on log time). validate: replays each measured run of a sweep
(its requests, output lengths, engine settings and pool) and sets predicted throughput beside
measured. predict: ShareGPT first turns (their prompt and reply lengths in the bundled
tokenizer) on a named model shape and device, paged against static KV at the memory the device
leaves after the weights (--gpu-memory-utilization), and over pool sizes from tight to ample;
--efficiency names the fit to use ("h200-measured": batchpage's own per-step overhead as the
one H200 run measured it, or a fit file; default: an engine at vLLM's sub-millisecond overhead).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from batchpage.engine.config import EngineConfig
from batchpage.model.config import ModelConfig
from batchpage.model.loader import load_tokenizer, resolve_model_source
from batchpage.simulate.devices import device
from batchpage.simulate.fit import FIT_NAMES, FitGroup, fit_efficiency
from batchpage.simulate.gpu_efficiency import LLAMA_32_1B, VLLM_LIKE, h200_measured
from batchpage.simulate.simulator import SimRequest, SimResult, simulate
from batchpage.simulate.step_cost import Efficiency, ModelShape, StepCost
from jobs.bench.report import environment, fmt, log, markdown_table, save_results
from jobs.bench.workloads import sharegpt_records

# Public config.json sizes of the shapes the paper's claim is about, and the H200 run's.
SHAPES = {
    "llama-13b": ModelConfig(32000, 5120, 13824, 40, 40, 40, 128),
    "llama-2-70b": ModelConfig(32000, 8192, 28672, 80, 64, 8, 128),
    "llama-3.2-1b": LLAMA_32_1B,
}


def model_config(name: str) -> ModelConfig:
    return SHAPES[name] if name in SHAPES else resolve_model_source(name).config


def replay(run: dict[str, Any], cost: StepCost, keep_steps: bool = False) -> SimResult:
    """A measured run (jobs.bench.kv_sweep's record) through the simulator."""
    cfg = EngineConfig(**run["engine"], max_model_len=run["max_model_len"])
    requests = [
        SimRequest(p, m, n, run["ignore_eos"])
        for p, m, n in zip(run["prompts"], run["max_tokens"], run["output_lens"], strict=True)
    ]
    return simulate(
        requests, cfg, run["num_blocks"], run["max_model_len"], cost,
        run["max_num_batched_tokens"], keep_steps,
    )  # fmt: skip


def fit(
    runs: list[dict[str, Any]], cost: StepCost, free: tuple[str, ...] = FIT_NAMES
) -> Efficiency:
    """Least squares on log time over the runs (each replayed once: the schedule does not
    depend on the step times); the factors not in `free` stay as cost.eff has them."""
    groups = []
    for run in runs:
        sim = replay(run, cost, keep_steps=True)
        groups.append(FitGroup(sim.works, run["wall_s"], sim.swap_seconds))
    return fit_efficiency(groups, cost, free)


def efficiency(name: str) -> Efficiency:
    if name == "vllm-like":
        return VLLM_LIKE
    if name == "h200-measured":
        return h200_measured()
    with open(name) as f:
        values = json.load(f)["results"]["efficiency"]
    # Fits made before decode attention had a factor of its own ran it at `attention`'s.
    values.setdefault("decode_attention", values["attention"])
    return Efficiency(**values)


def sharegpt_requests(
    count: int, max_model_len: int, known: bool, seed: int = 0
) -> list[SimRequest]:
    """ShareGPT first turns as plain text (prompt and reply lengths in the bundled tokenizer;
    pairs longer than max_model_len left out, as the paper's setup does): with `known`, each
    generates its reply with ignore_eos; else max_tokens is what max_model_len leaves and the
    reply's end is an EOS the engine did not expect."""
    tokenizer = load_tokenizer(resolve_model_source("smollm2"))
    out = []
    for _, prompt, reply in sharegpt_records(seed):
        ids = tokenizer.encode(prompt)
        reply_len = max(1, len(tokenizer.encode(reply, add_special_tokens=False)))
        if len(ids) + reply_len > max_model_len:
            continue
        budget = reply_len if known else max_model_len - len(ids)
        out.append(SimRequest(ids, budget, reply_len, known))
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} ShareGPT pairs fit max_model_len={max_model_len}")


def predict(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = model_config(args.model)
    spec = device(args.device, args.dtype_bytes)
    shape = ModelShape.of(cfg, args.weight_bytes or args.dtype_bytes, args.dtype_bytes)
    cost = StepCost(shape, spec, efficiency(args.efficiency), args.tp)
    per_device_kv = (
        spec.memory * args.gpu_memory_utilization - shape.num_weights * shape.weight_bytes / args.tp
    )
    if per_device_kv <= 0:
        raise SystemExit(f"{args.model}'s weights do not fit {args.tp} x {spec.name}")
    device_tokens = int(per_device_kv / (shape.kv_bytes_per_token / args.tp))
    static = device_tokens // args.max_model_len
    pools = sorted({*(k for k in args.pools if k < static), static})
    log(
        f"{args.model} on {args.tp} x {spec.name}: {device_tokens:,} KV slots ({static} static "
        f"sequences); efficiency {cost.eff}"
    )
    results = []
    for known in (True, False):
        reqs = sharegpt_requests(args.requests, args.max_model_len, known, args.seed)
        for pool in pools:
            row: dict[str, Any] = {"pool_sequences": pool, "ignore_eos": known}
            for allocator in ("paged", "static"):
                engine = EngineConfig(
                    block_size=16, max_num_seqs=args.max_num_seqs, kv_allocator=allocator,
                    max_model_len=args.max_model_len,
                )  # fmt: skip
                blocks = pool * args.max_model_len // 16
                sim = simulate(reqs, engine, blocks, args.max_model_len, cost, 2048)
                row[allocator] = sim.as_dict()
            row["paged_vs_static"] = (
                row["paged"]["output_tokens_per_s"] / row["static"]["output_tokens_per_s"]
            )
            results.append(row)
            log(f"pool {pool} known={known}: paged/static {row['paged_vs_static']:.2f}x")
    return results


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    with open(args.runs) as f:
        runs = json.load(f)["results"]
    eff = efficiency(args.fit)
    out = []
    for run in runs:
        cost = cost_for(args.model, run, eff)
        sim = replay(run, cost)
        out.append({
            "tag": run["tag"], "allocator": run["engine"]["kv_allocator"],
            "measured_tok_s": run["output_tokens_per_s"],
            "simulated_tok_s": sim.output_tokens_per_s,
            "error": sim.output_tokens_per_s / run["output_tokens_per_s"] - 1,
            "measured_peak": run["peak_running"], "simulated_peak": sim.peak_running,
            "measured_preemptions": run["preemptions"], "simulated_preemptions": sim.preemptions,
        })  # fmt: skip
    return out


def cost_for(model: str, run: dict[str, Any], eff: Efficiency) -> StepCost:
    """The cost model of a run measured on this machine's CPU, in its dtype."""
    dtype_bytes = 4 if run["engine"]["dtype"] in ("float32", "auto") else 2
    shape = ModelShape.of(model_config(model), dtype_bytes, dtype_bytes)
    return StepCost(shape, device("cpu", dtype_bytes), eff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--runs", required=True)
    f.add_argument("--model", default="smollm2")
    f.add_argument("--only", default="", help="fit to the runs whose tag contains this")
    v = sub.add_parser("validate")
    v.add_argument("--runs", required=True)
    v.add_argument("--fit", required=True)
    v.add_argument("--model", default="smollm2")
    q = sub.add_parser("predict")
    q.add_argument("--model", required=True)
    q.add_argument("--device", required=True)
    q.add_argument("--tp", type=int, default=1)
    q.add_argument("--requests", type=int, default=1000)
    q.add_argument("--max-model-len", type=int, default=2048)
    q.add_argument("--max-num-seqs", type=int, default=256)
    q.add_argument("--dtype-bytes", type=int, default=2)
    q.add_argument("--weight-bytes", type=float, default=None, help="per weight (0.56: int4)")
    q.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    q.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 16, 32, 64, 128])  # fmt: skip
    q.add_argument("--efficiency", default="vllm-like")
    q.add_argument("--seed", type=int, default=0)
    for each in (f, v, q):
        each.add_argument("--out", default=None)
    args = p.parse_args()
    env = environment()
    if args.command == "fit":
        with open(args.runs) as fh:
            runs = [r for r in json.load(fh)["results"] if args.only in r["tag"]]
        eff = fit(runs, cost_for(args.model, runs[0], Efficiency()))
        checked = validate_runs(args.model, runs, eff)
        print(markdown_table(["run", "measured s", "simulated s"], checked))
        save_results(args.out, env, {"efficiency": asdict(eff), "runs": checked}, args)
        print(eff)
        return
    if args.command == "validate":
        rows = validate(args)
        print(markdown_table(
            ["run", "allocator", "measured tok/s", "simulated", "error", "peak (meas/sim)",
             "preemptions (meas/sim)"],
            [[r["tag"], r["allocator"], fmt(r["measured_tok_s"]), fmt(r["simulated_tok_s"]),
              f"{100 * r['error']:+.1f}%", f"{r['measured_peak']}/{r['simulated_peak']}",
              f"{r['measured_preemptions']}/{r['simulated_preemptions']}"] for r in rows],
        ))  # fmt: skip
        save_results(args.out, env, rows, args)
        return
    rows = predict(args)
    print(markdown_table(
        ["static sequences", "lengths known", "paged tok/s", "static tok/s", "paged/static",
         "peak running (paged/static)", "preemptions", "KV waste (paged/static)"],
        [[r["pool_sequences"], r["ignore_eos"], fmt(r["paged"]["output_tokens_per_s"]),
          fmt(r["static"]["output_tokens_per_s"]), f"{r['paged_vs_static']:.2f}x",
          f"{r['paged']['peak_running']}/{r['static']['peak_running']}", r["paged"]["preemptions"],
          f"{100 * r['paged']['kv_waste']:.0f}%/{100 * r['static']['kv_waste']:.0f}%"]
         for r in rows],
    ))  # fmt: skip
    save_results(args.out, env, rows, args)


def validate_runs(model: str, runs: list[dict[str, Any]], eff: Efficiency) -> list[list[Any]]:
    return [
        [r["tag"], fmt(r["wall_s"], 2), fmt(replay(r, cost_for(model, r, eff)).seconds, 2)]
        for r in runs
    ]


if __name__ == "__main__":
    main()
