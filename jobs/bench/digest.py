"""What it costs to check, before a job starts, that its input did not change (every byte
hashed with blake2b) and to count its rows (for the progress bar's total), on a large JSONL file.

    python -m jobs.bench.digest --gib 1

The file is written once into a temporary folder (or --path) and removed afterwards. The first
pass also warms the page cache, so the timed passes measure hashing and parsing, not the disk.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from batchpage.data import DatasetSpec, validate
from batchpage.data.readers import count_records
from batchpage.fileio import file_digest
from jobs.bench.report import cpu_model, log, markdown_table, timed


def write_jsonl(path: Path, size: int) -> int:
    """ShareGPT-like rows (a few hundred bytes of prompt each) until the file reaches `size`."""
    line = json.dumps({"id": "x", "prompt": "Summarise the following text. " * 12}) + "\n"
    count = size // len(line)
    with open(path, "w") as f:
        for start in range(0, count, 10_000):
            f.write(line * min(10_000, count - start))
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--path", type=Path, default=None, help="where to write the file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.path) as tmp:
        path = Path(tmp) / "big.jsonl"
        rows = write_jsonl(path, int(args.gib * 2**30))
        size = path.stat().st_size
        file_digest(path)  # warm the page cache
        _, digest_s = timed(lambda: file_digest(path))
        _, count_s = timed(lambda: count_records("jsonl", [path]))
        info, validate_s = timed(lambda: validate(DatasetSpec(path=str(path))))
        assert info.num_rows == rows
    gib = size / 2**30
    print(f"CPU: {cpu_model()}; {rows:,} rows, {gib:.2f} GiB")
    print(
        markdown_table(
            ["step", "seconds", "GiB/s"],
            [
                ["blake2b of every byte (file_digest)", f"{digest_s:.2f}", f"{gib / digest_s:.2f}"],
                ["row count (count_records)", f"{count_s:.2f}", f"{gib / count_s:.2f}"],
                ["validate (both, plus schema)", f"{validate_s:.2f}", f"{gib / validate_s:.2f}"],
            ],
        )
    )
    log("done")


if __name__ == "__main__":
    main()
