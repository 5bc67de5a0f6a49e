#!/usr/bin/env bash
# The prepared GPU run of issue #75: everything a lent CUDA machine should run, in one call.
#
#   bash jobs/bench/gpu_run.sh                  # on the GPU machine, from the repository root
#
# The device tool's call (the wheels travel in .whl, which .git/info/exclude ignores):
#   run(command="bash jobs/bench/gpu_run.sh", carry=[".whl"], timeout_s=540)
# A rerun of some steps only, e.g. after fixes (setup is needed in every fresh call):
#   run(command="GPU_RUN_STEPS=setup,tests_extra,bench_engine GPU_RUN_EXTRA_TESTS=tests/lora
#       bash jobs/bench/gpu_run.sh", carry=[".whl"], timeout_s=300)        (on one line)
#
# Steps, in order (GPU_RUN_STEPS picks a comma list of them; default: all):
#   setup         the wheels in .whl into /tmp/site (PYTHONPATH=/tmp/site:$PWD)
#   env           nvidia-smi, torch / triton / CUDA versions, the packages' versions, the imports
#   tests_kernels tests/kernels' Triton files (test_cpu_*, test_build_all and
#                 test_interpreter_dot left out: CPU-only) and tests/attention
#   tests_engine  the engine on the device, in one pytest run: CUDA graphs of decode steps
#                 (test_decode_graphs), batch_invariant, structured outputs, tests/lora (the
#                 Triton LoRA kernels), and tests/quant/test_engine.py's Triton int kernel cases
#                 (-k "not test_engine.py or triton or batch_invariant" keeps only those there)
#   tests_tp      tensor parallelism over NCCL (tests/distributed), only where 2+ GPUs are seen
#   tests_extra   the test paths / node ids in GPU_RUN_EXTRA_TESTS (split at spaces), where
#                 set
#   bench_decode  python3 -m jobs.bench.gpu --parts b --dtype bfloat16 (decode kernel vs SDPA)
#   bench_engine  python3 -m jobs.bench.gpu --parts c --dtype bfloat16 --engine-max-seqs 512
#   bench_lora    python3 -m jobs.bench.lora: 8 adapters against the base model, random 1B shape
#   bench_8b      python3 -m jobs.bench.gpu --parts d: a Llama-3.1-8B shape (random weights drawn
#                 on the GPU) at 1000 in / 1000 out, FP8 blocks, then bf16 where the time left
#                 allows, beside TensorRT-LLM's FP8 figure (H100 15,220, H200 17,744 out tok/s);
#                 224 requests on an H100, 256 on an H200: one wave, all running at once
#                 (jobs/bench/gpu_8b.py's docstring sizes it)
# The Triton interpreter stays off (TRITON_INTERPRET unset): tests/conftest.py turns it on only
# where CUDA is missing.
#
# Time: the whole script keeps within GPU_RUN_BUDGET_S (default 480: 8 minutes, so that a
# 540 s call ends with time to spare). Each step runs under `timeout` at the lesser of its own
# cap and what is left once the later benchmarks' reserves are set aside (decode 45 s, the 1B
# engine 150 s, the 8B part 150 s: FP8's draw and write of ~9 GB, load, capture, a prefill of
# 224k tokens and 1000 decode steps; the LoRA bench runs on what the others leave); a step with
# under 10 s left is skipped and says so. pytest gets SIGINT first (it still writes its junit
# XML), then SIGKILL. No `set -e`: a failing step never stops the next; each step's exit status
# is printed. Where the 8B part is cut short or skipped, a second call runs it alone:
#   run(command="GPU_RUN_STEPS=setup,bench_8b bash jobs/bench/gpu_run.sh", carry=[".whl"],
#       timeout_s=300)                                                     (on one line)
#
# What comes back under $OUT (at most 8 files):
#   summary.txt        every step's exit status, seconds and timeout; pytest's FAILED/ERROR
#                      lines and final counts; the benchmarks' tables (this script's stdout)
#   env.txt            the machine and the package versions
#   logs.tar.gz        each step's full log and pytest's junit XML (re-packed after every step)
#   gpu_kernels.json   (b) decode attention        gpu_engine.json   (c) the engine
#   gpu_lora.json      8 LoRA adapters against the base model
#   gpu_8b.json        (d) the 8B shape at 1000/1000 against TensorRT-LLM
#
# Knobs: GPU_RUN_STEPS, GPU_RUN_BUDGET_S, GPU_RUN_PEAK_TBPS (else from the GPU's name),
# GPU_RUN_WORKERS (pytest-xdist workers, default 8), GPU_RUN_EXTRA_TESTS, GPU_RUN_PYTHON
# (default python3). Checks without a GPU: GPU_RUN_DRY=1 prints each step's command and timeout
# and runs nothing; GPU_RUN_SMOKE=1 runs on the CPU: pytest --collect-only over the same
# selection, and the benchmarks' --smoke (Triton's interpreter) in place of the GPU sizes.
#
# The wheels (.whl, 8.4 MiB): what the project imports at run time or in these tests that the
# GPU image ('cuda': python3 3.12, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, peft,
# safetensors, tokenizers, numpy, pyarrow, pillow, fsspec, jinja2, pyyaml, attrs, psutil, ...)
# lacks, with the dependencies of each that it lacks too; jobs/bench/gpu_wheels.txt lists them:
#   xgrammar 0.2.9 (structured outputs; batchpage/engine/sampler.py imports it)
#     + apache-tvm-ffi 0.1.15.post2, pydantic 2.14.4, pydantic-core 2.50.5,
#       annotated-types 0.8.0, typing-inspection 0.4.5, typing-extensions 4.16.0 (pydantic
#       needs >= 4.16, newer than the image's may be)
#   gguf 0.19.0 (GGUF reader; tests/model_factory.py imports it)
#   hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3 (batchpage/job/config.py;
#     the LoRA job tests)
#   compressed-tensors 0.20.1 + loguru 0.7.3 (tests/quant/packers.py packs checkpoints with it)
#   jsonschema 4.26.0 + jsonschema-specifications 2025.9.1, referencing 0.37.0, rpds-py
#     2026.9.1 (tests/engine/test_structured.py's reference check)
# Not carried: transformers stays the image's 5.17.0 (5.25.0 here: carrying it would pull
# huggingface-hub 2.x and `kernels`, under the image's peft and accelerate); datasets (only HF
# dataset inputs import it, no test here); the bundled SmolLM2 GGUF (98 MB: its tests skip).
# Re-downloading them, from the repository root (antlr4-python3-runtime 4.9.3 has no wheel on
# PyPI: pip builds one from its sdist, pure Python):
#   echo /.whl/ >> .git/info/exclude   # once
#   grep -v antlr4 jobs/bench/gpu_wheels.txt | xargs python3 -m pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl
#   python3 -m pip wheel --no-deps --no-build-isolation -w .whl antlr4-python3-runtime==4.9.3

