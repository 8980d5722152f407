PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned: this exact CPU wheel lies on the build machines' disk; an open range would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
# The lock (`make lock` rewrites it): every install here takes exactly these versions, the ones CI last tested.
LOCK := constraints.txt
# --no-compile: Python compiles a module when it is first imported; pip's compiling of all 14,000 modules of torch,
# transformers and the rest took ~40 s of CPU in every fresh install, most of them never imported.
PIP := $(BIN)/python -m pip install --no-compile --constraint $(LOCK)
# The repository root never goes first on sys.path (`python -m` and `python -c` put it there): its kernels/ would
# shadow Hugging Face's `kernels` package, which transformers imports. Every recipe and its children inherit this.
export PYTHONSAFEPATH := 1

.PHONY: install install-demo test lint demo lock proto clean

# The venv with pip and the CPU torch; then either the demo's extra or everything the tests need (a superset).
$(VENV)/.base: $(LOCK)
	@echo "make: creating $(VENV) with pip and the CPU build of torch (once; about a minute)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -q --upgrade pip
	$(PIP) -q $(TORCH)
	touch $@

$(VENV)/.demo: $(VENV)/.base pyproject.toml
	@echo "make: installing tether[demo] (the server on the CPU, the edge client) into $(VENV) (once)"
	$(PIP) -q --build-constraint $(LOCK) -e '.[demo]'
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	@echo "make: installing tether[test] (server, client and the test tools) into $(VENV) (once)"
	$(PIP) -q --build-constraint $(LOCK) -e '.[test]'
	touch $@ $(VENV)/.demo

install: $(VENV)/.test

install-demo: $(VENV)/.demo

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite runs in WORKERS processes (pytest-xdist), each test file whole in one of them (module fixtures are built
# once). Two workers on CI's two cores: the serial run took 27 min on a slower 2-core VM, near CI's 30-minute limit,
# and every test must pass with both cores busy anyway. A worker that crashes ends the run at once: xdist replacing it
# under loadfile once left the run waiting for ever on tests that no worker held. Files are taken in collection
# order, heavy ones first (tests/conftest.py), not xdist's most-tests-first, which left the longest single tests last.
WORKERS ?= 2

test: $(VENV)/.test lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0

demo: $(VENV)/.demo
	@echo "demo: the server, tether-netsim and two clients on this machine's CPU (torch loads in a few seconds)"
	$(BIN)/python bench/demo.py

# Refresh the lock on purpose: resolve pyproject.toml anew in a throwaway venv with a current pip, then review the
# diff and run `make test` before committing it.
lock:
	rm -rf $(VENV)-lock
	$(PY) -m venv $(VENV)-lock
	$(VENV)-lock/bin/python -m pip install -q --upgrade pip
	$(VENV)-lock/bin/python deploy/lock.py
	rm -rf $(VENV)-lock

# The generated code is committed; tests/test_proto.py checks it is fresh.
proto: $(VENV)/.test
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
		proto/tether/v1/tether.proto

clean:
	rm -rf $(VENV) $(VENV)-lock build *.egg-info
