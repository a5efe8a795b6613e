"""Counts with their noun (engine/counts.py), as every message and report writes them: never '1 tokens'."""
from __future__ import annotations

import pytest

from prefixrun.engine.counts import count, plural


@pytest.mark.parametrize("n, noun, plural_noun, want", [
    (0, "token", None, "0 tokens"), (1, "token", None, "1 token"), (2, "token", None, "2 tokens"),
    (2048, "request", None, "2,048 requests"), (1, "entry", "entries", "1 entry"),
    (3, "entry", "entries", "3 entries"), (1, "K/V block", None, "1 K/V block"),
])
def test_a_count_takes_its_noun_in_the_number_it_needs(n, noun, plural_noun, want):
    assert count(n, noun, plural_noun) == want


def test_plural_is_the_word_alone():
    assert (plural(1, "line"), plural(0, "line"), plural(7, "line")) == ("line", "lines", "lines")

