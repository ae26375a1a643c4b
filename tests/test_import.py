"""What a CPU process loads: ``import paxkv`` and a request through the engine on the XLA path
load no kernel module (Pallas and Mosaic GPU cost 0.3-0.6 s of every process's start); the
kernels load when a cache uses them, and :mod:`pallas_kernels`' names still resolve.

Each check runs in a fresh interpreter: this one has long since loaded the kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ("jax.experimental.mosaic", "jax.experimental.pallas", "jax._src.pallas")


def _loaded(code: str) -> list[str]:
    """The kernel modules a fresh CPU interpreter holds after ``code``."""
    probe = (f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules "
             f"if m.startswith({KERNEL_MODULES!r}))))")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_the_storage_format_load_no_kernel():
    assert _loaded("import paxkv\nfrom pallas_kernels import quant, kv_storage") == []


def test_a_request_through_the_engine_on_cpu_loads_no_kernel():
    """"auto" picks the XLA path on a CPU: a whole request runs without the kernels. The
    model's flax loads a few of Pallas' own modules through ``jax.extend`` (its core and the
    interpreters' parameters, no lowering): the engine adds none to them."""
    code = ("import paxkv\nfrom tiny import tiny_lm\n"
            "e = paxkv.Engine(tiny_lm(), max_seqs=2, max_len=32, page_size=4)\n"
            "rid = e.submit([1, 2, 3, 4, 5], max_new_tokens=3, stop_token_ids=[])\n"
            "assert len(e.run()[rid].token_ids) == 3")
    loaded, by_flax = _loaded(code), _loaded("import flax.linen")
    assert not [m for m in loaded if m.startswith("jax.experimental")], loaded
    assert set(loaded) <= set(by_flax), sorted(set(loaded) - set(by_flax))


def test_a_kernel_loads_on_first_use():
    loaded = _loaded("import pallas_kernels\n"
                     "assert callable(pallas_kernels.paged_decode_attention)\n"
                     "assert 'write_kv' in dir(pallas_kernels)")
    assert "jax.experimental.pallas" in loaded
    got = _loaded("import pallas_kernels\ntry:\n    pallas_kernels.nope\n"
                  "except AttributeError as e:\n    assert 'nope' in str(e)\n"
                  "else:\n    raise SystemExit('no AttributeError')")
    assert got == []
