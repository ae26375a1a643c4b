"""Pictures from the experiments' JSON (a separate step: no model, no JAX).

    python -m experiments.plots            # results/capacity.json, results/cancel.json
    python -m experiments.plots --quick    # the *_quick.json records
    python -m experiments.plots --out experiments/figures   # the README's copies

Every figure's title names the run it comes from: its command, date and git SHA, read from
the record (:func:`stamp`). Writes PNGs next to the JSON (``results/``, or ``--out``):

* ``capacity[_quick]_concurrency.png``: running and queued sequences over time, per system;
* ``capacity[_quick]_waste.png``: reserved-but-unfilled KV over time, split into internal
  fragmentation, room held for future tokens, and external fragmentation;
* ``capacity[_quick]_page_map.png``: the pool at each system's peak, one cell per page
  (``page_size`` slots): colour = owning sequence, shade = how full, ``x`` = shared, white = free;
* ``cancel[_quick]_page_map.png``: the forked pool of ``experiments.cancel`` part 3 (shared
  prefix pages, copy-on-write copies, pages held by the prefix index).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import RESULTS_DIR  # noqa: E402

COLORS = {"paged": "tab:blue", "dense_max_len": "tab:red", "dense_exact": "tab:green"}
# Strong, distinct colours only (paired palettes such as tab20 read as "pale = empty").
PALETTE = np.array([matplotlib.colors.to_rgb(c) for c in
                    list(plt.get_cmap("tab10").colors) + list(plt.get_cmap("Dark2").colors)[:6]])
LABELS = {"paged": "paged", "dense_max_len": "dense at max_len",
          "dense_exact": "dense at exact length (oracle)"}


def _systems(res: dict[str, Any]) -> list[str]:
    return [s for s in ("paged", "dense_max_len", "dense_exact") if s in res]


def stamp(rec: dict[str, Any], experiment: str) -> str:
    """The run behind a record, for a figure's title: ``python -m experiments.capacity, run
    2026-12-04 20:43-20:51, git 961b5c9`` (from ``provenance``'s start time and commit where
    the record has them, else ``ended`` at ``record``'s time; ``+ uncommitted changes`` when
    source files differed from that commit at the start; ``(<sha> at the end)`` when a commit
    landed during the run)."""
    cfg = rec.get("config", {})
    command = f"python -m experiments.{experiment}" + (" --quick" if cfg.get("quick") else "")
    began, ended = cfg.get("started"), rec.get("time")
    if began and ended:
        when = f"run {began[:16]}-{ended[11:16]}" if began[:10] == ended[:10] else \
            f"run {began[:16]} to {ended[:16]}"
    else:
        when = f"run ended {ended[:16]}" if ended else "run date not recorded"
    start, end = cfg.get("git_sha_at_start"), rec.get("git_sha")
    sha = f"git {start or end or 'not recorded'}"
    if cfg.get("uncommitted_at_start"):
        sha += " + uncommitted changes"
    if start and end and start != end:
        sha += f" ({end} at the end)"
    return f"{command}, {when}, {sha}"


def plot_concurrency(res: dict[str, Any], path: str, run: str = "") -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, layout="constrained")
    for s in _systems(res):
        ser = res[s]["series"]
        top.step(ser["t"], ser["running"], where="post", color=COLORS[s],
                 label=f"{LABELS[s]} (peak {res[s]['peak_running']})")
        bottom.step(ser["t"], ser["queued"], where="post", color=COLORS[s])
    if "dense_max_len" in res:
        ten = 10 * res["dense_max_len"]["peak_running"]
        top.axhline(ten, color="gray", ls="--", lw=1, label=f"target: 10x dense = {ten}")
    top.set_ylabel("running sequences")
    top.legend(loc="upper right", fontsize=8)
    top.set_title("Concurrent sequences in one KV budget" + (f"\n{run}" if run else ""),
                  fontsize=10)
    bottom.set_ylabel("queued requests")
    bottom.set_xlabel("time (s, compile excluded)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_waste(res: dict[str, Any], path: str, run: str = "") -> None:
    systems = _systems(res)
    fig, axes = plt.subplots(len(systems), 1, figsize=(10, 2.6 * len(systems) + 0.4),
                             squeeze=False, layout="constrained")
    fig.suptitle("Reserved but unfilled KV over time" + (f"\n{run}" if run else ""), fontsize=10)
    for ax, s in zip(axes[:, 0], systems):
        ser = res[s]["series"]
        t = np.asarray(ser["t"])
        ax.stackplot(t, ser["internal_pct"], ser["future_pct"],
                     colors=["tab:orange", "tab:purple"], alpha=0.6, step="post",
                     labels=["internal fragmentation", "held for future tokens"])
        ax.plot(t, ser["external_pct"], color="black", lw=1, drawstyle="steps-post",
                label="external fragmentation (% of budget)")
        if s == "paged":
            ax.axhline(4, color="gray", ls="--", lw=1, label="target: 4%")
        ax.set_title(f"{LABELS[s]}: waste at steady state {res[s]['waste_pct_steady']:.1f}% "
                     "of reserved slots", fontsize=10)
        ax.set_ylabel("% of reserved")
        ax.set_ylim(0, max(5.0, 1.1 * max(ser["waste_pct"] + ser["external_pct"] + [0])))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("time (s, compile excluded)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_map(ax: Any, pm: dict[str, Any], title: str, cols: int) -> None:
    """One cell per page: owner colour shaded by fill, white if free, x if shared."""
    owner, fill = np.asarray(pm["owner"]), np.asarray(pm["fill"], float)
    shared, ps = np.asarray(pm["shared"], bool), pm["page_size"]
    rows = -(-len(owner) // cols)
    rgb = np.ones((rows * cols, 3))
    rgb[len(owner):] = 0.85  # past the end of the pool
    for i in np.flatnonzero(owner >= 0):
        shade = 0.2 + 0.8 * fill[i] / ps  # an empty reserved page is pale, a full one solid
        rgb[i] = 1 - shade * (1 - PALETTE[owner[i] % len(PALETTE)])
    ax.imshow(rgb.reshape(rows, cols, 3), interpolation="nearest", aspect="equal")
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="lightgray", lw=0.4)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    for i in np.flatnonzero(shared):
        ax.text(i % cols, i // cols, "x", ha="center", va="center", fontsize=7)
    for i in pm.get("index_held", []):
        ax.add_patch(plt.Rectangle((i % cols - 0.45, i // cols - 0.45), 0.9, 0.9, fill=False,
                                   ec="gold", lw=2))
    used = int(np.sum(owner >= 0))
    ax.set_title(f"{title}\n{used}/{len(owner)} pages reserved, "
                 f"{int(fill.sum())}/{len(owner) * ps} slots filled, "
                 f"{int(shared.sum())} shared", fontsize=9)


def _columns(n: int) -> int:
    """A grid width about 1.5x the height, a divisor of ``n`` when one is close."""
    target = np.sqrt(1.5 * n)
    near = [c for c in range(1, n + 1) if n % c == 0 and target / 1.4 <= c <= target * 1.4]
    return min(near, key=lambda c: abs(c - target)) if near else int(np.ceil(target))


def plot_page_maps(maps: dict[str, dict[str, Any]], path: str, suptitle: str) -> None:
    fig, axes = plt.subplots(1, len(maps), figsize=(4.6 * len(maps), 4.6), squeeze=False,
                             layout="constrained")
    for ax, (title, pm) in zip(axes[0], maps.items()):
        _draw_map(ax, pm, title, _columns(len(pm["owner"])))
    fig.suptitle(suptitle, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def plot_all(results_dir: str, quick: bool, out_dir: str | None = None) -> list[str]:
    """Every PNG whose JSON exists in ``results_dir``, written to ``out_dir`` (default: beside
    the JSON); returns the paths written."""
    suffix = "_quick" if quick else ""
    out_dir = out_dir or results_dir
    os.makedirs(out_dir, exist_ok=True)
    written = []
    cap_path = os.path.join(results_dir, f"capacity{suffix}.json")
    if os.path.exists(cap_path):
        rec = _load(cap_path)
        res, run = rec["results"], stamp(rec, "capacity")
        base = os.path.join(out_dir, f"capacity{suffix}")
        plot_concurrency(res, base + "_concurrency.png", run)
        plot_waste(res, base + "_waste.png", run)
        maps = {f"{LABELS[s]} (step {res[s]['page_map']['step']})": res[s]["page_map"]
                for s in _systems(res) if res[s].get("page_map")}
        plot_page_maps(maps, base + "_page_map.png", "The KV pool at each system's peak "
                       f"(colour = sequence, pale = reserved but empty, white = free)\n{run}")
        written += [base + n for n in ("_concurrency.png", "_waste.png", "_page_map.png")]
    cancel_path = os.path.join(results_dir, f"cancel{suffix}.json")
    if os.path.exists(cancel_path):
        rec = _load(cancel_path)
        fork = rec["results"]["fork"]
        path = os.path.join(out_dir, f"cancel{suffix}_page_map.png")
        plot_page_maps({"paged pool after fork + one token per child": fork["page_map"]}, path,
                       f"row 0: a {fork['prompt_len']}-token prompt; rows 1-{fork['children']}:"
                       f" its forks\nx = shared page, gold box = also held by the prefix index,"
                       f"\npale = partly filled, white = free\n{stamp(rec, 'cancel')}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="plot the *_quick.json records")
    ap.add_argument("--results", default=RESULTS_DIR, help="where the JSON records are")
    ap.add_argument("--out", help="where the PNGs go (default: beside the JSON)")
    args = ap.parse_args(argv)
    written = plot_all(args.results, args.quick, args.out)
    print("\n".join(f"wrote {p}" for p in written) or "no JSON to plot")


if __name__ == "__main__":
    main()