set -u
export PYTHONUNBUFFERED=1
# Nothing outside the GPU machine can be reached: never wait on the Hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

DRY=${GPU_RUN_DRY:-0}
SMOKE=${GPU_RUN_SMOKE:-0}
PY=${GPU_RUN_PYTHON:-python3}
BUDGET=${GPU_RUN_BUDGET_S:-480}
WORKERS=${GPU_RUN_WORKERS:-8}
ALL_STEPS=setup,env,tests_kernels,tests_engine,tests_tp,tests_extra
ALL_STEPS=$ALL_STEPS,bench_decode,bench_engine,bench_lora,bench_8b
STEPS=${GPU_RUN_STEPS:-$ALL_STEPS}
OUT=${OUT:-/tmp/gpu_run_out}
LOGS=/tmp/gpu_run_logs

START=$(date +%s)
DEADLINE=$((START + BUDGET))
rm -rf "$LOGS"  # a rerun on a warm machine: none of the last run's logs
mkdir -p "$OUT" "$LOGS"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
wants() { [[ ",$STEPS," == *",$1,"* ]]; }
elapsed() { echo $(($(date +%s) - START)); }

# Seconds kept back for the benchmarks that are to run: the 8B part while anything before it
# runs, (c) too while (b) and the tests run, (b) too while the tests run.
RESERVE_8B=0
wants bench_8b && RESERVE_8B=150
RESERVE_ENGINE=$RESERVE_8B
wants bench_engine && RESERVE_ENGINE=$((RESERVE_ENGINE + 150))
RESERVE_BENCH=$RESERVE_ENGINE
wants bench_decode && RESERVE_BENCH=$((RESERVE_BENCH + 45))

