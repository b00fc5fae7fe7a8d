# Two commands do all set-up on a fresh machine:  make demo  /  make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint bytecode bench install clean

# (Re)install only when pyproject.toml changed: a second `make test` starts at once.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dmlrc demo

# Every test, slow integration tests (Ray, MLflow server, S3) included.  Two pytest workers (pytest-xdist), one test
# file each at a time (a module's cluster or sweep fixture is built once), in collection order: tests/conftest.py
# puts the longest modules first.
test: lint bytecode
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Unit tests only (no Ray, no servers): the inner loop.  Two pytest-xdist workers, tests handed out one by one.
test-fast: lint bytecode
	$(PY) -m pytest -q -m "not slow" -n 2

# ruff: lint and format, settings in pyproject.toml (`ruff format .` and `ruff check --fix .` repair most findings);
# mypy: the types of the library and the orchestration ([tool.mypy] in pyproject.toml: dml_core and pipelines, with
# pydantic's plugin; 0 errors).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The project's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (CI images often set it) every one of the
# suite's hundreds of processes (sweep drivers, Ray workers) would otherwise compile these sources again on import.
bytecode: $(STAMP)
	$(PY) -m compileall -q dml_core pipelines tune_spaces tests > /dev/null

bench: $(STAMP)
	$(PY) bench/metrics_bench.py
	$(PY) bench/losses_bench.py

clean:
	rm -rf $(VENV) runs .pytest_cache
