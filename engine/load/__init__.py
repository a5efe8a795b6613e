"""Loading a model and reading requests: config.json, weights, tokenizer, prompts, made models."""
