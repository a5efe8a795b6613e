#!/usr/bin/env python3
"""Deterministic prefix-sharing workloads for benchmarking offline batch inference.

Writes JSONL request lines with pre-tokenized prompts, so any engine (and any
reference implementation) can run exactly the same tokens:

    {"custom_id": "...", "prompt_token_ids": [...], "max_tokens": N, "ignore_eos": true}

Shapes (all token ids drawn from a seeded RNG, below --vocab-limit):
  shared-system  N requests = one shared prefix + a unique suffix each
  doc-qa         D documents x Q questions: long document prefix, short question suffix
  fewshot-tree   instruction -> K shot sets -> M queries per set (a three-level tree)
  multiturn      C conversations x T turns; turn t's prompt extends turn t-1's prompt
                 by the previous reply and a new user message
  unique         no sharing at all (the control: reuse must cost nothing here)
  long-docs      D documents of --min-doc..--prefix tokens x Q questions; --part first writes
                 questions 0..Q-1 of each document, --part second Q new ones (Q..2Q-1) over the
                 very same documents: a later batch over documents a persistent cache holds

Request order is shuffled (seeded) so that an engine has to find the sharing itself.
The last line printed to stderr is a summary: requests, prompt tokens, and the number
of distinct prompt-prefix tokens (the size of the token trie, the least prefill any
prefix-reusing engine must do).

Usage:
    python3 bench/workloads.py shared-system --requests 256 --prefix 4096 --suffix 256 --gen 128 > w.jsonl
"""
import argparse
import json
import random
import sys


def trie_size(prompts):
    """Distinct (prefix-position, token) nodes over all prompts: the minimum prefill."""
    root = {}
    nodes = 0
    for p in prompts:
        node = root
        for t in p:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                nodes += 1
            node = nxt
    return nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=["shared-system", "doc-qa", "fewshot-tree", "multiturn", "unique", "long-docs"])
    ap.add_argument("--requests", type=int, default=256, help="shared-system / unique: number of requests")
    ap.add_argument("--prefix", type=int, default=4096, help="shared prefix / document / instruction length")
    ap.add_argument("--suffix", type=int, default=256, help="unique suffix / question / query length")
    ap.add_argument("--docs", type=int, default=8, help="doc-qa: documents; fewshot-tree: shot sets")
    ap.add_argument("--per-doc", type=int, default=32, help="doc-qa: questions per doc; fewshot-tree: queries per set")
    ap.add_argument("--shots", type=int, default=1024, help="fewshot-tree: tokens in each shot set")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    ap.add_argument("--reply", type=int, default=128, help="multiturn: tokens of each earlier reply")
    ap.add_argument("--gen", type=int, default=128, help="max_tokens for every request")
    ap.add_argument("--min-doc", type=int, default=8192, help="long-docs: the shortest document (the longest: --prefix)")
    ap.add_argument("--part", choices=["first", "second"], default="first",
                    help="long-docs: the first batch of questions, or the second (new questions, same documents)")
    ap.add_argument("--vocab-limit", type=int, default=32000, help="token ids are drawn from [16, vocab_limit)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)

    def toks(n):
        return [rng.randrange(16, a.vocab_limit) for _ in range(n)]

    prompts = []  # (custom_id, tokens)
    if a.shape == "shared-system":
        pre = toks(a.prefix)
        prompts = [(f"req-{i}", pre + toks(a.suffix)) for i in range(a.requests)]
    elif a.shape == "unique":
        prompts = [(f"req-{i}", toks(a.prefix + a.suffix)) for i in range(a.requests)]
    elif a.shape == "doc-qa":
        for d in range(a.docs):
            doc = toks(a.prefix)
            prompts += [(f"doc{d}-q{q}", doc + toks(a.suffix)) for q in range(a.per_doc)]
    elif a.shape == "fewshot-tree":
        inst = toks(a.prefix)
        for s in range(a.docs):
            shots = toks(a.shots)
            prompts += [(f"set{s}-x{q}", inst + shots + toks(a.suffix)) for q in range(a.per_doc)]
    elif a.shape == "long-docs":
        # each document and question from its own seeded generator: both parts hold the very same documents
        for d in range(a.docs):
            own = random.Random(f"{a.seed}-doc-{d}")
            length = own.randint(min(a.min_doc, a.prefix), a.prefix)
            doc = [own.randrange(16, a.vocab_limit) for _ in range(length)]
            first = 0 if a.part == "first" else a.per_doc
            for q in range(first, first + a.per_doc):
                asked = random.Random(f"{a.seed}-doc-{d}-q-{q}")
                prompts.append((f"doc{d}-q{q}", doc + [asked.randrange(16, a.vocab_limit) for _ in range(a.suffix)]))
    elif a.shape == "multiturn":
        for c in range(a.requests):
            conv = toks(a.prefix) + toks(a.suffix)
            for t in range(a.turns):
                prompts.append((f"conv{c}-turn{t}", list(conv)))
                conv = conv + toks(a.reply) + toks(a.suffix)
    rng.shuffle(prompts)
    out = sys.stdout
    for cid, p in prompts:
        out.write(json.dumps({"custom_id": cid, "prompt_token_ids": p, "max_tokens": a.gen, "ignore_eos": True}) + "\n")
    total = sum(len(p) for _, p in prompts)
    uniq = trie_size([p for _, p in prompts])
    print(f"workload {a.shape}: {len(prompts)} requests, {total} prompt tokens, "
          f"{uniq} distinct prefix tokens (ideal reuse {1 - uniq / total:.1%}), {len(prompts) * a.gen} generated tokens",
          file=sys.stderr)


if __name__ == "__main__":
    main()
