# Quick start: `make demo` (server, netsim and client on this machine, two network drops), `make test` (as CI runs it).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned: this exact CPU wheel lies on the build machines' disk; an open range would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test lint demo proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite runs in WORKERS processes (pytest-xdist), each test file whole in one of them (module fixtures are built
# once). Two workers on CI's two cores: the serial run took 27 min on a slower 2-core VM, near CI's 30-minute limit,
# and every test must pass with both cores busy anyway.
WORKERS ?= 2

test: $(STAMP) lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

# The generated code is committed; tests/test_proto.py checks it is fresh.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
		proto/tether/v1/tether.proto

demo: $(STAMP)
	$(BIN)/python -m tether.server.demo

clean:
	rm -rf $(VENV) build *.egg-info
