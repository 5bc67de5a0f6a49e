"""Synthetic data: n sampled completions per ShareGPT seed prompt, de-duplicated, as Parquet.

    python -m jobs.synthetic_data dataset.limit=1000 --out synthetic.parquet
    python -m jobs.synthetic_data sampling.n=8 dataset.path=my_seeds.jsonl model.path=/models/x

The generation is the job of conf/experiment/synthetic_data.yaml (4 samples per seed at
temperature 0.8, a fixed seed) with the Hydra overrides given here, run into <out>.job/ unless
output_dir= says otherwise: kill it at any moment and run the same command again to resume.
Then every completion is normalised (whitespace collapsed) and kept only the first time it is
seen, over the whole output; empty completions and failed rows are dropped. The result has one
row per kept completion: (seed_id, prompt, completion, finish_reason: "length" where max_tokens
cut it). Both passes stream: memory holds one record batch and a 16-byte digest per kept
completion.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from batchpage.job.config import JobConfig

EXPERIMENT = "+experiment=synthetic_data"
# finish_reason: "stop" (the model ended it) or "length" (cut at max_tokens), so a consumer can
# keep only whole completions.
OUT_SCHEMA = pa.schema(
    [
        ("seed_id", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("finish_reason", pa.string()),
    ]
)


@dataclass
class DedupStats:
    completions: int = 0
    kept: int = 0
    duplicates: int = 0
    empty: int = 0
    failed_rows: int = 0
    truncated: int = 0  # kept completions cut at max_tokens (finish_reason "length")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("synthetic.parquet"),
        help="the (seed_id, prompt, completion) file; the job runs into <out>.job/",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of the job, e.g. sampling.n=8 dataset.path=seeds.jsonl "
        "overwrite=true",
    )
    return p.parse_intermixed_args(argv)


def job_config(args: argparse.Namespace) -> JobConfig:
    from batchpage.run import compose_job

    cfg = compose_job([EXPERIMENT, *args.overrides])
    if cfg.output_dir is None:  # the job's files sit next to the file they make
        cfg.output_dir = str(args.out.with_name(args.out.name + ".job"))
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


def dedup(completions: Path | BinaryIO, prompts: Iterator[str | None], out: Path) -> DedupStats:
    """Write (seed_id, prompt, completion) for each first-seen normalised completion."""
    stats = DedupStats()
    seen: set[bytes] = set()
    tmp = out.with_name(f".{out.name}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(tmp, OUT_SCHEMA) as writer:
        source = pq.ParquetFile(completions)
        for batch in source.iter_batches(columns=["id", "completion", "finish_reason", "error"]):
            kept: list[dict[str, str | None]] = []
            for rec in batch.to_pylist():
                prompt = next(prompts)  # completions.parquet is in input order, one row each
                texts = rec["completion"]
                if rec["error"] is not None or texts is None:
                    stats.failed_rows += 1
                    continue
                reasons = rec["finish_reason"]
                if isinstance(texts, str):
                    texts, reasons = [texts], [reasons]
                for text, reason in zip(texts, reasons, strict=True):
                    stats.completions += 1
                    key = normalise(text)
                    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
                    if not key:
                        stats.empty += 1
                    elif digest in seen:
                        stats.duplicates += 1
                    else:
                        seen.add(digest)
                        stats.truncated += reason == "length"
                        kept.append(
                            {
                                "seed_id": rec["id"],
                                "prompt": prompt,
                                "completion": text,
                                "finish_reason": reason,
                            }
                        )
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
    from batchpage.storage import Stores

    store = Stores(cfg.storage).store_for(result.completions)  # a local file or a URL
    with store.open_read(result.completions) as completions:
        stats = dedup(completions, seed_prompts(cfg.dataset), args.out)
    print(
        f"{stats.kept} unique completions from {result.rows} seeds -> {args.out} "
        f"({stats.duplicates} duplicates, {stats.empty} empty, {stats.failed_rows} failed seeds; "
        f"{stats.truncated} kept cut at max_tokens: finish_reason length)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
