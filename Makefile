# Entry points, all usable on a fresh machine:
#   make demo    set up .venv, build headwise, run the main job: python -m headwise.demo
#   make bench   set up .venv, build headwise, run the benchmark suite (CPU: minutes)
#   make test    set up .venv, build headwise, run the test suite
#   make sanitize  the CPU kernels and the emulator built with ASan + UBSan (build-asan/),
#                the test suite (no GPU, no gradcheck) run with libasan preloaded (CI runs it
#                after make test)
# Setup: a virtualenv with torch $(TORCH_VERSION) and the requirements, then
# `pip install --no-build-isolation .` (CUDA kernels when nvcc and a CUDA torch exist).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.14.1
PY := $(VENV)/bin/python
SOURCES := $(shell find csrc python -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' -o -name '*.py' \)) setup.py

.PHONY: demo test bench sanitize install clean

demo: $(VENV)/.installed
	$(PY) -m headwise.demo --out demo_out

test: $(VENV)/.installed
	cd tests && ../$(PY) -m pytest -q -ra .

bench: $(VENV)/.installed
	$(PY) -m headwise.bench mhar qkv merge dcmha --json bench_out.json --png bench_out.png

# Sanitizer run: a separate CPU-only build into build-asan/ (the installed package is
# untouched), imported from build-asan/pkg with libasan/libubsan preloaded into python.
# The whole suite but the gradcheck cases (~8 min on 2 cores): every op family's host code
# and emulated kernels, DCMHA's included. The build has no CUDA kernels, and no GPU is
# visible to the run, so the cuda-backend cases skip (tests whose names only mention CUDA
# still run). The profile library is not built under the sanitizers (its instrumentation
# clashes with theirs), so its tests skip.
SANITIZE_TESTS ?= .
sanitize: $(VENV)/.deps
	HEADWISE_SANITIZE=1 HEADWISE_FORCE_CUDA=0 $(PY) setup.py -q build_ext -b build-asan/lib -t build-asan/tmp
	rm -rf build-asan/pkg && mkdir -p build-asan/pkg && cp -r python/headwise build-asan/pkg/
	rm -f build-asan/pkg/headwise/*.so  # an in-place build's libraries, not sanitized
	cp build-asan/lib/headwise/*.so build-asan/pkg/headwise/
	cd tests && PYTHONPATH=../build-asan/pkg HEADWISE_FUZZ_EXAMPLES=5 CUDA_VISIBLE_DEVICES= \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ../$(PY) -m pytest -q -x -p no:cacheprovider -k "not gradcheck" $(SANITIZE_TESTS)

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
	rm -rf build build-asan $(VENV) python/headwise/*.so python/*.egg-info
