"""The README's example runs as written (the guides' examples run in ``tests/test_docs.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # the example loads the default model

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(snippet: str) -> str:
    """The one Python block of the README that contains ``snippet``."""
    found = [b for b in _python_blocks() if snippet in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {snippet!r}"
    return found[0]


def _run(block: str) -> dict:
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    return namespace


def test_readme_generate_example_runs():
    namespace = _run(_block('paxkv.generate(lm, ["Hello"'))
    out = namespace["out"]
    assert len(out) == 2 and all(len(r.token_ids) >= 1 for r in out)
