"""lm-eval on tasks no process has seen: paxkv from a cold process (persistent compilation
cache empty, then populated by an earlier process) and warm, against lm-eval's ``hf`` backend.

    python -m experiments.eval_cold            # 3 task sets of 36 questions + rolling text
    python -m experiments.eval_cold --quick    # 8 short questions a set (a smoke run)

A seed picks three task sets A, B, C, each a multiple-choice task and a rolling-perplexity
task over real English (``pydoc_data.topics``), with lengths of their own: contexts of one
random span within 60-560 tokens, 2-5 choices of 1-24 tokens (one true continuation, the
rest spans from elsewhere), and 4 texts of 150-450 tokens. Four processes, one after the other
on quiet cores, each loading its model untimed and then timing ``lm_eval.simple_evaluate``:

    paxkv, empty cache folder     A (cold, empty)   B (warm process, unseen task)   A (warm)
    paxkv, that folder populated  C (cold process, cache populated by the first, unseen task)
    hf                            A                 B                               A
    hf                            C

hf runs with torch's threads at the faster of 1 and every core on this machine
(:func:`experiments.evaluate.hf_threads`, measured while it loads). Reported per run:
seconds, paxkv's XLA compiles, persistent-cache loads and their seconds
(``PaxkvLM.compile_stats``), hf / paxkv, accuracies (identical is checked) and the largest
log-likelihood difference from hf over the requests both tokenise alike
(:func:`experiments.evaluate.same_tokens`). Writes ``results/eval_cold.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments.common import (english_prompts, fill_defaults, parser, print_table, record,
                                result_name, write_json)

TARGETS = {"cold, empty cache": 1.5, "cold, cache populated": 2.5, "warm, unseen task": 3.0,
           "warm, same task": 3.0}


def make_set(lm: Any, n: int, seed: int, quick: bool) -> dict[str, list[dict]]:
    """One task set: ``mc`` questions and ``rolling`` texts with lengths ``seed`` picks."""
    rng = np.random.default_rng(1000 + seed)
    lo = int(rng.integers(30, 80)) if quick else int(rng.integers(60, 400))
    hi = lo + (int(rng.integers(10, 40)) if quick else int(rng.integers(40, 160)))
    choices, longest = int(rng.integers(2, 6)), int(rng.integers(4, 25))
    windows = english_prompts(lm, 2 * n + 8, lo + longest, hi + longest, seed=seed)
    mc = []
    for i in range(n):
        w = windows[i]
        cut = len(w) - longest
        spans = []
        for j in range(choices):
            k = int(rng.integers(1, longest + 1))
            src = w[cut:] if j == 0 else windows[int(rng.integers(n, len(windows)))]
            start = 0 if j == 0 else int(rng.integers(0, len(src) - k))
            spans.append(src[start:start + k])
        order = rng.permutation(choices)
        mc.append(dict(context=lm.decode(w[:cut]).rstrip(),
                       choices=[lm.decode(spans[o]).strip() or "." for o in order],
                       answer=int(np.flatnonzero(order == 0)[0])))
    texts = english_prompts(lm, 4, 40 if quick else 150, 80 if quick else 450, seed=seed + 50)
    return dict(mc=mc, rolling=[dict(text=lm.decode(t)) for t in texts])


def write_set(folder: str, name: str, docs: dict[str, list[dict]]) -> list[str]:
    """Task YAMLs for one set (local JSON data); returns the task names."""
    heads = dict(
        mc="output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
           "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n"
           "  - metric: acc\n  - metric: acc_norm\n",
        rolling="output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
                "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n"
                "  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    names = []
    for kind, rows in docs.items():
        data = os.path.join(folder, f"{name}_{kind}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        task = f"cold_{name}_{kind}"
        with open(os.path.join(folder, f"{task}.yaml"), "w") as f:
            f.write(f"task: {task}\ndataset_path: json\ndataset_name: null\n"
                    f"dataset_kwargs:\n  data_files: {{test: {data}}}\ntest_split: test\n"
                    + heads[kind] + "metadata:\n  version: 1.0\n")
        names.append(task)
    return names


def child(system: str, folder: str, sets: list[str], hf_batch: int,
          hf_threads_choice: int = 0) -> dict[str, Any]:
    """One process: load ``system`` (untimed), then evaluate each set in order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from paxkv import models

    t0 = time.perf_counter()
    threads = None
    if system == "hf":
        from lm_eval.models.huggingface import HFLM

        from experiments.evaluate import hf_threads

        path, name = os.path.split(models.default_model_path())
        model = HFLM(pretrained=path, gguf_file=name, dtype="float32", device="cpu",
                     batch_size=hf_batch)
        threads = hf_threads(model, hf_threads_choice)
    else:
        from paxkv.harness import PaxkvLM

        model = PaxkvLM(batch_size=32)
    load_s = time.perf_counter() - t0
    manager = TaskManager(include_path=folder, include_defaults=False)
    runs = []
    for s in sets:
        tasks = [f"cold_{s}_mc", f"cold_{s}_rolling"]
        before = getattr(model, "compile_stats", None)
        before = (before.compiles, before.cache_loads, before.compile_seconds) if before else None
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=manager,
                                      log_samples=True, bootstrap_iters=0)
        run = dict(set=s, seconds=time.perf_counter() - start)
        if before is not None:
            c = model.compile_stats
            run.update(compiles=c.compiles - before[0], loads=c.cache_loads - before[1],
                       compile_s=c.compile_seconds - before[2])
        mc = out["results"][tasks[0]]
        run.update(acc=mc["acc,none"], acc_norm=mc["acc_norm,none"],
                   word_perplexity=out["results"][tasks[1]]["word_perplexity,none"])
        samples = [smp for t in tasks
                   for smp in sorted(out["samples"][t], key=lambda x: x["doc_id"])]
        run["lls"] = [_loglikelihood(r) for smp in samples for r in smp["resps"]]
        run["args"] = [a for smp in samples for a in _arguments(smp)]
        runs.append(run)
        print(f"{system} {s}: {run['seconds']:.1f} s", file=sys.stderr, flush=True)
    if system == "hf":  # which requests paxkv tokenises alike (untimed; see same_tokens)
        from paxkv.harness import PaxkvLM

        px = PaxkvLM(batch_size=1)
        for run in runs:
            run["same"] = [_ids(model, a) == _ids(px, a) for a in run["args"]]
    for run in runs:
        del run["args"]
    return dict(load_s=load_s, runs=runs, threads=threads)


