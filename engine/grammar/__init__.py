"""Structured output: request fields -> a grammar spec, compiled against the tokenizer, masks per decode step."""
