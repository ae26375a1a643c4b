"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_jitted_loop_runs_and_frees_every_page():
    namespace: dict = {}
    exec(compile(_python_blocks()[0], "README.md", "exec"), namespace)  # noqa: S102
    cache, ok = namespace["cache"], namespace["ok"]
    assert bool(jnp.all(ok))
    assert int(jnp.sum(cache.table.ref_counts)) == 0
    assert not bool(jnp.any(cache.active))


def test_readme_generate_example_runs():
    namespace: dict = {}
    exec(compile(_python_blocks()[1], "README.md", "exec"), namespace)  # noqa: S102
    out = namespace["out"]
    assert len(out) == 2 and all(len(r.token_ids) >= 1 for r in out)


def test_readme_sharing_example_runs():
    namespace: dict = {}
    exec(compile(_python_blocks()[2], "README.md", "exec"), namespace)  # noqa: S102
    outs, beams = namespace["outs"], namespace["beams"]
    assert [len(o.samples) for o in outs] == [2, 2]
    assert outs[1].num_cached_tokens > 0  # the second prompt found the system prompt cached
    scores = [b.score for b in beams[0]]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
