"""paxkv as an lm-evaluation-harness backend: through lm-eval itself, against lm-eval's own
``hf`` backend on the same GGUF weights (float32), on the offline tasks of ``tests/data/tasks``;
and the backend's conventions and errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="the harness needs the eval extra: pip install -e '.[eval]'")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import paxkv  # noqa: E402
from paxkv.harness import PaxkvLM  # noqa: E402
from paxkv.harness.stops import StopScan  # noqa: E402
import oracle  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "tests" / "data" / "tasks"
TASKS = ["paxkv_mc", "paxkv_mc_fewshot", "paxkv_rolling", "paxkv_gen"]
MAX_LENGTH = 64  # short enough that few-shot contexts are cut and texts take several windows


def _request(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def paxkv_lm(lm) -> PaxkvLM:
    return PaxkvLM(max_length=MAX_LENGTH, batch_size=16)


# -- conventions and errors (no HF) -------------------------------------------------------------
def test_paxkv_is_registered_and_takes_no_arguments(paxkv_lm):
    assert lm_eval.api.registry.get_model("paxkv") is PaxkvLM
    assert paxkv_lm.prefix_token_id == 1 and paxkv_lm.eot_token_id == 2  # BOS, as hf does
    assert PaxkvLM().max_length == 8192  # the model's context length, as hf reads it


def test_unknown_model_args_and_a_wrong_device_name_what_to_change(lm):
    with pytest.raises(ValueError, match="unknown model_args for paxkv: dtype, foo.*accepts"):
        PaxkvLM.create_from_arg_string("foo=1,dtype=float32,page_size=16")
    with pytest.raises(ValueError, match="device='npu:0' is not one of"):
        PaxkvLM(device="npu:0")
    with pytest.warns(UserWarning, match="using 'cpu'"):
        assert PaxkvLM(device="cuda:0").device == "cpu"
    with pytest.raises(ValueError, match="batch_size"):
        PaxkvLM(batch_size=0)


def test_empty_continuation_is_a_clear_error(paxkv_lm):
    with pytest.raises(ValueError, match="empty continuation"):
        paxkv_lm.loglikelihood([_request("loglikelihood", ("The sky is", ""))])
    with pytest.raises(ValueError, match="tokenises to nothing"):
        paxkv_lm._loglikelihood_tokens([(("a", " "), [5], [])])


def test_empty_context_becomes_bos_and_long_contexts_are_cut_from_the_left(paxkv_lm, lm):
    (got, greedy), = paxkv_lm.loglikelihood([_request("loglikelihood", ("", "Paris is big"))])
    want = paxkv.score(lm, [([1], lm.encode("Paris is big"))])[0]
    assert abs(got - want.logprob) < 1e-5 and greedy == want.is_greedy
    ctx = " ".join(["word"] * 100)
    (cut, _), = paxkv_lm.loglikelihood([_request("loglikelihood", (ctx, " end"))])
    ids = lm.encode(ctx + " end")
    want = paxkv.score(lm, [(ids[-(MAX_LENGTH + 1):-1], ids[-1:])])[0]
    assert abs(cut - want.logprob) < 1e-5


def test_stop_scan_finds_what_a_whole_decode_finds_decoding_only_a_tail(paxkv_lm):
    # Outputs of ~450 tokens (accents, CJK split across byte tokens, special tokens that
    # decode to nothing, even inside the stop string), fed 1-3 tokens a step: the scan must say
    # "found" at the same step as a whole decode does, decoding O(n) tokens in all, where
    # decoding the whole output each step is ~n^2 / 4 (~50,000 tokens here).
    rng = np.random.default_rng(0)
    text = "Question: what is 2 + 2?\n\nAnswer: 4, déjà vu, 日本語の文.\n\n"
    specials = [paxkv_lm.eot_token_id, paxkv_lm.prefix_token_id]
    decoded = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return paxkv_lm.tok_decode(ids)

    for trial in range(4):
        stop = ["XYZZY", "日本語XY", "\n\nQ:"][trial % 3]
        ids = paxkv_lm.tok_encode(text * 12 + stop + text)
        for at in sorted(rng.choice(len(ids), 40, replace=False), reverse=True):
            ids.insert(int(at), int(rng.choice(specials)))
        scan, n = StopScan(decode, ["", "never there", stop]), 0
        decoded.clear()
        while n < len(ids):
            n += int(rng.integers(1, 4))
            whole = stop in paxkv_lm.tok_decode(ids[:n])
            assert scan.found(ids[:n]) == whole, (trial, n)
            if whole:
                break
        assert whole and n > 400
        assert sum(decoded) <= 40 * n, (sum(decoded), n)


@pytest.mark.slow
def test_the_command_line_runs_lm_eval_with_paxkv(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "paxkv.harness", "run", "--model", "paxkv", "--model_args",
         "max_length=64", "--batch_size", "8", "--tasks", "paxkv_mc", "--include_path",
         str(TASKS_DIR), "--limit", "2", "--output_path", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env=dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "paxkv_mc" in out.stdout and "acc" in out.stdout


# -- the outside oracle: lm-eval's hf backend ---------------------------------------------------
@pytest.fixture(scope="module")
def runs(hf, paxkv_lm):
    """Both backends through ``simple_evaluate`` on every test task, samples logged."""
    from lm_eval.models.huggingface import HFLM

    hf_lm = HFLM(pretrained=hf.model, tokenizer=hf.tokenizer, batch_size=8,
                 max_length=MAX_LENGTH)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return {name: lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=manager,
                                          log_samples=True, bootstrap_iters=0)
            for name, model in (("hf", hf_lm), ("paxkv", paxkv_lm))}


def _pairs(runs, task):
    a, b = runs["hf"]["samples"][task], runs["paxkv"]["samples"][task]
    assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and a
    return list(zip(a, b))


def _arguments(sample) -> list[tuple]:
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(v[f"arg_{i}"] for i in range(len(v))) for v in args.values()]
    return [tuple(a) for a in args]


@pytest.mark.oracle
@pytest.mark.parametrize("task", ["paxkv_mc", "paxkv_mc_fewshot"])
def test_loglikelihoods_and_accuracy_match_the_hf_backend(runs, task, hf, paxkv_lm):
    diffs, unsure = [], []
    for s_hf, s_px in _pairs(runs, task):
        for i, (r_hf, r_px) in enumerate(zip(s_hf["resps"], s_px["resps"])):
            (ll_hf, greedy_hf), (ll_px, greedy_px) = r_hf[0], r_px[0]
            diffs.append(abs(ll_hf - ll_px))
            if greedy_hf != greedy_px:
                unsure.append(_arguments(s_hf)[i])
    assert max(diffs) < 1e-3, max(diffs)
    for ctx, cont in unsure:  # is_greedy may differ only where HF's top two nearly tie
        assert _min_top2_margin(hf, paxkv_lm, ctx, cont) <= 1e-4, (ctx, cont)
    for metric in ("acc,none", "acc_norm,none"):
        assert runs["hf"]["results"][task][metric] == runs["paxkv"]["results"][task][metric]


def _min_top2_margin(hf, paxkv_lm, ctx: str, cont: str) -> float:
    ctx_ids, cont_ids = paxkv_lm._encode_pair(ctx, cont)
    ids = (ctx_ids + cont_ids)[-(MAX_LENGTH + 1):]
    logits = oracle.hf_logits(hf, [ids[:-1]])[0][-len(cont_ids):]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float(np.min(top2[:, 1] - top2[:, 0]))


@pytest.mark.oracle
def test_rolling_perplexity_matches_the_hf_backend(runs):
    for s_hf, s_px in _pairs(runs, "paxkv_rolling"):
        a, b = s_hf["resps"][0][0], s_px["resps"][0][0]
        assert abs(a - b) <= 1e-4 * abs(a), (a, b)
    hf_res, px_res = (runs[k]["results"]["paxkv_rolling"] for k in ("hf", "paxkv"))
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert abs(hf_res[metric] - px_res[metric]) <= 1e-4 * abs(hf_res[metric]), metric


@pytest.mark.oracle
def test_generate_until_matches_the_hf_backend(runs):
    for s_hf, s_px in _pairs(runs, "paxkv_gen"):
        assert s_hf["resps"] == s_px["resps"]
        assert "\n" not in s_px["resps"][0][0]


@pytest.mark.oracle
def test_chat_template_matches_the_hf_backend(hf, paxkv_lm):
    from lm_eval.models.huggingface import HFLM

    hf_lm = HFLM(pretrained=hf.model, tokenizer=hf.tokenizer, batch_size=1)
    for history in ([{"role": "user", "content": "Hi"}],
                    [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Name a colour."},
                     {"role": "assistant", "content": "Blue "}]):
        for prompt in (True, False):
            assert paxkv_lm.apply_chat_template(history, prompt) == \
                hf_lm.apply_chat_template(history, prompt)
    assert paxkv_lm.chat_template(True) == hf_lm.chat_template(True)


# -- a sliding-window family through the backend (no default model) ----------------------------
@pytest.mark.oracle
def test_the_backend_scores_a_gemma3_folder_as_hf_does(tmp_path, caplog):
    """``--model paxkv`` on a Gemma 3 checkpoint folder (a tiny random ``gemma3_text``, 5
    window layers of 16 tokens : 1 global, with a character tokenizer saved beside it):
    log-likelihoods of continuations after contexts 4-5 windows long, and a rolling
    log-likelihood over 6 windows, equal HF's own float32 log-probabilities within 1e-4;
    each call logs the compiles it paid."""
    pytest.importorskip("transformers")
    import tokenizers  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    import family_oracle as fo  # noqa: PLC0415

    hf = fo.tiny_hf("gemma3_text", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    letters = "abcdefghijklmnopqrstuvwxyz .,"
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(letters)})
    chars = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    chars.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=chars, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>").save_pretrained(tmp_path)

    backend = PaxkvLM(pretrained=str(tmp_path), max_length=128, batch_size=4, page_size=8)
    assert backend.lm.layer_windows == (16, 16, 16, 16, 16, None)
    context = "the quick brown fox jumps over the lazy dog, then naps in the warm sun."
    pairs = [(context, " it sleeps."), (context[:64], " by the river"), (context, " x")]
    with caplog.at_level("INFO", logger="lm_eval.paxkv"):
        got = backend.loglikelihood([_request("loglikelihood", p) for p in pairs])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lm_eval.paxkv"]
    assert line.startswith("paxkv loglikelihood: ") and "persistent cache" in line
    c = backend.compile_stats
    assert c.compiles + c.cache_loads > 0 and f"{c.compiles} compiles" in line
    text = "a long walk by the sea, under grey skies, with gulls over the cold waves."
    (rolling,) = backend.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])

    def hf_logprob(ids: list[int], start: int) -> float:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1).numpy()
        return float(sum(logp[i - 1, ids[i]] for i in range(start, len(ids))))

    for (ctx, cont), (logprob, _) in zip(pairs, got):
        ids = chars.encode(ctx).ids + chars.encode(cont).ids
        assert abs(logprob - hf_logprob(ids, len(chars.encode(ctx).ids))) < 1e-4
    start = backend.prefix_token_id  # BOS, as the hf backend's
    assert start == vocab["<bos>"]
    assert abs(rolling - hf_logprob([start] + chars.encode(text).ids, 1)) < 1e-4
