"""One request while it decodes: its state handle, generated tokens, detokenizer, stop rules and finish reason; and
how its decoding starts (`DecodingStarts`: what every sequence of an engine is built with)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prefixrun.engine.counts import count
from prefixrun.engine.grammar.compiler import UNCONSTRAINED
from prefixrun.engine.request import ModelProcessing, Request, SamplingParams
from prefixrun.engine.state.pools import StateHandle
from prefixrun.engine.step.logits_processors import RowProcessing


def _no_processing() -> RowProcessing:
    return RowProcessing(SamplingParams(), ())  # inactive: the stage leaves the row alone


@dataclass(eq=False)
class Sequence:
    request: Request
    handle: StateHandle
    detok: object | None  # a StreamDetokenizer, or None when the engine has no tokenizer (texts stay empty)
    max_context: int
    eos: frozenset = frozenset()
    tokens: list[int] = field(default_factory=list)
    stop_text: str | None = None  # the text cut before a stop string, once one appeared
    finish_reason: str | None = None  # "stop" or "length" once done
    error: str | None = None  # set when it ended because it cannot go on (its grammar broke): no completion
    origin: object = None  # the runner's record of how the prompt state was made (for accounting)
    grammar: object = UNCONSTRAINED  # structured output: engine/grammar/compiler.py GrammarState (masks, stop)
    sample: int = 0  # which of its request's sequences this is (n samples): it draws with seed + sample
    processing: RowProcessing = field(default_factory=_no_processing)  # its part of the logits-processing stage
    logprobs: list = field(default_factory=list)  # TokenLogprobs per generated token, when the request wants them
    cumulative_logprob: float = 0.0  # the sum of those tokens' logprobs
    stop_searched: int = 0  # characters of the text searched for stop strings so far
    longest_stop: int = field(init=False, default=0)

    def __post_init__(self):
        self.longest_stop = max(map(len, self.request.sampling.stop), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return max(0, min(self.request.sampling.max_tokens - len(self.tokens),
                          self.max_context - 1 - self.handle.length))

    def accept(self, tok: int, length: int | None = None):
        """Append a sampled token and decide whether the request is done (eos, stop id/string, a grammar that is
        complete, length: a reply cut by max_tokens mid-grammar ends "length", as in vLLM). `length`:
        the state length of the step that sampled it (default: the handle's; a pipelined step may have advanced
        the handle past it already)."""
        sp = self.request.sampling
        length = self.handle.length if length is None else length
        if not self.processing.permits(tok):
            self.error = (f"no token may come at output position {len(self.tokens)}: allowed_token_ids allows none "
                          "that min_tokens, bad_words, the structured output or the model's suppressed tokens let "
                          "through")
            self.finish_reason = "stop"
            return
        ends = (tok in self.eos and not sp.ignore_eos) or tok in sp.stop_token_ids
        if ends and not self.grammar.allows(tok):
            # the bans left the grammar no token (it allows only "o" after "n" of "no", bad_words ban it) and the
            # draw fell back on an end the grammar does not allow: "n" would end as a complete reply
            self.error = (f"no token may come at output position {len(self.tokens)}: the structured output allows "
                          "none that min_tokens, bad_words, allowed_token_ids or the model's suppressed tokens let "
                          "through")
            self.finish_reason = "stop"
            return
        self.tokens.append(tok)
        self.processing.accepted(tok)
        if ends:
            if sp.include_stop_str_in_output and self.detok is not None:
                self.detok.feed(tok)  # vLLM: the token that ended the reply is in its text only with this flag
            self.finish_reason = "stop"
            return
        complete = self.grammar.accept(tok)
        if complete and self.grammar.failure is not None:
            self.error, self.finish_reason = self.grammar.failure, "stop"
            return
        if self.detok is not None:
            self.detok.feed(tok)
            if sp.stop and len(self.tokens) <= sp.min_tokens:
                # vLLM: the text of the first min_tokens tokens is never searched, so the output keeps them
                self.stop_searched = len(self.detok.text)
            elif sp.stop:
                text = self.detok.text
                # a stop string not found in the text already searched can only end in the new text: searching
                # its tail keeps a long reply with many stop strings linear in its length
                start = max(0, self.stop_searched - self.longest_stop + 1)
                self.stop_searched = len(text)
                hits = [(at, -len(s)) for s in sp.stop if (at := text.find(s, start)) >= 0]
                if hits:
                    # the earliest stop string (the longest of those starting there) ends the text: before it, or
                    # after it with include_stop_str_in_output
                    at, minus_length = min(hits)
                    self.stop_text = text[:at - minus_length if sp.include_stop_str_in_output else at]
                    self.finish_reason = "stop"
                    return
        if complete:
            if len(self.tokens) < sp.min_tokens:  # the grammar admits nothing more, min_tokens asks for more
                self.error = (f"the structured output was complete after {count(len(self.tokens), 'token')}, before "
                              f"min_tokens ({sp.min_tokens}): no token may follow it, so the reply cannot be as long "
                              "as asked")
            self.finish_reason = "stop"
            return
        if len(self.tokens) >= sp.max_tokens or length + 1 >= self.max_context:
            self.finish_reason = "length"

    def ends_after_pending(self) -> bool:
        """Whether the one token in flight (sampled from the handle's current state, not yet accepted) ends the
        request by its length rules, whatever token it is: then no step after it needs to be queued."""
        return len(self.tokens) + 1 >= self.request.sampling.max_tokens or self.handle.length + 1 >= self.max_context

    def text(self) -> str:
        """The final text (call once, when done): cut at a stop string, or everything decoded."""
        if self.detok is None:
            return ""
        if self.stop_text is not None:
            return self.stop_text
        self.detok.flush()  # bytes held back for an incomplete character
        return self.detok.text


@dataclass(frozen=True)
class DecodingStarts:
    """How a request's decoding starts: a detokenizer where there is a tokenizer (texts stay empty without one), the
    model's context, its end-of-sequence ids, the request's grammar (compiled and checked by Engine.run) and its
    part of the logits-processing stage (with generation_config's suppressed tokens)."""

    tokenizer: object | None
    max_context: int
    eos: frozenset
    grammars: object  # engine/grammar/compiler.py GrammarCompiler
    processing: ModelProcessing = ModelProcessing()  # what generation_config adds to every request's

    def sequence(self, request: Request, handle: StateHandle, origin: object, sample: int) -> Sequence:
        detok = None
        if self.tokenizer is not None:
            from prefixrun.engine.load.tokenizer import StreamDetokenizer

            detok = StreamDetokenizer(self.tokenizer, request.sampling.skip_special_tokens,
                                      request.sampling.spaces_between_special_tokens)
        sp = request.sampling
        stop_ids = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else tuple(sorted(self.eos)))
        processing = RowProcessing(sp, request.prompt_token_ids, stop_ids=stop_ids, eos=tuple(sorted(self.eos)),
                                   bad_words=request.bad_words_token_ids, model=self.processing)
        return Sequence(request, handle, detok, self.max_context, self.eos, origin=origin, sample=sample,
                        grammar=self.grammars.start(sp.structured), processing=processing)
