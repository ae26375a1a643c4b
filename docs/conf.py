"""Sphinx configuration for paxkv's documentation site.

Built by ``make test`` (and ``make docs``) with warnings as errors:

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The guides are MyST Markdown; the API pages are generated from the docstrings by autodoc
(Google-style sections read by napoleon). Nothing is mocked: the ``docs`` extra is installed
beside the ``test``, ``oracle`` and ``eval`` extras, so every module imports as it does in the
tests (``pallas_kernels`` loads no Mosaic GPU until a kernel is called).
"""

from __future__ import annotations

import importlib
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the checkout's experiments/ and an uninstalled paxkv resolve too

project = "paxkv"
author = "the paxkv authors"
copyright = "2026, the paxkv authors"  # noqa: A001 (Sphinx's name)
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.autosummary",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
root_doc = "index"

# MyST: anchors for "#section" links within and across pages, and the ```{directive}``` forms.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: members in source order, signatures without the type noise (types go in the body).
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not a second description of a dataclass field
napoleon_use_rtype = False
add_module_names = False

# Unresolved cross-references (a name in a docstring that no page documents) stay plain text.
nitpicky = False

html_theme = "sphinx_book_theme"
html_title = "paxkv"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
pygments_style = "default"

# The top-level API page lists names in tables (autosummary) without generating stub pages:
# each entry links to where its module's page documents it.
autosummary_generate = False


# Docstrings document several names at once ("num_pages, free_pages: ..." under
# "Attributes:"). Napoleon writes that as ":ivar num_pages, free_pages:", which
# reStructuredText reads as a type "num_pages," and a name "free_pages" (and links that
# "type" to any attribute so named). A zero-width space instead of the space keeps the names
# one field name; once the fields are built (the comma then splits them into nodes of their
# own) the space comes back.
_GROUPED = re.compile(r"^(\s*:(?:param|ivar|var|cvar|keyword) )((?:[\w\\*]+, )+[\w\\*]+):")
_MARK = "\u200b"
_JOIN = "," + _MARK


def _grouped_names(app, what, name, obj, options, lines: list[str]) -> None:
    for i, line in enumerate(lines):
        found = _GROUPED.match(line)
        if found:
            lines[i] = found.group(1) + found.group(2).replace(", ", _JOIN) + line[found.end(2):]


def _spaces_back(app, doctree) -> None:
    from docutils import nodes  # noqa: PLC0415

    for text in list(doctree.findall(nodes.Text)):
        if _MARK in text:
            text.parent.replace(text, nodes.Text(text.replace(_MARK, " ")))


def _canonical(target: str) -> str | None:
    """The name under which autodoc documents ``target``: ``paxkv.Engine.update_params`` is
    ``paxkv.engine.engine.Engine.update_params`` (the top level and the packages re-export)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    else:
        return None
    path = obj.__name__
    for attr in parts[i:]:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            return None
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(obj, type(importlib)):
            path = obj.__name__
        elif isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
            path = f"{module}.{qualname}"
        else:
            path = f"{path}.{attr}"
    return path


def _reexported(app, env, node, contnode):
    """Resolves a reference to a re-exported name (``:class:`paxkv.Engine```) to the object's
    own page; anything else unresolved stays plain text (``nitpicky`` is off)."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith(("paxkv.", "pallas_kernels.")):
        return None
    canonical = _canonical(target)
    if canonical is None or canonical == target:
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                            canonical, node, contnode)


def setup(app):
    app.connect("autodoc-process-docstring", _grouped_names, priority=600)  # after napoleon
    app.connect("doctree-read", _spaces_back)
    app.connect("missing-reference", _reexported)
