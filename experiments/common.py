"""What every experiment shares: its command line, a reproducible record (config, versions,
device, git SHA) written as JSON, a plain-text table, and every timing."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax

RESULTS_DIR = os.environ.get("PAXKV_RESULTS", "results")


# -- the command line ----------------------------------------------------------------------------
def parser(doc: str, quick: str | None = "small sizes: a smoke run") -> argparse.ArgumentParser:
    """An experiment's argument parser: the first paragraph of its docstring ``doc`` as the
    description and, unless ``quick`` is None, a ``--quick`` flag with that help."""
    ap = argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    return ap


def fill_defaults(args: argparse.Namespace, *, quick: Mapping[str, Any],
                  full: Mapping[str, Any]) -> argparse.Namespace:
    """Every field of ``quick`` (with ``--quick``) or ``full`` that the command line left
    unset (None) takes that value; returns ``args``."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def result_name(base: str, quick: bool = False, *variants: str) -> str:
    """``results/<name>.json``'s name: ``base``, ``_quick`` for a smoke run, then each
    non-empty variant (``decode_sweep_quick_bfloat16``)."""
    return "_".join([base, *(["quick"] if quick else []), *(v for v in variants if v)])


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict[str, Any]:
    """The time, the commit and the uncommitted source files as the run *starts* (``record``
    reads the SHA when the run ends; on a shared working tree the two can differ). Put it in
    the config: ``record(dict(vars(args), **provenance()), ...)``."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "paxkv", "models",
                                 "pallas_kernels", "experiments"], capture_output=True,
                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        status = ["unknown"]
    return dict(started=time.strftime("%Y-%m-%d %H:%M:%S"), git_sha_at_start=git_sha(),
                uncommitted_at_start=status)


def record(config: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """Results with the config, versions, device and git SHA that produced them (``time``:
    when the run ended)."""
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = "unknown"
    dev = jax.devices()[0]
    return dict(config=config, results=results, git_sha=git_sha(), jax=jax.__version__,
                jaxlib=jaxlib, python=platform.python_version(), device=str(dev),
                device_kind=dev.device_kind, backend=jax.default_backend(),
                machine=f"{platform.machine()}, {os.cpu_count()} cpus", cpu=cpu_model(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def cpu_model() -> str:
    """The host CPU's model and its widest vector extension, recorded with every figure: one
    experiment's paxkv seconds moved ~2x from one session's machine to the next (12-05), and
    XLA:CPU's code follows the vector extensions."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    wide = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    return f"{name} ({wide}{', avx512_bf16' if 'avx512_bf16' in flags else ''})"


def write_json(name: str, data: dict[str, Any], path: str | None = None) -> str:
    """``data`` as ``results/<name>.json`` (or at ``path``); returns the path."""
    path = path or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    print(f"\nwrote {path}")
    return path


def finish(name: str, data: dict[str, Any], ok: bool = True,
           failed: str = "a correctness check failed: no figure stands") -> str:
    """Writes the record, then exits non-zero if the run's own correctness check failed
    (``ok`` False): the JSON stays for a look, but no figure stands for a wrong answer."""
    path = write_json(name, data)
    if not ok:
        raise SystemExit(failed)
    return path


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A GitHub-markdown table, so the README can quote it verbatim."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


