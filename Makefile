# Entry points on a fresh clone:
#   make tune     set up .venv and tune the dense and causal kernels on this machine's GPU (the main job);
#                 without a GPU it runs the same pipeline under Triton's interpreter on tiny shapes
#   make test     set up .venv (CPU torch 2.13.0, triton 3.6.0) and run the test suite under the interpreter
#   make package  build the sdist and the wheel into dist/ and smoke-test each in a fresh venv
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TUNE_ARGS ?=

.PHONY: test tune package

$(BIN)/.ready: requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

# attngen is installed non-editably, so the tests also prove that the data folders ship with it; the
# tests run on TEST_JOBS processes (pytest-xdist) and the slowest are listed at the end
TEST_JOBS ?= 2
test: $(BIN)/.ready
	$(BIN)/pip install -q --no-deps --force-reinstall .
	cd tests && ATTNGEN_TEST_INSTALLED=1 ../$(BIN)/pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
		-n $(TEST_JOBS) --durations=15 $(PYTEST_ARGS)

tune: $(BIN)/.ready
	$(BIN)/pip install -q --no-deps --force-reinstall .
	@if $(BIN)/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then interp=; \
	else interp=--interpret; echo "make tune: no CUDA device, so the pipeline runs under Triton's interpreter"; fi; \
	for mask in none causal; do $(BIN)/attngen tune $$interp --mask $$mask $(TUNE_ARGS) || exit 1; done

# `python -m build` makes dist/attngen-VERSION.tar.gz and the wheel (built from the sdist, so the sdist
# is complete). A fresh venv gets the wheel with its dependencies (at the versions requirements-test.txt
# pins), then the sdist in its place; tests/smoke_installed.py checks each, run outside the source tree.
package: $(BIN)/.ready
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	@set -e; venv=$$(mktemp -d); trap 'rm -rf "$$venv"' EXIT; \
	smoke() { (cd "$$venv" && bin/python "$(CURDIR)/tests/smoke_installed.py" "$$1"); }; \
	$(PYTHON) -m venv "$$venv"; \
	echo "make package: installing the wheel and its dependencies into a fresh venv"; \
	"$$venv/bin/pip" install -q --no-compile -c requirements-test.txt dist/attngen-*.whl; \
	smoke dist/attngen-*.whl; \
	"$$venv/bin/pip" install -q --no-compile --no-deps --force-reinstall dist/attngen-*.tar.gz; \
	smoke dist/attngen-*.tar.gz
