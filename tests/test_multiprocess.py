"""The sharded cache across processes (:mod:`paxkv.scale.distributed`, :mod:`paxkv.scale.launch`).

``experiments/multiprocess.py``'s decode loop and its Engine run on the tiny random Llama
run twice in subprocesses, one after the other: as 2 processes x 4 forced CPU devices
through the launcher (a free local port, gloo collectives) and as one process with 8
devices. Checked: equal greedy tokens (varied, every row's reserve ok); each process fed only
its own rows and held only its own data shards of the pool and page table
(``addressable_shards``); every shard's pool is free after the release. The Engine (arrivals
between steps, a cancel, prefix hits, preemption) gives the same tokens, counters and free
pages either way. Each run has a deadline, so a stuck worker (gloo waits for a dead
peer) fails the test instead of hanging it. The launcher itself: a process that fails stops
the others and names itself; the deadline stops them all; it runs from any directory (the
current one and the checkout on the children's path). The mesh guide's "Several processes"
program (``docs/mesh.md``) runs as written (on the tiny model) through the launcher.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from paxkv.scale import launch

# Forced CPU devices in subprocesses: `make test` runs these, `make test-fast` not.
pytestmark = pytest.mark.devices

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEADLINE_S = 150  # one run; each takes ~10-20 s on two shared cores
# The suite's persistent compile cache (conftest) off for the two processes: one loading a
# cached step while the other compiles it would reach gloo's collectives far apart (30 s limit).
NO_SHARED_COMPILES = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def _loop(tmp: pathlib.Path, name: str, prefix: list[str], env: dict[str, str]) -> dict:
    """``experiments.multiprocess --quick`` under ``prefix``: its results (process 0's)."""
    out = tmp / f"{name}.json"
    proc = subprocess.run([*prefix, "experiments.multiprocess", "--quick", "--out", str(out)],
                          cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=DEADLINE_S + 30)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())["results"]


