"""Session fixtures shared by every test: the real model (``lm``) and its HF oracle (``hf``).

Both load once per session (the model cache in :func:`models.load` does the same across
sessions' imports), so tests can use them freely.
"""

from __future__ import annotations

import gc
import importlib.util
import os

import jax
import pytest

from paxkv import models
from paxkv.core import stored
import oracle


def pytest_configure(config: pytest.Config) -> None:
    """Float32 oracles need full-precision matmuls (TF32 on GPU would miss 1e-4), and the
    ``hf_greedy`` disk cache belongs under pytest's cache dir."""
    jax.config.update("jax_default_matmul_precision", "highest")
    config.pluginmanager.register(_LongFilesFirst(), "paxkv-long-files-first")
    cache = getattr(config, "cache", None)
    if cache is not None:
        oracle.set_cache_dir(cache.mkdir("paxkv_oracle"))
        _share_compiles(str(cache.mkdir("jax_compile")))


def _share_compiles(folder: str) -> None:
    """Points JAX's persistent compilation cache at pytest's cache dir (unless the caller chose
    one): the two xdist workers, and the subprocesses of the mesh tests, load the steps another
    process compiled instead of compiling them again, and a second local run skips most
    compiles. The key covers the HLO, the flags and the jax version, so a stale entry is never
    used."""
    folder = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", folder)
    # Exporting each step costs its first compile ~0.06-0.25 s more, and the suite compiles
    # thousands: only tests/test_stored.py stores steps (paxkv.core.stored).
    os.environ.setdefault(stored.ENV, "off")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks what ``make test-fast`` skips: every test that loads the default model
    (``model``), and every case of a parametrized test but its first (``grid``: the first
    case stands for the grid in the edit-test loop; ``make test`` runs them all)."""
    first: set[tuple[str, str]] = set()
    for item in items:
        if {"lm", "hf"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if getattr(item, "callspec", None) is not None:
            key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
            if key in first:
                item.add_marker(pytest.mark.grid)
            first.add(key)


class _LongFilesFirst:
    """Orders the selected tests file by file: files holding a ``slow`` test first, then by
    their number of tests, so that ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (the
    Makefile) starts the files holding long tests first. xdist's own order (most tests first)
    starts the default model's 126 s mesh test, its file's only selected test, late. Replaying
    12-04's per-file times through both orders gave 429 vs 402 s for the model pass; on fresh
    clones the model pass was unchanged and the rest pass 31 s faster (experiments/LOG.md,
    12-04)."""

    @pytest.hookimpl(trylast=True)  # after ``-m`` has deselected
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        files: dict[str, list] = {}
        for item in items:
            slow_count = files.setdefault(item.nodeid.split("::")[0], [False, 0])
            slow_count[0] |= item.get_closest_marker("slow") is not None
            slow_count[1] += 1
        rank = {f: (not slow, -n, i) for i, (f, (slow, n)) in enumerate(files.items())}
        items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


# Linux lets a process hold at most vm.max_map_count (65,530 here) memory mappings, and every
# compiled executable keeps a few (XLA:CPU's JIT code): 50 interpret-mode Pallas kernel tests
# add ~7,000. A pytest-xdist worker that ran half the suite segfaulted inside XLA's compile
# twice on 12-02 (a failed mmap); clearing JAX's caches frees them (3,529 -> 613 mappings).
MAX_MAPPINGS = 30_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _bounded_mappings():
    """After each test module, drops JAX's compiled executables if the process holds more than
    :data:`MAX_MAPPINGS` memory mappings (later modules then recompile what they need)."""
    yield
    if _mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def lm() -> models.LanguageModel:
    """The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, float32)."""
    return models.load()


@pytest.fixture(scope="session")
def hf() -> oracle.HF:
    """HF transformers' model + tokenizer from the same GGUF (float32); skipped without them."""
    missing = [m for m in ("torch", "transformers", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"HF oracle needs {', '.join(missing)}: pip install -e '.[oracle]' "
                    "(torch==2.13.0)")
    return oracle.load_hf()
