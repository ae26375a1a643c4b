"""The guides in ``docs/`` run as written: each page's Python blocks run in order in one
namespace (a page reads as one session), on the default model, then the page's own claims are
checked and every page of its engine must come back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # the guides load the default model

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


def _rl(ns: dict) -> None:
    """The RL guide: the sampler / trainer gap, an update that compiled nothing (checked in
    the page), an abort, a second turn per held completion."""
    assert ns["gap"] < 1e-4
    assert ns["swap"].version == 2
    assert all(len(ns["second"][i].token_ids) >= 1 for i in ns["ids"])


CHECKS = {"rl.md": _rl}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_python_block_of_a_guide_runs(page):
    namespace: dict = {}
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)):
        exec(compile(block, f"{page.name} block {i}", "exec"), namespace)  # noqa: S102
    CHECKS.get(page.name, lambda ns: None)(namespace)
    engine = namespace.get("engine")
    if engine is not None:  # whatever a guide ran, every page comes back
        for rid in [r.id for r in engine.table.requests.values() if r.hold]:
            engine.cancel(rid)
        engine.run()
        engine.clear_prefix_cache()
        assert int(engine.cache.free_pages()) == engine.cache.num_pages
