"""The main job: 32 chat users with one system prompt, through the paged and the dense cache.

    python -m experiments.demo [--users 32] [--max-new-tokens 64] [--max-len 1024]

Prints a few answers, then a table: pages in use vs the dense reservation, KV bytes, output
tokens/s, and how many sequences each cache fits in the same memory. Writes
``results/demo.json``. Both caches run the same greedy workload and must agree token for token.
The paged engine runs without the prefix cache: each user's pages are its own, as in the dense
cache, so the table compares paging alone (``experiments.sharing`` measures sharing).
"""

from __future__ import annotations


from paxkv import models
import paxkv
from experiments.common import finish, parser, print_table, record, timed

SYSTEM = (
    "You are Pax, a patient and precise assistant for a public library. Answer in two or three "
    "short sentences. If a question is about opening hours, say the library opens at 9am and "
    "closes at 8pm on weekdays, and opens 10am to 4pm on weekends. If asked about borrowing, "
    "say members may borrow up to twelve items for three weeks and renew twice online. Be "
    "friendly, avoid jargon, and never invent facts you were not given."
)

QUESTIONS = [
    "When do you open on Saturday?", "How many books can I borrow?", "Can I renew online?",
    "What is a library card?", "Recommend a classic novel.", "Do you close late on Monday?",
    "How long is the loan period?", "What is the capital of Italy?", "Tell me a fun fact.",
    "Can I borrow DVDs?", "What should I read to learn Python?", "Is the library open Sunday?",
    "How do I say thanks in French?", "Give me a tip for studying.", "What is 12 times 12?",
    "Who wrote Pride and Prejudice?", "How often can I renew?", "Are you open at 7pm on Friday?",
    "What is a haiku?", "Suggest a book for a ten-year-old.", "How do I find a quiet room?",
    "Name three planets.", "What time do you close on Sunday?", "Can I borrow twenty items?",
    "What is photosynthesis?", "Write one line about rain.", "What is the loan limit?",
    "How do I return a book?", "Why is the sky blue?", "Can children get a card?",
    "What is an e-book?", "Good morning!",
]


def run(lm, cache: str, prompts: list[list[int]], args) -> tuple[list, dict]:
    engine = paxkv.Engine(lm, cache=cache, max_seqs=args.users, max_len=args.max_len,
                          page_size=args.page_size, prefix_cache=False)
    passes = []

    def one_pass() -> None:
        engine.reset_stats()
        ids = [engine.submit(p, max_new_tokens=args.max_new_tokens, stop_token_ids=[])
               for p in prompts]
        results = engine.run()
        passes.append([results[i] for i in ids])

    # The warm-up pass compiles every shape the timed pass uses.
    seconds = timed(one_pass, repeats=1, warmup=1).median_s
    out = passes[-1]
    generated = sum(len(r.token_ids) for r in out)
    cfg = lm.config
    slot_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # k + v, float32
    page_slots, peak_pages = engine.cache.page_size, engine.stats().peak_pages_used
    used_slots = peak_pages * page_slots
    reserved_slots = engine.cache.num_pages * page_slots
    per_seq_slots = used_slots / len(prompts)
    return out, dict(
        cache=cache, seconds=seconds, output_tokens=generated,
        tokens_per_s=generated / seconds, peak_slots_in_use=used_slots,
        reserved_slots=reserved_slots, peak_kv_bytes=used_slots * slot_bytes,
        reserved_kv_bytes=reserved_slots * slot_bytes,
        seqs_fitting_dense_budget=int(reserved_slots // per_seq_slots),
        peak_pages_in_use=peak_pages, page_size=page_slots)


def main() -> None:
    ap = parser(__doc__, quick=None)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024,
                    help="the longest conversation a slot must hold (the dense reservation)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--show", type=int, default=3, help="answers to print")
    args = ap.parse_args()

    lm = models.load()
    prompts = [lm.encode(lm.chat_prompt([{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": q}]))
               for q in (QUESTIONS * (args.users // len(QUESTIONS) + 1))[: args.users]]
    print(f"{lm.name}: {args.users} users, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.max_new_tokens} new tokens each\n")
    paged, paged_row = run(lm, "paged", prompts, args)
    dense, dense_row = run(lm, "dense", prompts, args)
    agree = all(a.token_ids == b.token_ids for a, b in zip(paged, dense))
    eos = set(lm.eos_token_ids)
    for q, r in list(zip(QUESTIONS, paged))[: args.show]:
        # Every user decodes all max_new_tokens (EOS ignored: equal work for the timing);
        # the answer shown ends at the first end-of-turn token.
        ids = r.token_ids
        end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        print(f"user: {q}\npax:  {lm.decode(ids[:end]).strip()[:300]}\n")

    rows = []
    for row in (paged_row, dense_row):
        rows.append([row["cache"], f"{row['peak_slots_in_use']:,}", f"{row['reserved_slots']:,}",
                     f"{row['peak_kv_bytes'] / 2**20:.1f}", f"{row['reserved_kv_bytes'] / 2**20:.1f}",
                     f"{row['tokens_per_s']:.1f}", str(row["seqs_fitting_dense_budget"])])
    print_table(["cache", "slots in use (peak)", "slots reserved", "KV MiB in use",
                 "KV MiB reserved", "tok/s", "seqs in dense budget"], rows)
    print(f"\npaged and dense outputs identical: {agree}")
    finish("demo", record(vars(args), {"paged": paged_row, "dense": dense_row,
                                       "outputs_identical": agree}),
           agree, "paged and dense disagree: no figure stands for a wrong answer")


if __name__ == "__main__":
    main()
