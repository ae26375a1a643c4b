"""The prefix cache's names for pages: a digest per full page, chained over everything before
it, with a tenant salt mixed into every link, so equal digests mean equal prefixes of the same
tenant::

    d_0 = sha256(root(salt) | salt | tokens[0:ps])        root(salt) = sha256("paxkv-root" | salt)
    d_i = sha256(d_(i-1)    | salt | tokens[i*ps:(i+1)*ps])

The device index (:mod:`paxkv.prefix.index`) and the host tier (:mod:`paxkv.prefix.host_tier`)
key pages by these digests, and a pin names them before the pages exist. Plain host Python.
"""

from __future__ import annotations

import array
import hashlib
from typing import Sequence


def salt_bytes(salt: str | bytes | None) -> bytes:
    """A tenant salt as bytes (None: the empty salt, a str: its UTF-8)."""
    if salt is None:
        return b""
    return salt.encode() if isinstance(salt, str) else bytes(salt)


def root_digest(salt: bytes) -> bytes:
    """The digest a salt's first pages chain from."""
    return hashlib.sha256(b"paxkv-root" + salt).digest()


def link(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of the page holding ``tokens`` after the page (or root) ``parent``."""
    h = hashlib.sha256(parent)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


def chain(tokens: Sequence[int], salt: str | bytes | None, page_size: int) -> list[bytes]:
    """The chained digests of every full page of ``tokens``."""
    salt, ps = salt_bytes(salt), page_size
    parent, out = root_digest(salt), []
    for i in range(len(tokens) // ps):
        parent = link(parent, salt, tokens[i * ps:(i + 1) * ps])
        out.append(parent)
    return out