def _arguments(sample: dict) -> list[tuple[str, ...]]:
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(v for k, v in sorted(a.items()) if k.startswith("arg_"))
                for a in args.values()]
    return [tuple(a) for a in args]


def _ids(model: Any, args: tuple[str, ...]) -> Any:
    """A request's token ids as ``model`` makes them: (context, continuation) for a choice,
    the text's for a rolling request. The hf backend's GGUF tokenizer drops SmolLM2's digit
    split (experiments.evaluate.same_tokens): log-likelihoods of other ids are not compared."""
    if len(args) >= 2:
        return tuple(map(list, model._encode_pair(args[0], args[1])))
    return list(model.tok_encode(args[0]))


def _loglikelihood(resp: Any) -> float:
    """A sample's response: ``[(ll, greedy)]`` (multiple choice) or ``[ll]`` (rolling)."""
    first = resp[0]
    return float(first[0] if isinstance(first, (list, tuple)) else first)


def spawn(system: str, folder: str, cache: str, sets: list[str], args: Any) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PAXKV_COMPILE_CACHE=cache, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "experiments.eval_cold", "--child", system,
                           "--tasks", folder, "--sets", ",".join(sets),
                           f"--hf-batch={args.hf_batch}", f"--hf-threads={args.hf_threads}"],
                          env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(__doc__)
    ap.add_argument("--child", choices=("hf", "paxkv"))
    ap.add_argument("--tasks", help="(child) the task folder")
    ap.add_argument("--sets", help="(child) the task sets, in order")
    ap.add_argument("--questions", type=int)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--hf-threads", type=int, default=0,
                    help="torch threads for hf (0: the faster of 1 and every core, measured "
                    "by experiments.evaluate.hf_threads)")
    args = fill_defaults(ap.parse_args(argv), quick=dict(questions=8),
                         full=dict(questions=36))
    if args.child:
        print(json.dumps(child(args.child, args.tasks, args.sets.split(","), args.hf_batch,
                               args.hf_threads)))
        return {}
    from paxkv import models

    lm = models.load()
    with tempfile.TemporaryDirectory() as tasks, tempfile.TemporaryDirectory() as cache:
        lengths = {}
        for i, name in enumerate("ABC"):
            docs = make_set(lm, args.questions, args.seed + i, args.quick)
            write_set(tasks, name, docs)
            lengths[name] = dict(
                contexts=[min(len(lm.encode(d["context"])) for d in docs["mc"]),
                          max(len(lm.encode(d["context"])) for d in docs["mc"])],
                choices=len(docs["mc"][0]["choices"]),
                rolling=[len(lm.encode(d["text"])) for d in docs["rolling"]])
        px1 = spawn("paxkv", tasks, cache, ["A", "B", "A"], args)
        px2 = spawn("paxkv", tasks, cache, ["C"], args)
        hf1 = spawn("hf", tasks, cache, ["A", "B", "A"], args)
        hf2 = spawn("hf", tasks, cache, ["C"], args)
    regimes = [("cold, empty cache", px1["runs"][0], hf1["runs"][0]),
               ("cold, cache populated", px2["runs"][0], hf2["runs"][0]),
               ("warm, unseen task", px1["runs"][1], hf1["runs"][1]),
               ("warm, same task", px1["runs"][2], hf1["runs"][2])]
    rows, table, ok = [], [], True
    for label, px, hf in regimes:
        same = np.asarray(hf["same"])
        diff = float(np.max(np.abs(np.subtract(px["lls"], hf["lls"]))[same], initial=0.0))
        equal = (px["acc"], px["acc_norm"]) == (hf["acc"], hf["acc_norm"])
        ratio = hf["seconds"] / px["seconds"]
        ok &= equal
        rows.append(dict(regime=label, set=px["set"], paxkv_s=px["seconds"], hf_s=hf["seconds"],
                         vs_hf=ratio, target=TARGETS[label], compiles=px["compiles"],
                         loads=px["loads"], compile_s=px["compile_s"], max_ll_diff=diff,
                         requests_tokenised_differently=int((~same).sum()),
                         same_accuracy=equal))
        table.append([label, px["set"], f"{px['seconds']:.1f}", str(px["compiles"]),
                      str(px["loads"]), f"{px['compile_s']:.1f}", f"{hf['seconds']:.1f}",
                      f"{ratio:.2f}x", f"{TARGETS[label]}x",
                      f"{diff:.1e} ({int(same.sum())} of {same.size})"])
    print_table(["regime", "set", "paxkv s", "compiles", "cache loads", "compile / load s",
                 "hf s", "hf / paxkv", "target", "max |ll - hf| (requests tokenised alike)"], table)
    print(f"model load (untimed above): paxkv {px1['load_s']:.1f} / {px2['load_s']:.1f} s, "
          f"hf {hf1['load_s']:.1f} / {hf2['load_s']:.1f} s; hf's torch threads "
          f"{hf1['threads']} / {hf2['threads']}; accuracies identical: {ok}")
    data = record(dict(vars(args), lengths=lengths),
                  dict(rows=rows, load_s=dict(paxkv=[px1["load_s"], px2["load_s"]],
                                              hf=[hf1["load_s"], hf2["load_s"]]),
                       process_s=dict(paxkv=[px1["process_s"], px2["process_s"]],
                                      hf=[hf1["process_s"], hf2["process_s"]]),
                       hf_threads=[hf1["threads"], hf2["threads"]],
                       accuracies_identical=ok))
    write_json(result_name("eval_cold", args.quick), data)
    return data


if __name__ == "__main__":
    main()