bundle_logs() {  # atomically, so that a kill mid-way leaves the last whole bundle
  [[ $DRY == 1 ]] && return
  tar -czf /tmp/gpu_run_logs.tar.gz -C /tmp gpu_run_logs 2>/dev/null &&
    mv -f /tmp/gpu_run_logs.tar.gz "$OUT/logs.tar.gz"
}

# run_step NAME CAP RESERVE CMD...: CMD under `timeout`, its output in $LOGS/NAME.log.
STEP_RC=0
run_step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local left=$((DEADLINE - $(date +%s) - reserve))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    say "step $name: skipped, ${left}s left of the budget after the reserve (t=$(elapsed)s)"
    STEP_RC=-1
    return
  fi
  local shown
  shown=$(printf '%q ' "$@")
  if [[ $DRY == 1 ]]; then
    say "step $name: timeout ${limit}s: $shown"
    STEP_RC=0
    return
  fi
  say "step $name: start (t=$(elapsed)s, timeout ${limit}s): $shown"
  local t0
  t0=$(date +%s)
  timeout -s INT -k 15 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  STEP_RC=$?
  local note=""
  ((STEP_RC == 124 || STEP_RC == 137)) && note=" (timed out)"
  say "step $name: rc=$STEP_RC$note in $(($(date +%s) - t0))s (t=$(elapsed)s)"
  bundle_logs
}

