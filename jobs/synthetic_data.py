"""Synthetic data: n sampled completions per ShareGPT seed prompt, de-duplicated, as Parquet.

    python jobs/synthetic_data.py --samples 4 --limit 1000 --out synthetic.parquet
    python jobs/synthetic_data.py --samples 8 dataset.path=my_seeds.jsonl model.path=/models/x

The generation is an ordinary batchpage job (sampling=default, sampling.n=--samples, a fixed
seed), run into <out>.job/: kill it at any moment and run the same command again to resume.
Then every completion is normalised (whitespace collapsed) and kept only the first time it is
seen, over the whole output; empty completions and failed rows are dropped. The result has one
row per kept completion: (seed_id, prompt, completion). Both passes stream: memory holds one
record batch and a 16-byte digest per kept completion.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

OUT_SCHEMA = pa.schema(
    [("seed_id", pa.string()), ("prompt", pa.string()), ("completion", pa.string())]
)


@dataclass
class DedupStats:
    completions: int = 0
    kept: int = 0
    duplicates: int = 0
    empty: int = 0
    failed_rows: int = 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=4, help="completions per seed prompt (n)")
    p.add_argument("--limit", type=int, default=None, help="seed prompts (default: the preset's)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("synthetic.parquet"))
    p.add_argument("--overwrite", action="store_true", help="replace another job's results")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset.path=seeds.jsonl")
    return p.parse_args(argv)


def job_config(args: argparse.Namespace) -> Any:
    from batchpage.run import compose_job

    overrides = [
        "dataset=sharegpt",
        "sampling=default",
        f"sampling.n={args.samples}",
        f"sampling.temperature={args.temperature}",
        f"sampling.top_p={args.top_p}",
        f"sampling.max_tokens={args.max_tokens}",
        f"sampling.seed={args.seed}",
    ]
    if args.limit is not None:
        overrides.append(f"dataset.limit={args.limit}")
    cfg = compose_job([*overrides, *args.overrides])
    cfg.output_dir = str(args.out.with_name(args.out.name + ".job"))
    cfg.overwrite = args.overwrite
    return cfg


def normalise(text: str) -> str:
    return " ".join(text.split())


def seed_prompts(dataset: Any) -> Iterator[str | None]:
    """The seed text of each input row, in input order: the prompt, or a chat's last user turn."""
    from batchpage.data import iter_rows

    for row in iter_rows(dataset):
        if row.messages:
            users = [m["content"] for m in row.messages if m["role"] == "user"]
            yield users[-1] if users else None
        else:
            yield row.prompt


def dedup(completions: Path, prompts: Iterator[str | None], out: Path) -> DedupStats:
    """Write (seed_id, prompt, completion) for each first-seen normalised completion."""
    stats = DedupStats()
    seen: set[bytes] = set()
    tmp = out.with_name(f".{out.name}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(tmp, OUT_SCHEMA) as writer:
        source = pq.ParquetFile(completions)
        for batch in source.iter_batches(columns=["id", "completion", "error"]):
            kept: list[dict[str, str | None]] = []
            for rec in batch.to_pylist():
                prompt = next(prompts)  # completions.parquet is in input order, one row each
                texts = rec["completion"]
                if rec["error"] is not None or texts is None:
                    stats.failed_rows += 1
                    continue
                for text in [texts] if isinstance(texts, str) else texts:
                    stats.completions += 1
                    key = normalise(text)
                    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
                    if not key:
                        stats.empty += 1
                    elif digest in seen:
                        stats.duplicates += 1
                    else:
                        seen.add(digest)
                        kept.append({"seed_id": rec["id"], "prompt": prompt, "completion": text})
            if kept:
                writer.write_table(pa.Table.from_pylist(kept, schema=OUT_SCHEMA))
    stats.kept = len(seen)
    os.replace(tmp, out)
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    from batchpage.run import run_for_script

    args = parse_args(argv)
    done = run_for_script(lambda: job_config(args))
    if done is None:
        return 2
    cfg, result = done
    stats = dedup(result.output_dir / "completions.parquet", seed_prompts(cfg.dataset), args.out)
    print(
        f"{stats.kept} unique completions from {result.rows} seeds -> {args.out} "
        f"({stats.duplicates} duplicates, {stats.empty} empty, {stats.failed_rows} failed seeds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
