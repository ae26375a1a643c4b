"""What every experiment shares: a reproducible record, a JSON file, a plain-text table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import jax

RESULTS_DIR = os.environ.get("PAXKV_RESULTS", "results")


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(config: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """Results with the config, versions, device and git SHA that produced them."""
    return dict(config=config, results=results, git_sha=git_sha(), jax=jax.__version__,
                device=str(jax.devices()[0]), backend=jax.default_backend(),
                machine=f"{platform.machine()}, {os.cpu_count()} cpus",
                time=time.strftime("%Y-%m-%d %H:%M:%S"))


def write_json(name: str, data: dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    print(f"\nwrote {path}")
    return path


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A GitHub-markdown table, so the README can quote it verbatim."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def median_time(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
