# Entry points, all usable on a fresh machine:
#   make demo    set up .venv, build headwise, run the main job: python -m headwise.demo
#   make bench   set up .venv, build headwise, run the benchmark suite (CPU: minutes)
#   make test    set up .venv, build headwise, run the test suite
# Setup: a virtualenv with torch $(TORCH_VERSION) and the requirements, then
# `pip install --no-build-isolation .` (CUDA kernels when nvcc and a CUDA torch exist).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.14.1
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc python -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' -o -name '*.py' \)) setup.py

.PHONY: demo test bench install clean

demo: $(VENV)/.installed
	$(PY) -m headwise.demo --out demo_out

test: $(VENV)/.installed
	cd tests && ../$(PY) -m pytest -q -ra .

bench: $(VENV)/.installed
	$(PY) -m headwise.bench mhar qkv --json bench_out.json --png bench_out.png

install: $(VENV)/.installed

$(VENV)/.deps: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION) -r requirements-test.txt
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -v --no-build-isolation . > $(VENV)/build.log 2>&1 || (tail -50 $(VENV)/build.log; exit 1)
	@grep -E "^headwise: building" $(VENV)/build.log || true
	touch $@

clean:
	rm -rf build $(VENV) python/headwise/*.so python/*.egg-info
