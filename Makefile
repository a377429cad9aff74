# embengine developer commands. Everything runs inside .venv, created on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's CPU build; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# FBGEMM's CPU build that loads with torch 2.13.0 (benchmarks only).
FBGEMM_SPEC ?= fbgemm-gpu-cpu==1.8.0
# TorchRec, for the tests that compare with its own classes (tests/test_torchrec_interop.py).
# --no-deps: it requires fbgemm-gpu, the CUDA build; FBGEMM_SPEC is its CPU build. Its other
# requirements are pinned and installed beside TORCH_SPEC, so none of them can move torch.
TORCHREC_SPEC ?= torchrec==1.8.0
TORCHREC_DEPS ?= tensordict==0.15.3 pyre-extensions==0.0.32 torchmetrics==1.0.3 tqdm
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup test demo lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[torch,train,dev,tf]"
	# MovieLens-100K ships inside recbole; --no-deps keeps its heavy dependencies out.
	$(PIP) install --no-deps "recbole==1.2.1"
	$(PIP) install "$(TORCH_SPEC)" "$(FBGEMM_SPEC)" $(TORCHREC_DEPS)
	$(PIP) install --no-deps "$(TORCHREC_SPEC)"
	touch $@

# One pytest worker per core plus one, at most 4 (each loads torch and numba's kernels): in a
# fresh clone a worker often waits while another compiles a kernel both need (compile_lock),
# and multi-process tests wait on their ranks; the extra worker uses those cores. Work
# stealing keeps the last slow tests from running on one worker while the others idle. The
# slowest tests are listed at the end so that a slow one is seen.
PYTEST_WORKERS ?= -n $(shell n=$$(nproc); [ $$n -ge 3 ] && echo 4 || echo $$((n + 1))) --dist worksteal

test: setup
	$(PY) -m pytest $(PYTEST_WORKERS) --durations=15

demo: setup
	$(VENV)/bin/embengine train --dataset movielens-100k

bench: setup
	$(PIP) install "$(FBGEMM_SPEC)"
	$(PY) -m embengine.cli bench

lint: setup
	$(PY) -m ruff check embengine tests examples
	$(PY) -m ruff format --check embengine tests examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
