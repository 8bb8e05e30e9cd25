# Two entry points on a fresh clone:
#   make test   set up .venv (CPU torch, triton 3.6.0) and run the test suite under Triton's interpreter
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test

$(BIN)/.ready: requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

# attngen is installed non-editably, so the tests also prove that the data folders ship with it
test: $(BIN)/.ready
	$(BIN)/pip install -q --no-deps --force-reinstall .
	cd tests && ATTNGEN_TEST_INSTALLED=1 ../$(BIN)/pytest -q -p no:cacheprovider --rootdir=.. -c ../pyproject.toml $(PYTEST_ARGS)
