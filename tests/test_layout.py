"""The layout is the architecture: one-way imports between the parts, no cycle between files,
small folders and modules, and a public API that does not move.

The imports are read from the source (``ast``), every ``import`` counted wherever it stands
(inside functions and ``TYPE_CHECKING`` blocks too: a cycle a type checker sees is a cycle a
reader sees)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A part may import the parts of lower layers only; parts in one layer are
# independent of each other. ``paxkv.models`` stands beside the caches: it speaks the core's
# protocol and imports nothing else of paxkv. The package's own ``__init__`` (the public API)
# may import any part but the harness. ``paxkv.rl`` (RL rollouts and the trainer's
# log-probabilities) stands above the front ends and must not import the model: a model reaches
# it through the protocol only.
LAYERS: list[tuple[str, ...]] = [
    ("pallas_kernels",),
    ("core",),
    ("table", "attention", "models"),
    ("cache",),
    ("scale",),
    ("prefix",),
    ("engine",),
    ("decoding", "scoring"),
    ("rl",),
    ("harness",),
]
ONLY = {"models": {"core"}}  # parts held tighter than their layer
NEVER = {"rl": {"models"}}  # lower parts a part must not import all the same
LEVEL = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for the library (``models/`` installs as ``paxkv.models``)."""
    found = {}
    for top, prefix in (("paxkv", "paxkv"), ("pallas_kernels", "pallas_kernels"),
                        ("models", "paxkv.models")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The library modules ``name`` imports (a ``from pkg import sub`` names ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(name: str) -> str:
    """``paxkv.engine.scheduler`` -> ``engine``; ``pallas_kernels.*`` -> ``pallas_kernels``;
    ``paxkv`` (the public API) -> ``api``."""
    if name.startswith("pallas_kernels"):
        return "pallas_kernels"
    bits = name.split(".")
    return bits[1] if len(bits) > 1 else "api"


def test_every_module_belongs_to_a_layered_part():
    unplaced = sorted(n for n in MODULES if _part(n) not in LEVEL and _part(n) != "api")
    assert not unplaced, f"modules outside every part (add a part to LAYERS): {unplaced}"


def test_parts_import_only_lower_layers():
    wrong = []
    for name, deps in GRAPH.items():
        part = _part(name)
        for dep in deps:
            other = _part(dep)
            if part == other:
                continue
            if part == "api":
                ok = other != "harness"
            elif part in ONLY:
                ok = other in ONLY[part]
            else:
                ok = (other != "api" and LEVEL[other] < LEVEL[part]
                      and other not in NEVER.get(part, ()))
            if not ok:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_between_files():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_kernels_and_their_references_stand_alone():
    """The kernels import nothing of paxkv (the library imports them, one way), and their jnp
    references import nothing but the storage format: an oracle independent of what it
    checks."""
    into_paxkv = sorted(f"{n} -> {d}" for n, deps in GRAPH.items() if n.startswith("pallas_")
                        for d in deps if d.startswith("paxkv"))
    assert not into_paxkv
    assert GRAPH["pallas_kernels.reference"] <= {"pallas_kernels.kv_storage"}


def test_folders_and_modules_stay_small():
    folders: dict[Path, int] = {}
    for path in MODULES.values():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    big = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > 12}
    assert not big, f"folders over 12 modules: {big}"
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > 310}
    assert not long, f"modules over ~300 lines: {long}"


PUBLIC = [
    "AttentionPlan", "Beam", "DenseCache", "Engine", "EngineStats", "GenerationResult",
    "KVCache", "KVPool", "Model", "PageTable", "PagedCache", "PoolUpdate", "PrefixIndex",
    "SamplingParams", "ScoreResult", "Scorer", "SequenceStats", "SharingStats", "StepInfo",
    "StepOutput", "TableStats", "beam_search", "dense_cache", "generate", "page_table",
    "paged_cache", "policy", "pool", "prefix_cache", "score", "score_rolling", "steps",
]


def test_public_names_are_pinned():
    import paxkv
    assert sorted(paxkv.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(paxkv, name) is not None
    assert callable(paxkv.generate) and callable(paxkv.beam_search) and callable(paxkv.score)
    assert paxkv.paged_cache.create and paxkv.page_table.reserve and paxkv.steps.decode_step


def test_every_import_the_docs_show_resolves():
    """``from paxkv import X`` / ``from paxkv.a import X`` / ``import paxkv.a`` / ``python -m
    paxkv.a`` in the README and the pages of ``docs/``, as a reader would type them."""
    pages = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                          if "_build" not in p.relative_to(ROOT / "docs").parts)
    text = "\n".join(p.read_text() for p in pages)
    shown = set()
    for module, names in re.findall(r"from (paxkv[\w.]*) import ([\w, ]+)", text):
        shown |= {(module, n.strip().split(" as ")[0]) for n in names.split(",") if n.strip()}
    modules = set(re.findall(r"(?:import|python -m) (paxkv[\w.]*)", text))
    assert shown and modules
    for module, name in sorted(shown):
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"
    for module in sorted(modules):
        if module != "paxkv.harness":  # needs the eval extra; tests/test_harness.py imports it
            importlib.import_module(module)


@pytest.mark.parametrize("part", sorted({p for layer in LAYERS for p in layer} - {"pallas_kernels"}))
def test_every_part_says_what_it_may_import(part):
    init = ROOT / ("models" if part == "models" else f"paxkv/{part}") / "__init__.py"
    doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
    assert "May import" in doc and "Must not" in doc, init
