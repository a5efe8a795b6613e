"""Structured output specs compiled against one model's tokenizer, and each constrained sequence's grammar state.

The grammar engine is llguidance (Rust; the engine behind vLLM's "guidance" backend), chosen over xgrammar for its
dependencies and its compile time, though xgrammar's masks are faster per token (docs/PERFORMANCE.md, "Structured
output", has the measurements and the command). llguidance is one abi3 wheel per platform with no Python
dependencies, where xgrammar requires torch, triton and transformers at run time, which prefixrun otherwise never
needs; llguidance compiles a schema 50-100x faster (each distinct schema of a batch is compiled once) and fills a
batch's masks on its own threads, without the GIL. Its costly case is a string with maxLength over a large
vocabulary (about a millisecond per row and token while inside one).

Building llguidance's view of a tokenizer takes seconds for a 150k vocabulary, mostly holding the GIL: it is made
for the first constrained request, never for runs without one, and `prepare_tokenizer` starts it on a thread as
soon as such a request is known (the CLI calls it while the weights load, from the lines it reads ahead). A compiled spec is kept as a template matcher (at most TEMPLATES_KEPT of
them, least recently used out) and each sequence gets a copy of it, so a schema shared by many lines is compiled
once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from prefixrun.engine.grammar.spec import StructuredOutput, one_line
from prefixrun.engine.request import InvalidRequest
from prefixrun.engine.run.background import BackgroundTask

TEMPLATES_KEPT = 256

# llguidance tokenizers made or being made, by (id of the tokenizer, vocabulary, eos ids): (tokenizer, its Future)
_TOKENIZERS: dict[tuple, tuple[object, Future]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def prepare_tokenizer(tokenizer, vocab_size: int, eos_token_ids=()) -> None:
    """Start making llguidance's view of `tokenizer` on a thread, for the GrammarCompiler of the same tokenizer,
    vocabulary and end-of-sequence ids to take when its first constrained request arrives. Returns at once; made
    once per process and arguments."""
    _tokenizer_future(tokenizer, vocab_size, eos_token_ids)


def _tokenizer_future(tokenizer, vocab_size: int, eos_token_ids) -> Future:
    vocab = max(vocab_size, tokenizer.vocab_size)
    eos = sorted(eos_token_ids)
    key = (id(tokenizer), vocab, tuple(eos))
    with _TOKENIZERS_LOCK:
        known = _TOKENIZERS.get(key)
        if known is not None and known[0] is tokenizer:
            return known[1]
        future: Future = Future()
        _TOKENIZERS[key] = (tokenizer, future)

    def make(stop):
        try:
            import llguidance

            future.set_result(llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab, eos_token=eos or None))
        except BaseException as exc:  # handed to whoever waits for it
            future.set_exception(exc)

    BackgroundTask("prefixrun-llguidance-tokenizer", make)  # its error goes to the future, for whoever waits
    return future


class Unconstrained:
    """A sequence without structured output: every token allowed, nothing to track (the do-nothing grammar)."""

    constrained = False
    matcher = None

    failure = None

    def accept(self, token: int) -> bool:
        return False

    def allows(self, token: int) -> bool:
        return True


UNCONSTRAINED = Unconstrained()


class GrammarState:
    """One sequence's place in its grammar: the tokens it has taken so far decide the mask of its next one."""

    constrained = True

    def __init__(self, matcher):
        self.matcher = matcher  # an llguidance LLMatcher, advanced by `accept`

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; True once the grammar is complete and admits nothing more (the reply is
        whole: the sequence stops), or once it is broken (a token the mask did not allow, which masking rules
        out; the matcher then admits nothing either)."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (an end-of-sequence id: only where the reply may end)."""
        return self.matcher.validate_tokens([token]) == 1

    @property
    def failure(self) -> str | None:
        """Why the grammar broke mid-reply (a token the mask did not allow, or a limit of the grammar engine that
        the spec's compiled form only meets once decoding reaches it), as the line's one-line error; None while
        it holds."""
        if not self.matcher.is_error():
            return None
        reason = self.matcher.get_error().split("\n", 1)[0]
        return (f"the structured output spec broke mid-reply: {one_line(reason)} (the spec is over the grammar "
                "engine's limits, or min_tokens, bad_words or allowed_token_ids ban every token it allows)")


class GrammarCompiler:
    """Compiles StructuredOutputs for one model: its tokenizer, its logits' width, its end-of-sequence ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids=()):
        """`tokenizer`: engine/load/tokenizer.py's Tokenizer (None: structured output cannot run);
        `vocab_size`: the width of the model's logits (ids the tokenizer never produces are never allowed);
        `eos_token_ids`: the ids that end a sequence, allowed where the grammar may end."""
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._templates: OrderedDict[StructuredOutput, object] = OrderedDict()

    @property
    def mask_words(self) -> int:
        """int32 words per row of a token bitmask."""
        return (self.vocab_size + 31) // 32

    def start(self, spec: StructuredOutput | None):
        """The grammar state of a new sequence under `spec` (UNCONSTRAINED for None); InvalidRequest when the
        spec cannot be compiled for this model."""
        if spec is None:
            return UNCONSTRAINED
        return GrammarState(self.template(spec).deep_copy())

    def template(self, spec: StructuredOutput):
        """The compiled matcher of `spec` before any token (cached); InvalidRequest if it does not compile."""
        template = self._templates.get(spec)
        if template is not None:
            self._templates.move_to_end(spec)
            return template
        import llguidance

        try:
            grammar = spec.grammar
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"the structured output spec cannot be compiled: {one_line(exc)}") from None
        template = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise InvalidRequest(f"the structured output spec cannot be compiled: {one_line(template.get_error())}")
        template.compute_bitmask()  # a grammar that admits no text at all shows only once a mask is asked for
        if template.is_error():
            reason = template.get_error().split("\n", 1)[0]
            raise InvalidRequest(f"the structured output spec admits no reply with this model's tokens ({reason})")
        self._templates[spec] = template
        if len(self._templates) > TEMPLATES_KEPT:
            self._templates.popitem(last=False)
        return template

    def _llguidance_tokenizer(self):
        if self._ll_tokenizer is None:
            if self._tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer (tokenizer.json), which this "
                                     "model directory lacks")
            self._ll_tokenizer = _tokenizer_future(self._tokenizer, self.vocab_size, self._eos).result()
        return self._ll_tokenizer


