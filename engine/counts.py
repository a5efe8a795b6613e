"""Counts as people read them: '1 token', '2,048 tokens', '1 entry', '3 entries'. The one way every message and
report writes a count with its noun, so none says '1 tokens'."""
from __future__ import annotations


def plural(count: int, word: str) -> str:
    """`word` as `count` of it needs: 1 request, 2 requests, 0 requests."""
    return word if count == 1 else word + "s"


def count(n: int, noun: str, plural_noun: str | None = None) -> str:
    """'1 request', '2,048 requests'; `plural_noun` where adding an s is wrong ('entry', 'entries')."""
    return f"{n:,} {noun if n == 1 else plural_noun or plural(n, noun)}"