# The arguments, less test paths (tests/...) that are not there: a renamed test file must not
# stop its whole group (pytest exits 4 on a missing path).
existing() {
  local p
  for p in "$@"; do
    if [[ $p != tests/* || -e ${p%%::*} ]]; then
      echo "$p"
    else
      say "  missing test path, left out: $p" >&2
    fi
  done
}

PYTEST_FLAGS=(-q -rfE -p no:cacheprovider --durations=10)
if [[ $SMOKE == 1 ]]; then
  PYTEST_FLAGS=(-q -p no:cacheprovider --collect-only)
else
  if [[ $DRY == 1 ]] || "$PY" -c "import xdist" 2>/dev/null; then
    PYTEST_FLAGS+=(-n "$WORKERS")
  fi
  if [[ $DRY == 1 ]] || "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_FLAGS+=(--timeout=90)  # one hung test ends its worker, not the group
  fi
fi

# tests_* NAME CAP ARGS...: pytest over ARGS; its FAILED/ERROR lines and counts into summary.
pytest_step() {
  local name=$1 cap=$2
  shift 2
  local args=()
  mapfile -t args < <(existing "$@")
  run_step "$name" "$cap" "$RESERVE_BENCH" "$PY" -m pytest "${PYTEST_FLAGS[@]}" \
    --junitxml="$LOGS/junit_$name.xml" "${args[@]}"
  [[ $DRY == 1 || ! -f $LOGS/$name.log ]] && return
  grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" | head -n 40 | sed 's/^/  /' | tee -a "$SUMMARY"
  grep -E "(passed|failed|error|skipped|deselected|tests? collected).* in [0-9.]+s" \
    "$LOGS/$name.log" | tail -n 1 | sed 's/^/  /' | tee -a "$SUMMARY"
}

# bench_step NAME CAP RESERVE CMD...: a benchmark; its tables (from its title or `Command:`
# line on) into summary, else (a crash, a timeout) its last lines.
bench_step() {
  local name=$1
  run_step "$@"
  [[ $DRY == 1 || ! -f $LOGS/$name.log ]] && return
  if grep -qE "^(## |Command:)" "$LOGS/$name.log"; then
    awk '/^(## |Command:)/ { p = 1 } p' "$LOGS/$name.log"
  else
    tail -n 30 "$LOGS/$name.log"
  fi | sed 's/^/  /' | tee -a "$SUMMARY"
}

say "gpu_run: steps $STEPS; budget ${BUDGET}s; out $OUT; dry=$DRY smoke=$SMOKE"

# --- setup ---------------------------------------------------------------------------------
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if wants setup && [[ $SMOKE != 1 ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    run_step setup 120 0 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    # Tests that start Python with PYTHONPATH set to the checkout alone (the LoRA job tests)
    # must see the wheels too: a .pth in the interpreter's own site-packages puts /tmp/site
    # first on every python3's path (the machine is a disposable one).
    purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    pth='import sys; sys.path.insert(0, "/tmp/site")'
    if [[ $DRY == 1 ]]; then
      say "step setup: then $purelib/gpu_run_site.pth: $pth"
    elif echo "$pth" >"$purelib/gpu_run_site.pth"; then
      say "step setup: /tmp/site first on every $PY's path ($purelib/gpu_run_site.pth)"
    else
      say "step setup: cannot write $purelib: only PYTHONPATH carries /tmp/site"
    fi
  else
    say "step setup: no .whl/*.whl here (carry .whl): the image's packages only"
  fi
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [[ $SMOKE == 1 ]]; then
  say "smoke: CPU checks; Triton's interpreter as tests/conftest.py and jobs.bench.gpu set it"
else
  unset TRITON_INTERPRET
fi

# --- the GPU: name, count, peak bandwidth --------------------------------------------------
GPU_NAME=none
GPU_COUNT=0
if command -v nvidia-smi >/dev/null; then
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  GPU_COUNT=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
fi
# HBM peak (datasheets), the largest decode sweep's K/V (held twice: paged and contiguous) and
# the 8B part's requests (250 MiB of K/V each at 2000 tokens: what the pool holds at once).
case $GPU_NAME in
  *H200*) PEAK=4.8 MAXKV=40 E2E_REQ=256 ;;
  *H100*NVL*) PEAK=3.9 MAXKV=24 E2E_REQ=256 ;;
  *H100*PCIe*) PEAK=2.0 MAXKV=24 E2E_REQ=224 ;;
  *H100*) PEAK=3.35 MAXKV=24 E2E_REQ=224 ;;
  *) PEAK=3.35 MAXKV=16 E2E_REQ=128 ;;
esac
PEAK=${GPU_RUN_PEAK_TBPS:-$PEAK}
say "gpu: ${GPU_NAME:-none} x $GPU_COUNT; peak ${PEAK} TB/s; decode sweep up to ${MAXKV} GiB K/V"

# --- env -----------------------------------------------------------------------------------
if wants env; then
  cat >"$LOGS/env_check.py" <<'EOF'
import importlib.metadata as md
import sys

import torch

print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "capability", (p.major, p.minor), "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1))
for name in ["triton", "transformers", "tokenizers", "safetensors", "peft", "accelerate",
             "numpy", "pyarrow", "xgrammar", "apache-tvm-ffi", "pydantic", "hydra-core",
             "omegaconf", "gguf", "compressed-tensors", "jsonschema", "pytest", "pytest-xdist",
             "pytest-timeout", "hypothesis", "typing-extensions"]:
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import batchpage, compressed_tensors, gguf, hydra, jsonschema, xgrammar  # noqa: E401,F401
from batchpage import LLM  # noqa: F401

print("imports: ok")
EOF
  cat >"$LOGS/env_check.sh" <<'EOF'
echo "== date"; date -u
echo "== uname"; uname -a
echo "== cpus / memory / disk"; nproc; free -g; df -h /tmp | tail -n 1
echo "== nvidia-smi"; nvidia-smi 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
  --format=csv 2>&1
echo "== compilers"; (gcc --version | head -n 1; nvcc --version | tail -n 1) 2>&1
echo "== python"; "$1" "$2"
EOF
  run_step env 90 0 bash "$LOGS/env_check.sh" "$PY" "$LOGS/env_check.py"
  if [[ $DRY != 1 && -f $LOGS/env.log ]]; then
    cp -f "$LOGS/env.log" "$OUT/env.txt"
    grep -E "^(torch|device|triton|transformers|imports|Traceback|[A-Za-z]*Error)" \
      "$OUT/env.txt" | sed 's/^/  /' | tee -a "$SUMMARY"
  fi
fi

# --- tests on the device --------------------------------------------------------------------
if wants tests_kernels; then
  pytest_step tests_kernels 120 tests/kernels tests/attention \
    --ignore-glob="tests/kernels/test_cpu_*" --ignore=tests/kernels/test_build_all.py \
    --ignore=tests/kernels/test_interpreter_dot.py
fi
if wants tests_engine; then
  pytest_step tests_engine 150 tests/engine/test_decode_graphs.py \
    tests/engine/test_batch_invariant.py tests/engine/test_structured.py tests/lora \
    tests/quant/test_engine.py -k "not test_engine.py or triton or batch_invariant"
fi
if wants tests_tp; then
  if ((GPU_COUNT >= 2)) || [[ $DRY == 1 ]]; then
    pytest_step tests_tp 90 tests/distributed/test_tensor_parallel.py -k cuda
  else
    say "step tests_tp: skipped, $GPU_COUNT GPU(s): NCCL tensor parallelism needs 2"
  fi
fi
if wants tests_extra && [[ -n ${GPU_RUN_EXTRA_TESTS:-} ]]; then
  read -r -a extra <<<"$GPU_RUN_EXTRA_TESTS"
  pytest_step tests_extra 120 "${extra[@]}"
fi

# --- benchmarks -----------------------------------------------------------------------------
SMOKE_FLAG=()
[[ $SMOKE == 1 ]] && SMOKE_FLAG=(--smoke)
if wants bench_decode; then
  bench_step bench_decode 70 "$RESERVE_ENGINE" "$PY" -m jobs.bench.gpu "${SMOKE_FLAG[@]}" \
    --parts b --dtype bfloat16 --peak-tbps "$PEAK" --max-kv-gib "$MAXKV" \
    --out "$OUT/gpu_kernels.json"
fi
if wants bench_engine; then
  bench_step bench_engine 300 "$RESERVE_8B" "$PY" -m jobs.bench.gpu "${SMOKE_FLAG[@]}" \
    --parts c --dtype bfloat16 --peak-tbps "$PEAK" --engine-max-seqs 512 \
    --out "$OUT/gpu_engine.json"
fi
if wants bench_lora; then
  # The 1B shape's folder is built inside the step (its time counted there); smoke: tiny.
  if [[ $SMOKE == 1 ]]; then
    LORA_ARGS="tiny --adapters 2 --rank 4 --requests 4 --rounds 1"
  else
    LORA_ARGS="1b --adapters 8 --rank 16 --requests 64 --rounds 2"
  fi
  left=$((DEADLINE - $(date +%s) - RESERVE_8B))
  if ((left < 60)) && [[ $DRY != 1 ]]; then
    say "step bench_lora: skipped, ${left}s left after the 8B reserve (it needs about a minute)"
  else
    bench_step bench_lora 150 "$RESERVE_8B" bash -c 'set -u; shape=$1; shift
      folder=$("$0" -m jobs.bench.random_models "$shape") || exit
      exec "$0" -m jobs.bench.lora --model "$folder" --prompts random --dtype bfloat16 "$@"' \
      "$PY" $LORA_ARGS --out "$OUT/gpu_lora.json"
  fi
fi
if wants bench_8b; then
  # FP8 first (TensorRT-LLM's figure is FP8's); bf16 starts only where the time left allows
  # (--e2e-budget-s: the step's own limit, less the JSON's and the summary's seconds).
  left=$((DEADLINE - $(date +%s)))
  e2e_budget=$((left < 300 ? left - 20 : 280))
  bench_step bench_8b 300 0 "$PY" -m jobs.bench.gpu "${SMOKE_FLAG[@]}" \
    --parts d --e2e-formats fp8,bf16 --e2e-requests "$E2E_REQ" --e2e-max-seqs 256 \
    --e2e-budget-s "$e2e_budget" --peak-tbps "$PEAK" --out "$OUT/gpu_8b.json"
fi

bundle_logs
say "gpu_run: done in $(elapsed)s"
say "files: $(cd "$OUT" && ls | tr '\n' ' ')"