# -- timing: every repeated measurement goes through timed_rounds ------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of repeated calls of one function, each blocked until its result is ready.

    ``times_s`` and ``cpu_times_s`` (process CPU, which other tenants of a shared machine
    inflate far less than wall time) are the timed calls in order; ``warmup_s`` the untimed
    ones before them (the first compiles)."""

    median_s: float
    times_s: list[float]
    warmup_s: list[float]
    cpu_times_s: list[float]

    def ms(self) -> dict[str, Any]:
        """The JSON form, in milliseconds."""
        return dict(median_ms=1e3 * self.median_s, times_ms=[1e3 * t for t in self.times_s],
                    warmup_ms=[1e3 * t for t in self.warmup_s])


def clock(fn: Callable[..., Any], *args: Any) -> tuple[float, float, Any]:
    """One call ``fn(*args)``, blocked until its result is ready: (wall s, CPU s, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - wall, time.process_time() - cpu, out


def timed_rounds(fns: Mapping[Hashable, Callable[[], Any]], *, repeats: int,
                 warmup: int = 1) -> dict[Hashable, Timing]:
    """``warmup + repeats`` rounds, each calling every ``fns[name]()`` once in order (through
    :func:`clock`), so a shared machine's drift hits every function alike; the ``i``-th times
    of two functions are from the same round (pair them for a difference). A function that
    carries state (a donated cache) keeps it in its closure."""
    wall: dict[Hashable, list[float]] = {name: [] for name in fns}
    cpu: dict[Hashable, list[float]] = {name: [] for name in fns}
    for _ in range(warmup + repeats):
        for name, fn in fns.items():
            w, c, _ = clock(fn)
            wall[name].append(w)
            cpu[name].append(c)
    return {name: Timing(median_s=statistics.median(wall[name][warmup:]),
                         times_s=wall[name][warmup:], warmup_s=wall[name][:warmup],
                         cpu_times_s=cpu[name][warmup:]) for name in fns}


def timed(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> Timing:
    """``fn()`` called ``warmup`` times untimed, then ``repeats`` times timed, each call
    blocked until its result is ready: the median and every time (see :class:`Timing`)."""
    return timed_rounds({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished child processes."""
    import resource

    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Stopwatch:
    """Wall and CPU (:func:`cpu_seconds`) time since it was made: a whole run's cost."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()

    def elapsed(self) -> dict[str, float]:
        """``wall_s`` and ``cpu_s`` so far (the record's keys)."""
        return dict(wall_s=time.perf_counter() - self.wall, cpu_s=cpu_seconds() - self.cpu)


# -- text to run on: CPython's own prose, available offline ------------------------------------
def prose_tokens(lm: Any, n: int) -> list[int]:
    """The first ``n`` tokens of CPython's ``pydoc_data.topics`` (the Language Reference text
    behind ``help()``), each topic's text in sorted order, stripped, followed by a blank line,
    tokenized by ``lm`` one topic at a time."""
    from pydoc_data.topics import topics

    stream: list[int] = []
    for name in sorted(topics):
        if len(stream) >= n:
            break
        stream += lm.encode(topics[name].strip() + "\n\n")
    if len(stream) < n:
        raise ValueError(f"pydoc topics give {len(stream)} tokens, {n} needed")
    return stream[:n]


# -- shared by experiments that run a workload in subprocesses (offline.py, sharing.py) ---------
def english_prompts(lm: Any, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` consecutive, non-overlapping windows of ``lo..hi`` tokens (lengths seeded) cut from
    real English prose available offline: CPython's ``pydoc_data.topics`` (the Language
    Reference text behind ``help()``), topics in sorted order, tokenized by ``lm``."""
    import numpy as np

    lengths = np.random.default_rng(seed).integers(lo, hi + 1, n)
    stream = prose_tokens(lm, int(lengths.sum()))
    ends = np.cumsum(lengths)
    return [stream[e - k: e] for e, k in zip(ends, lengths)]


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark: ``VmHWM`` of ``/proc/self/status`` where
    Linux has it (the high-water mark of this process's own memory map), else ``getrusage``.

    NOTE: ``getrusage``'s ``ru_maxrss`` survives ``exec``: a worker started by a parent that
    once held 7.6 GB (the decode sweep) reported 7.6 GB whatever it used itself."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Restarts the RSS high-water mark at the current RSS (Linux ``clear_refs`` 5), so
    :func:`peak_rss_mib` measures one phase; False where the kernel refuses."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_worker(module: str, job: dict[str, Any]) -> dict[str, Any]:
    """Runs ``python -m module --worker JOB OUT`` in a fresh interpreter (so its RSS high-water
    mark is its own): ``job`` goes in as JSON, the worker's JSON comes back, with the worker's
    wall and CPU (user + system) seconds added as ``worker_wall_s`` / ``worker_cpu_s``."""
    import resource
    import sys
    import tempfile

    def cpu() -> float:
        use = resource.getrusage(resource.RUSAGE_CHILDREN)
        return use.ru_utime + use.ru_stime

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(job, f)
        wall, used = time.perf_counter(), cpu()
        subprocess.run([sys.executable, "-m", module, "--worker", src, dst], check=True)
        with open(dst) as f:
            out = json.load(f)
    return dict(out, worker_wall_s=time.perf_counter() - wall, worker_cpu_s=cpu() - used)


def hf_generate(model: Any, pad: int, prompts: Sequence[Sequence[int]], max_new: int
                ) -> list[list[int]]:
    """One left-padded greedy HF ``generate`` of exactly ``max_new`` tokens per prompt, EOS
    switched off (as ``tests/oracle.py`` does; this sets the model's own EOS to None)."""
    import torch
    import transformers

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(list(p)), 1
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new,
                                           pad_token_id=pad, eos_token_id=None)
    model.generation_config.eos_token_id = None  # else generate() fills it back in
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    new = out[:, width:].tolist()
    if any(len(r) != max_new for r in new):
        raise RuntimeError(f"HF stopped early: {[len(r) for r in new]} tokens")
    return new


def token_agreement(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]],
                    prefix: int) -> dict[str, Any]:
    """How far each of our token sequences matches the reference: first divergence per
    sequence (its length if none), the share identical throughout and over the first
    ``prefix`` tokens."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
             for x, y in zip(ours, ref)]
    n, width = len(ref), len(ref[0])
    prefix = min(prefix, width)
    return dict(first_divergence=first, identical=sum(f == width for f in first) / n,
                prefix=prefix, prefix_identical=sum(f >= prefix for f in first) / n,
                first_divergence_min=min(first),
                first_divergence_median=statistics.median(first))
