"""Turn a JSONL workload into the same lines with a JSON schema (structured output), for the overhead figure.

    python3 bench/structured_workload.py [--strings free|bounded] < workload.jsonl > schema.jsonl

Every line keeps its prompt and max_tokens and gains `response_format: {"type": "json_schema", ...}`. The schema is
an extraction record (enums, integers, numbers, booleans, strings, a nested object) repeated in an array whose
minItems no reply reaches, so a constrained reply never completes before max_tokens: both files generate exactly
the same number of tokens per line (run both with --ignore-eos), and the wall ratio is the cost of the masks alone.
`--strings bounded` gives the strings a maxLength, the most expensive kind of mask for llguidance (docs/
PERFORMANCE.md); `free` (default) leaves them unbounded.
"""
from __future__ import annotations

import argparse
import json
import sys


def record_schema(bounded: bool) -> dict:
    text = {"type": "string", **({"maxLength": 32} if bounded else {})}
    item = {
        "type": "object",
        "properties": {
            "category": {"enum": ["billing", "technical", "account", "safety", "other"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "summary": text,
            "escalate": {"type": "boolean"},
            "customer": {"type": "object", "properties": {"name": text, "orders": {"type": "integer"}},
                         "required": ["name", "orders"], "additionalProperties": False},
        },
        "required": ["category", "priority", "confidence", "summary", "escalate", "customer"],
        "additionalProperties": False,
    }
    return {"type": "object", "properties": {"records": {"type": "array", "items": item, "minItems": 100000}},
            "required": ["records"], "additionalProperties": False}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strings", choices=["free", "bounded"], default="free")
    args = ap.parse_args()
    fmt = {"type": "json_schema", "json_schema": {"name": "records", "strict": True,
                                                  "schema": record_schema(args.strings == "bounded")}}
    for line in sys.stdin:
        if line.strip():
            obj = json.loads(line)
            obj["response_format"] = fmt
            sys.stdout.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    main()
