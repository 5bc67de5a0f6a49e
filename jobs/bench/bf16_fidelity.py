"""Greedy fidelity in bfloat16: batchpage against HF transformers, both in bf16, on the bundled
model (issue #15: divergences only at near-ties, and the match rate).

    python -m jobs.bench.bf16_fidelity --out jobs/bench/results/bf16_fidelity.json
    python -m jobs.bench.bf16_fidelity --dtype float32        # the same table in float32

ShareGPT first turns through the chat template, greedy, --new-tokens each. For every request
whose tokens differ, HF's own forward over the prompt and the common prefix gives the logits at
the first divergent position: the gap between HF's top two logits there, and between HF's logit
for its token and for batchpage's, says whether the flip is a near-tie (two candidates within
bf16's rounding of each other) or a real disagreement.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from batchpage import LLM, SamplingParams
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench import report
from jobs.bench.workloads import sharegpt_workload


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """HF's greedy continuation of one prompt, EOS ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__, smoke=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    source = resolve_model_source(args.model)
    tok = load_tokenizer(source)
    prompts = sharegpt_workload(tok, args.prompts, args.seed, max_prompt_tokens=128).prompts

    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    report.log("batchpage done")
    dtype = getattr(torch, args.dtype)
    if source.kind == "hf":
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=dtype
        )
    hf.eval()

    rows, results = [], []
    for i, (prompt, mine) in enumerate(zip(prompts, ours, strict=True)):
        theirs = hf_greedy(hf, prompt, args.new_tokens)
        at = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        result = dict(request=i, prompt_tokens=len(prompt), same=at is None, first_divergence=at)
        if at is not None:
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
            top2 = logits.topk(2).values
            result |= dict(
                hf_top2_gap=float(top2[0] - top2[1]),
                hf_gap_to_ours=float(logits[theirs[at]] - logits[mine[at]]),
                hf_top_logit=float(top2[0]),
            )
            rows.append(
                [i, at, f"{result['hf_top2_gap']:.3f}", f"{result['hf_gap_to_ours']:.3f}",
                 f"{result['hf_top_logit']:.2f}"]
            )  # fmt: skip
        results.append(result)
        report.log(f"request {i}: {'same' if at is None else f'diverges at {at}'}")
    same = sum(r["same"] for r in results)
    env = report.environment()
    report.print_header(f"Greedy fidelity against HF in {args.dtype}", env)
    print(f"Identical greedy continuations: **{same}/{len(results)}** ({args.new_tokens} tokens)\n")
    if rows:
        header = ["request", "first divergent token", "HF top-2 logit gap",
                  "HF logit gap, its token - ours", "HF top logit"]  # fmt: skip
        print(report.markdown_table(header, rows))
    report.save_results(args.out, env, results)


if __name__ == "__main__":
    main()
