"""Stop strings as Sequence.accept applies them: the earliest stop string ends the text (one spanning tokens too),
none in the first min_tokens tokens' text (vLLM's rule), and a long reply with many stop strings costs time linear in its length."""
from __future__ import annotations

import time

from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.step.sequence import Sequence


class _Detok:
    """Each token's text from a table, appended as StreamDetokenizer appends it."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces, self.text = pieces, ""

    def feed(self, token: int) -> None:
        self.text += self.pieces[token]

    def flush(self) -> None:
        pass


class _Handle:
    length = 0


def _sequence(pieces: dict[int, str], **sampling) -> Sequence:
    sp = SamplingParams(**{"max_tokens": 10**6, **sampling})
    return Sequence(Request("r", [1], sp), _Handle(), _Detok(pieces), 10**9)


def _feed(seq: Sequence, tokens) -> Sequence:
    for token in tokens:
        if not seq.done:
            seq.accept(token)
    return seq


PIECES = {1: "ab", 2: "cd", 3: "e", 4: "x"}


def test_the_earliest_stop_string_ends_the_text_even_across_tokens():
    seq = _feed(_sequence(PIECES, stop=("bcde", "cd", "zz")), [4, 1, 2, 3, 4])
    assert seq.finish_reason == "stop" and seq.text() == "xab"  # "cd" is whole before "bcde" is
    seq = _feed(_sequence(PIECES, stop=("dex",), include_stop_str_in_output=True), [1, 1, 2, 3, 4, 1])
    assert seq.text() == "ababcdex"


def test_the_text_of_the_first_min_tokens_tokens_is_never_searched_for_stop_strings():
    # vLLM's rule (its detokenizer's min_tokens offset): a stop string inside the first min_tokens tokens' text
    # never ends the output, so the text keeps them; one ending in a later token does, also one that begins in
    # that text and ends after it. Searched from the start at the min_tokens-th token, "ab" in the first token
    # would cut the text to "" with three tokens generated.
    seq = _feed(_sequence(PIECES, stop=("ab",), min_tokens=3), [1, 2, 4, 4, 1, 3])
    assert seq.finish_reason == "stop" and seq.text() == "abcdxx" and len(seq.tokens) == 5
    seq = _feed(_sequence(PIECES, stop=("ab",), min_tokens=3), [1, 2, 1, 4, 3])
    assert not seq.done and seq.text() == "abcdabxe"  # the third token is still protected
    seq = _feed(_sequence(PIECES, stop=("dx",), min_tokens=2), [1, 2, 4, 3])
    assert seq.text() == "abc" and len(seq.tokens) == 3  # across the boundary, as vLLM's overlap finds it
    seq = _feed(_sequence(PIECES, stop=("e",), min_tokens=0), [3, 1])
    assert seq.text() == "" and len(seq.tokens) == 1


def test_many_stop_strings_over_a_long_reply_take_linear_time():
    # 200 stop strings that never match over a 24,000-character reply: searching the whole text at every token
    # took seconds (quadratic in the length); searching what each token added takes a fraction of one
    seq = _sequence({5: "ab c"}, stop=tuple(f"zzqq{i}" for i in range(200)))
    t0 = time.perf_counter()
    _feed(seq, [5] * 6000)
    assert not seq.done and time.perf_counter() - t0 < 2.0