def test_two_processes_give_one_process_tokens(tmp_path):
    py = [sys.executable]
    start = time.perf_counter()
    two = _loop(tmp_path, "two", [*py, "-m", "paxkv.scale.launch", "--processes", "2", "--devices",
                                  "4", "--timeout", str(DEADLINE_S), "--"], NO_SHARED_COMPILES)
    one = _loop(tmp_path, "one", [*py, "-m"], dict(JAX_NUM_CPU_DEVICES="8",
                                                   JAX_PLATFORMS="cpu"))
    print(f"both runs: {time.perf_counter() - start:.1f} s")
    assert (two["processes"], two["devices"], one["processes"], one["devices"]) == (2, 8, 1, 8)
    assert two["tokens"] == one["tokens"]
    assert len({tuple(t) for t in one["tokens"]}) == one["max_seqs"], "tokens should vary"
    assert all(two["ok"]) and all(one["ok"])
    assert two["rows"] == [list(range(8)), list(range(8, 16))]  # 2 rows a shard
    assert two["local_tokens"] == [one["tokens"][:8], one["tokens"][8:]]
    assert two["held_pool"] == two["held_table"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert one["held_pool"] == [list(range(8))]
    for run in (one, two):
        assert run["free_pages"] == [run["pages_per_shard"]] * 8
    # the Engine on the same mesh, every process making the same calls
    e1, e2 = one["engine"], two["engine"]
    assert e2["tokens"] == e1["tokens"] and e2["cancelled"] == e1["cancelled"]
    assert all(t for i, t in enumerate(e1["tokens"]) if i != e1["cancelled"])
    assert e2["preemptions"] == e1["preemptions"] >= 1, "a shard should run out of pages"
    assert e2["prefix_hit_tokens"] == e1["prefix_hit_tokens"] > 0
    assert e2["free_pages"] == e2["num_pages"] and e1["free_pages"] == e1["num_pages"]
    assert e2["held_pool"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# Each worker says who it is, then marks itself started; the one told to fail waits until all
# have (a loaded machine may start the last worker after the failure would have stopped it).
SCRIPT = """
import os, pathlib, sys, time
pid, count = int(os.environ["PAXKV_PROCESS_ID"]), int(os.environ["PAXKV_NUM_PROCESSES"])
env, marks = os.environ, pathlib.Path(sys.argv[2])
print("process", pid, "of", count, "at", env["PAXKV_COORDINATOR"],
      "devices", env.get("JAX_NUM_CPU_DEVICES"), flush=True)
(marks / str(pid)).touch()
if pid == int(sys.argv[1]):
    deadline = time.monotonic() + 20
    while len(list(marks.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
time.sleep(120)
"""


def test_launcher_stops_the_others_when_one_fails_or_time_runs_out(tmp_path, capsys):
    script, marks = tmp_path / "worker.py", tmp_path / "started"
    script.write_text(SCRIPT)
    marks.mkdir()
    out = io.StringIO()
    start = time.perf_counter()
    code = launch.launch([str(script), "1", str(marks)], processes=3, devices=2, timeout=60,
                         out=out)
    assert code == 3 and time.perf_counter() - start < 30
    assert "paxkv.scale.launch: process 1 failed (exit 3)" in capsys.readouterr().err
    lines = sorted(x for x in out.getvalue().splitlines() if "process" in x)
    assert [x.split(" at ")[0] for x in lines] == [f"[p{i}] process {i} of 3" for i in range(3)]
    assert all(x.endswith("devices 2") for x in lines)

    start = time.perf_counter()
    code = launch.launch([str(script), "-1", str(marks)], processes=2, timeout=2,
                         out=io.StringIO())
    assert code == 124 and time.perf_counter() - start < 2 + launch.GRACE_S + 5
    assert "deadline of 2 s passed; still running: [0, 1]" in capsys.readouterr().err


def test_the_launcher_runs_from_any_directory(tmp_path, monkeypatch):
    """From a folder outside the checkout: a script elsewhere imports a module of the current
    directory (as ``python -m`` would), and ``experiments.*`` resolves (the checkout is on the
    children's path); ``experiments.multiprocess`` writes under the current directory."""
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir()
    scripts.mkdir()
    (work / "here.py").write_text("WHERE = 'cwd'\n")
    (scripts / "probe.py").write_text(
        "import here, experiments\nprint('probe', here.WHERE, experiments.__file__)\n")
    monkeypatch.chdir(work)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("PAXKV_RESULTS", raising=False)
    out = io.StringIO()
    assert launch.launch([str(scripts / "probe.py")], processes=1, timeout=60, out=out) == 0
    assert f"[p0] probe cwd {ROOT / 'experiments' / '__init__.py'}" in out.getvalue()
    out = io.StringIO()
    assert launch.launch(["experiments.multiprocess", "--help"], processes=1, timeout=60,
                         out=out) == 0, out.getvalue()
    assert "--out" in out.getvalue()

    from experiments import multiprocess  # noqa: PLC0415

    args = argparse.Namespace(quick=True, out=None)
    assert multiprocess.output_path(args) == str(work / "results" / "multiprocess_quick.json")


# The "Several processes" program of docs/mesh.md, run as written but on the tiny model.
DOCS_PROGRAM = """
import sys
sys.path.insert(0, {tests!r})
from tiny import tiny_lm
from paxkv import models
models.load = lambda *args, **kwargs: tiny_lm(scale=1.0)  # the only change: no 135M load
exec(compile({block!r}, "docs/mesh.md", "exec"), {{"__name__": "__main__"}})
"""


def test_the_docs_several_processes_program_runs_as_written(tmp_path, monkeypatch):
    """The guide's block is a whole program: 2 processes x 2 devices, from a folder outside
    the checkout, every row's 8 tokens printed by process 0, every reserve ok
    (``tests/test_docs.py`` skips it: it needs devices and processes of its own)."""
    text = (ROOT / "docs" / "mesh.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if b.startswith("# several processes")]
    assert len(blocks) == 1, f"{len(blocks)} blocks of docs/mesh.md start '# several processes'"
    script = tmp_path / "loop.py"
    script.write_text(DOCS_PROGRAM.format(tests=str(ROOT / "tests"), block=blocks[0]))
    monkeypatch.chdir(tmp_path)
    for key, value in NO_SHARED_COMPILES.items():
        monkeypatch.setenv(key, value)
    out = io.StringIO()
    code = launch.launch([str(script)], processes=2, devices=2, timeout=DEADLINE_S, out=out)
    assert code == 0, out.getvalue()[-4000:]
    rows = [x.split(" ", 3) for x in out.getvalue().splitlines() if x.startswith("[p0] ")]
    # a row's line is "<row> <ok> <repr>": Gloo's C++ threads interleave their log lines, and
    # "[Gloo] Rank [Gloo] Rank 0 is connected ..." once left a line "1 is connected to 3 peer
    # ranks ..." that a looser match took for row 1 (12-05)
    rows = [r for r in rows if len(r) == 4 and r[1].isdigit() and r[2] in ("True", "False")]
    assert [int(r[1]) for r in rows] == list(range(8)), out.getvalue()[-6000:]  # 4 shards x 2
    assert all(r[2] == "True" for r in rows)
