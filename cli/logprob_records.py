"""Log-probabilities in the output records, in the shape of the line that asked for them (cli/io.py documents them):
OpenAI chat (`choices[].logprobs.content[]`: token, logprob, bytes, top_logprobs), OpenAI completions (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and plain lines (token ids beside the text).

A token's text is its own decoding; its bytes are the bytes it stands for (a byte-level vocabulary's token may hold
part of a UTF-8 character: its text is then U+FFFD while its bytes are exact, as OpenAI's `bytes` field intends).
A logprob of -inf (a token the logits made impossible) is written as -9999.0, as vLLM writes it: JSON has no -inf.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from prefixrun.engine.request import Completion, TokenLogprob

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _gpt2_byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte (transformers' bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TokenText:
    """Token ids -> the text and bytes a logprobs record shows, from the model's tokenizer (None: ids only)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        got = self._text.get(token_id)
        if got is None:
            got = self._text[token_id] = "" if self.tokenizer is None else \
                self.tokenizer.decode([token_id], skip_special_tokens=False)
        return got

    def bytes(self, token_id: int) -> list[int]:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = list(self._bytes_of(token_id))
        return got

    def _bytes_of(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.id_to_piece(token_id) if tok is not None else None
        if piece is None or token_id in tok.added_tokens:
            return self.text(token_id).encode("utf-8")
        if tok.byte_level:
            alphabet = _gpt2_byte_of()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        hexed = _HEX_BYTE.fullmatch(piece)  # SentencePiece byte fallback
        if hexed:
            return bytes([int(hexed.group(1), 16)])
        return self.text(token_id).encode("utf-8")


@dataclass(frozen=True)
class EchoedPrompt:
    """An echoed prompt's part of a completion's logprobs listing: its token ids and their logprobs (the first
    None), each with the alternatives the listing asked for."""

    token_ids: tuple[int, ...]
    logprobs: list

    @classmethod
    def of(cls, token_ids, prompt_logprobs: list | None, k: int) -> EchoedPrompt | None:
        """None without prompt logprobs (a request that did not echo them)."""
        if prompt_logprobs is None:
            return None
        return cls(tuple(token_ids), with_alternatives(prompt_logprobs, k))


def with_alternatives(prompt_logprobs: list, k: int) -> list:
    """Prompt logprobs (the first None) with at most k alternatives each: the engine computed as many as the
    request's largest listing asked for."""
    return [None if t is None else TokenLogprob(t.token_id, t.logprob, t.top[:k]) for t in prompt_logprobs]


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0


def chat_logprobs(choice: Completion, tokens: TokenText) -> dict | None:
    """OpenAI chat's `choices[].logprobs`, or None when the request did not ask for them."""
    if choice.logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokens.text(token_id), "logprob": _value(logprob), "bytes": tokens.bytes(token_id)}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in choice.logprobs], "refusal": None}


def completion_logprobs(choice: Completion, tokens: TokenText, echoed: EchoedPrompt | None = None) -> dict | None:
    """OpenAI completions' `choices[].logprobs`, or None when the request did not ask for them. `echoed`: the
    prompt's tokens, listed before the generated ones as OpenAI's legacy completions and vLLM list them (the first
    with a null logprob and null top_logprobs). Each `top_logprobs` entry holds the listed token itself, then its k
    most likely alternatives: OpenAI's legacy completions always return the sampled token's logprob there ("up to
    logprobs+1 elements"), and vLLM does (with logprobs 0, the token alone). Text offsets count characters from 0,
    each token's after the texts of the listed tokens before it (vLLM's count)."""
    if choice.logprobs is None:
        return None
    prompt = echoed.logprobs if echoed is not None else []
    listed = prompt + list(choice.logprobs)
    ids = (list(echoed.token_ids) if echoed is not None else []) + [t.token_id for t in choice.logprobs]
    texts = [tokens.text(i) for i in ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [None if t is None else _value(t.logprob) for t in listed],
            "top_logprobs": [None if t is None else {tokens.text(i): _value(lp) for i, lp in
                                                     ((t.token_id, t.logprob), *t.top)} for t in listed],
            "text_offset": offsets}


def plain_logprobs(choice: Completion, tokens: TokenText, echoed: EchoedPrompt | None = None) -> dict:
    """A plain line's `logprobs` and `cumulative_logprob` fields (none when it did not ask for them). `echoed`: the
    prompt's tokens, listed first as `prompt_logprobs` lists them (the first null); cumulative_logprob is the
    generated tokens' alone."""
    if choice.logprobs is None:
        return {}
    prompt = [None if t is None else _plain_entry(t, tokens) for t in (echoed.logprobs if echoed else [])]
    return {"logprobs": prompt + [_plain_entry(t, tokens) for t in choice.logprobs],
            "cumulative_logprob": _value(choice.cumulative_logprob)}


def plain_prompt_logprobs(prompt: list | None, tokens: TokenText) -> dict:
    """A plain line's `prompt_logprobs` field: null for the first token, then the generated tokens' entry shape
    (none when the line did not ask for them)."""
    if prompt is None:
        return {}
    return {"prompt_logprobs": [None if t is None else _plain_entry(t, tokens) for t in prompt]}


def vllm_prompt_logprobs(prompt: list | None, tokens: TokenText) -> list | None:
    """vLLM's OpenAI-server `prompt_logprobs`: per prompt token null (the first) or {token id: {"logprob",
    "decoded_token"}} for the token and its alternatives (None when the request did not ask for them)."""
    if prompt is None:
        return None
    out: list = []
    for t in prompt:
        if t is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": _value(t.logprob), "decoded_token": tokens.text(t.token_id)}}
        for i, lp in t.top:
            entry.setdefault(str(i), {"logprob": _value(lp), "decoded_token": tokens.text(i)})
        out.append(entry)
    return out


def _plain_entry(t: TokenLogprob, tokens: TokenText) -> dict:
    return {"token_id": t.token_id, "token": tokens.text(t.token_id), "logprob": _value(t.logprob),
            "top_logprobs": [{"token_id": i, "token": tokens.text(i), "logprob": _value(lp)} for i, lp in t.top]}
