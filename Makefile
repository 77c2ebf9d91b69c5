# pykvq: the two commands are `make demo` and `make test`.
#
#   make demo   venv + deps, fetch/patch/build llama.cpp, fetch SmolLM2; answers with f16 and pykvq's cache, size + KLD table vs stock q4_0
#   make test   the same set-up and build-asan/ (the hostile-file driver with ASan + UBSan), then pytest
#   make soak   the same set-up (and build-asan/: libllama + the hostile-file driver with ASan + UBSan), then the long fuzz and soak runs (tests marked soak; PYKVQ_SOAK=1)
#   make gpu-check  on a machine with an NVIDIA GPU: build with CUDA, run every GPU check and benchmark
#   make gpu-prebuild  here, no GPU needed: the CUDA binaries and model parts packed for a lent offline GPU machine
#   make results  the same set-up, then the evaluation/benchmark suite -> docs/RESULTS.md (RESULTS_ARGS="--models smollm2-135m,qwen2.5-coder-1.5b")
#
# Options: CMAKE_ARGS="-DPYKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"  JOBS=16  PYTEST_ARGS="-k kld"
PY      ?= python3
VENV    ?= .venv
BUILD   ?= build
JOBS    ?= $(shell nproc)
VPY     := $(VENV)/bin/python

# ccache: hash paths relative to the checkout so fresh clones hit the cache
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1

.PHONY: demo test soak results gpu-check gpu-prebuild setup fetch build build-asan clean distclean

demo: setup build
	$(VPY) -m pykvq demo

test: setup build build-asan
	$(VPY) -m pytest $(PYTEST_ARGS)

soak: setup build build-asan
	PYKVQ_SOAK=1 $(VPY) -m pytest -m soak $(PYTEST_ARGS)

results: setup build
	$(VPY) -m pykvq results $(RESULTS_ARGS)

# Every GPU check and benchmark (scripts/gpu_check.py): CUDA build in build-cuda/, test-backend-ops
# for the pykvq types, no CPU fallback, generation, KLD GPU = CPU, llama-bench ratios. GPU_ARGS="--steps ops"
gpu-check: fetch
	$(if $(wildcard $(VPY)),$(VPY),$(PY)) scripts/gpu_check.py $(GPU_ARGS)

# The CUDA build made here (nvcc; cuBLAS from its pinned wheel, a link-time driver stub) and packed with the model
# into .gpu1/, .gpu2/, ... (one 64 MiB carry each) for scripts/gpu_bare.sh on a lent GPU machine (saves its ~400 s build)
gpu-prebuild: setup fetch
	bash scripts/gpu_prebuild.sh

setup: $(VENV)/.pykvq-setup

fetch:
	$(PY) third_party/fetch.py

# torch first, by exact version: pip then takes the local CPU wheel rather than a CUDA build.
$(VENV)/.pykvq-setup: pyproject.toml third_party/llama.cpp.pin | fetch
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(VPY) -m pip install --quiet --disable-pip-version-check -e '.[convert,test]' ./third_party/llama.cpp/gguf-py
	# llama-cpp-python's Python layer only (the same pinned sdist; it loads pykvq's build/bin/libllama.so)
	CMAKE_ARGS=-DLLAMA_BUILD=OFF $(VPY) -m pip install --quiet --disable-pip-version-check \
		"$$($(PY) third_party/fetch.py --print-sdist)"
	touch $@

build: fetch
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# The hostile-file fuzz driver with AddressSanitizer + UBSan (libllama, ggml and the driver), for tests/test_hostile_files.py
ASAN_BUILD ?= build-asan
build-asan: fetch
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Release -DPYKVQ_SANITIZE=ON $(CMAKE_ARGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target kvq-gguf-fuzz

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)

distclean: clean
	rm -rf $(VENV) third_party/llama.cpp third_party/.cache
