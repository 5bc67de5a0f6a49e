"""The cost of structured outputs: constrained vs unconstrained decoding on this machine.

    python -m jobs.bench.structured --out bench/structured.json    # the real measurement
    python -m jobs.bench.structured --smoke                        # < 2 minutes: does it run?

Workload: B chat prompts (the bundled SmolLM2, float32, greedy, chat template) asking for a
city as JSON. The constrained arm gives every request a JSON schema of four fields (name,
country, population, landmarks) and ends where the grammar ends (ignore_eos off). The
unconstrained arm runs the same prompts without the schema, each request generating exactly as
many tokens as its constrained twin (max_tokens = that length, ignore_eos on): both arms then
run the same steps over the same batch sizes, and the only difference is the grammar work. The
figure is output tokens per second of wall time over one whole generate call. The prefix cache
is off, so neither arm reuses the other's prompts. Each arm runs --repeats times, alternating;
the best run of each counts (other processes can only slow a run down). The grammar is compiled
in a warm-up, outside the timing.
The first constrained request (one token) reads the vocabulary and compiles the schema: its
time is reported apart. Prints Markdown tables; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from batchpage import LLM, SamplingParams, StructuredOutputsParams
from batchpage.model.loader import load_tokenizer
from jobs.bench.engine_runs import load_llm, log, timed_generate
from jobs.bench.report import args_json, command_line, environment, markdown_table, save_results

TARGET_RATIO = 0.8  # constrained tok/s over unconstrained tok/s
# Bounded text, so that every output reaches the end of its grammar within max_tokens.
_TEXT = {"type": "string", "pattern": "^[A-Za-z .'-]{1,40}$"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": _TEXT,
        "country": _TEXT,
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": _TEXT, "maxItems": 3},
    },
    "required": ["name", "country", "population_millions", "landmarks"],
}
# One city per prompt, so that no two prompts are the same.
CITIES = (
    "Paris London Tokyo Delhi Shanghai Cairo Lagos Lima Bogota Madrid Rome Berlin Vienna Prague "
    "Warsaw Moscow Istanbul Tehran Karachi Dhaka Bangkok Hanoi Manila Jakarta Sydney Auckland "
    "Toronto Chicago Boston Denver Seattle Miami Havana Quito Santiago Nairobi Accra Dakar Tunis "
    "Athens Lisbon Dublin Oslo Helsinki Stockholm Copenhagen Amsterdam Brussels Zurich Munich "
    "Milan Naples Seville Porto Kyiv Minsk Riga Tallinn Vilnius Sofia Bucharest Belgrade Zagreb "
    "Budapest Ankara Baghdad Riyadh Dubai Doha Muscat Kabul Tashkent Almaty Beijing Seoul Osaka "
    "Taipei Singapore Yangon Colombo Kathmandu Lahore Mumbai Chennai Kolkata Perth Melbourne "
    "Brisbane Vancouver Montreal Houston Dallas Phoenix Atlanta Detroit Portland Austin Caracas "
    "Montevideo Asuncion Recife Salvador Brasilia Luanda Kinshasa Kampala Addis Khartoum Algiers "
    "Rabat Casablanca Marseille Lyon Geneva Hamburg Cologne Krakow Gdansk Bratislava Ljubljana "
    "Valletta Nicosia Beirut Amman Jerusalem Baku Yerevan Tbilisi"
)


def prompts_for(tokenizer: Any, count: int) -> list[list[int]]:
    cities = CITIES.split()
    if count > len(cities):
        raise ValueError(f"at most {len(cities)} distinct prompts, got a batch of {count}")
    ask = "Describe {} as JSON: its name, country, population in millions and three landmarks."
    chats = [[{"role": "user", "content": ask.format(city)}] for city in cities[:count]]
    return [tokenizer.apply_chat_template(chat) for chat in chats]


def measure(llm: LLM, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = prompts_for(llm.tokenizer, batch)
    constraint = StructuredOutputsParams(json=SCHEMA)
    json_params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint
    )
    first = timed_generate(llm, prompts, json_params)
    lengths = [len(samples[0]) for samples in first["outputs"]]
    arms = {
        "unconstrained": [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths
        ],
        "json schema": json_params,
    }
    runs: dict[str, list[dict[str, Any]]] = {"json schema": [first], "unconstrained": []}
    # Alternating, after the first constrained run: json, plain, json, plain, ...
    for name in (["unconstrained", "json schema"] * args.repeats)[:-1]:
        run = timed_generate(llm, prompts, arms[name])
        log(f"batch {batch}, {name}: {run['generated_tokens']} tokens in {run['wall_s']:.1f} s, "
            f"{run['output_tok_s']:.1f} tok/s, {run['stats']['steps']} steps")  # fmt: skip
        if [len(samples[0]) for samples in run["outputs"]] != lengths:
            raise RuntimeError(f"batch {batch}, {name}: the arms generated different lengths")
        runs[name].append(run)
    best = {name: max(rs, key=lambda r: r["output_tok_s"]) for name, rs in runs.items()}
    texts = [llm.tokenizer.decode(samples[0]) for samples in best["json schema"]["outputs"]]
    return {
        "batch": batch,
        "best": {name: {k: v for k, v in r.items() if k != "outputs"} for name, r in best.items()},
        "all_tok_s": {name: [r["output_tok_s"] for r in rs] for name, rs in runs.items()},
        "ratio": best["json schema"]["output_tok_s"] / best["unconstrained"]["output_tok_s"],
        "constrained_outputs_that_parse": sum(_parses(t) for t in texts),
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def report(results: list[dict[str, Any]], compile_s: float) -> str:
    rows = []
    for r in results:
        for name, run in r["best"].items():
            steps = run["stats"]["steps"]
            rows.append(
                [
                    r["batch"],
                    name,
                    run["generated_tokens"],
                    run["wall_s"],
                    run["output_tok_s"],
                    1000 * run["wall_s"] / steps,
                    f"{r['ratio']:.2f}x" if name == "json schema" else "-",
                ]
            )
    table = markdown_table(
        ["batch", "arm", "tokens", "wall s", "tok/s", "ms/step", "vs unconstrained"], rows
    )
    return (
        f"{table}\n\nThe first constrained request, one token, which compiles the schema: "
        f"{compile_s:.2f} s (outside the timing). Goal: >= {TARGET_RATIO}x."
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--batches", default="16,128", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="runs per arm (the best counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny run to check that it works")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.max_tokens, args.repeats = "4", 24, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = load_llm(args.model, args.model, dtype="float32", max_num_seqs=max(batches),
                   prefix_caching=False, max_model_len=512)  # fmt: skip
    warm = SamplingParams(temperature=0, max_tokens=1,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))  # fmt: skip
    compile_s = timed_generate(llm, prompts_for(load_tokenizer(args.model), 1), warm)["wall_s"]
    results = [measure(llm, batch, args) for batch in batches]
    print(report(results, compile_s))
    env = environment()
    print(f"\nMachine: {env['cpu']}; command: {command_line()}")
    if args.out:
        save_results(args.out, env, results, args=args_json(args), schema=SCHEMA,
                     first_constrained_request_s=compile_s)  # fmt: skip


if __name__ == "__main__":
    main()
