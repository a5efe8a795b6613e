"""The engine's request layer: a prompt as a request gives it (text, token ids or a chat) -> a runnable Request.

The CLI reads lines into these prompt types and formats results; tokenizing, rendering chats through the model's
template, and the vocabulary and context checks happen here, for every caller alike. A prompt that cannot run
raises InvalidRequest with a message for the person who wrote it (the CLI turns it into an error record).

Size limit before tokenizing: no token covers more characters than the longest entry of the vocabulary (added
tokens included; for byte-level vocabularies an entry's characters are bytes, and a character is at least one
byte). So a text of more than `context × longest` characters needs more tokens than the context holds and is
refused without being tokenized: tokenizing a 10 MB line costs GBs of memory for an answer known in advance. A
normalizer can shorten text before tokenizing; Unicode composition (NFC/NFKC) merges at most 3 characters into
one (Hangul jamo), so with a normalizer the bound is 4 × larger. (A normalizer that deletes characters outright,
e.g. stripping control characters, can in principle make a refused text fit; such a text is megabytes of
characters the model would never see.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixrun.engine.counts import count
from prefixrun.engine.errors import InvalidOption
from prefixrun.engine.load.messages import (check_documents, check_messages, check_template_kwargs, check_tools,
                                            unread_template_kwargs)
from prefixrun.engine.request import InvalidRequest, Request, SamplingParams, describe_value

if TYPE_CHECKING:
    from prefixrun.engine.load.tokenizer import Tokenizer

# the template variables a request's reasoning_effort sets (cli/prompt_options.py)
REASONING_VARIABLES = ("reasoning_effort", "enable_thinking")
# marks a message's name in a trial render (PromptEncoder._check_message_keys_written)
_NAME_MARK = "zqxname"
# a message's keys that need not reach the prompt: its role and content (checked themselves), its calls and the id of
# the call a tool message answers (linking what the order links), and its name (checked with a mark)
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})
_MESSAGE_KEY_ADVICE = {"name": "put the name into the content, or leave it out",
                       "audio": "prefixrun runs text models: give the transcript as content"}
# Unicode composition shortens text by at most this factor (3 Hangul jamo -> 1 syllable), rounded up.
NORMALIZER_SHRINK_BOUND = 4


@dataclass(frozen=True)
class Truncation:
    """vLLM's truncate_prompt_tokens: keep the last `tokens` of the prompt (`side` "right": the first), -1 for as
    many as the context holds with room for the reply (its given max_tokens, else one token)."""

    tokens: int
    side: str = "left"

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not (self.tokens >= 1 or
                                                                                     self.tokens == -1):
            raise InvalidRequest(f"truncate_prompt_tokens must be a positive integer or -1, got "
                                 f"{describe_value(self.tokens)}")
        if self.side not in ("left", "right"):
            raise InvalidRequest(f'truncation_side must be "left" or "right", got {describe_value(self.side)}')

    def apply(self, ids: list[int], context_tokens: int, room: int = 1) -> list[int]:
        # a reply that no prompt leaves room for keeps the most a prompt may have (its max_tokens is refused)
        keep = context_tokens - (room if room < context_tokens else 1) if self.tokens == -1 else self.tokens
        return ids[-keep:] if self.side == "left" else ids[:keep]


@dataclass(frozen=True)
class TextPrompt:
    """Text tokenized as is (with whatever BOS the tokenizer's post-processor adds, unless add_special_tokens is
    false)."""

    text: str
    add_special_tokens: bool = True
    truncation: Truncation | None = None


@dataclass(frozen=True)
class TokenPrompt:
    """Token ids given by the request; only checked against the vocabulary and the context."""

    token_ids: tuple[int, ...]
    truncation: Truncation | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered through the model's chat template, as vLLM's chat completions render it.

    `add_generation_prompt` None means "not given": true, unless `continue_final_message` is set (then the last
    message is left open for the model to continue, which a generation prompt would close). Both true is an
    error, as in vLLM. `template_kwargs` become extra template variables (e.g. enable_thinking) and win over the
    engine-wide ones (`PromptEncoder(chat_template_kwargs=...)`, the command line's). `documents` are the
    template's `documents` variable (RAG templates); `add_special_tokens` adds the tokenizer's BOS on top of what the
    template wrote (vLLM's default for chats: false).
    """

    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    documents: list[dict] | None = None
    reasoning_effort: str | None = None  # the request's, already among template_kwargs (a template must read it)
    add_special_tokens: bool = False
    truncation: Truncation | None = None

    def __post_init__(self):
        check_messages(self.messages)
        if self.tools is not None:
            check_tools(self.tools)
        check_template_kwargs(self.template_kwargs)
        if self.documents is not None:
            check_documents(self.documents)
        for name in ("add_generation_prompt", "continue_final_message"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be true or false, got {describe_value(value)}")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both be true: one "
                                 "starts a new assistant message, the other continues the last one")

    @property
    def generation_prompt(self) -> bool:
        """Whether the template appends the header of a new assistant message."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


Prompt = TextPrompt | TokenPrompt | ChatPrompt


class PromptEncoder:
    """Prompts -> token ids for one model: rendering, tokenizing, and the checks that make a prompt runnable."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, context_tokens: int,
                 chat_template_kwargs: dict[str, Any] | None = None):
        """`vocab_size`: the model's embedding rows (every id must be below it); `context_tokens`: its maximum
        positions (a prompt must leave room for one generated token); `chat_template_kwargs`: template variables
        for every chat (a request's own win per key)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_tokens = context_tokens
        self.chat_template_kwargs = dict(check_template_kwargs(chat_template_kwargs or {}, "--chat-template-kwargs"))
        if self.chat_template_kwargs:
            if not tokenizer.has_chat_template:
                raise InvalidOption(f"--chat-template-kwargs: {tokenizer.template_source} has no chat template, so "
                                    "its variables would change nothing")
            unread = unread_template_kwargs(self.chat_template_kwargs, tokenizer.variables_read_by_any_template(),
                                            tokenizer.template_source, "--chat-template-kwargs")
            if unread:
                raise InvalidOption(unread)
        shrink = NORMALIZER_SHRINK_BOUND if tokenizer.has_normalizer else 1
        self.max_prompt_chars = context_tokens * tokenizer.max_token_chars * shrink

    def request(self, custom_id: str, index: int, prompt: Prompt, sampling: SamplingParams, *,
                max_tokens_key: str | None = None) -> Request:
        """A Request ready for the engine; InvalidRequest if the prompt cannot run on this model. A max_tokens of
        None becomes the rest of the context after the prompt (vLLM's default for chat requests). `max_tokens_key`:
        the key the request gave its max_tokens under (None: a default, which the context bounds): a given
        max_tokens that the context left after the prompt cannot hold is an error, as vLLM and OpenAI refuse it
        (its reply would end early with finish_reason "length", as if max_tokens had been reached)."""
        given = sampling.max_tokens if max_tokens_key is not None else None
        ids = self.encode(prompt, room=given or 1)
        if given is not None and given > self.context_tokens - len(ids):
            raise InvalidRequest(f"{max_tokens_key} {given} is too large: the model's context is "
                                 f"{count(self.context_tokens, 'token')} and the prompt has {len(ids)}, which leaves "
                                 f"room for {count(self.context_tokens - len(ids), 'new token')}")
        if sampling.max_tokens is None:
            sampling = dataclasses.replace(sampling, max_tokens=self.context_tokens - len(ids))
        self._check_token_fields(sampling)
        return Request(custom_id, ids, sampling, index, bad_words_token_ids=self.bad_words_ids(sampling.bad_words))

    def _check_token_fields(self, sampling: SamplingParams) -> None:
        """The token ids a request names (logit_bias keys, allowed_token_ids, stop_token_ids) must be in the model's
        vocabulary, as vLLM checks the first two: an id past it would index past the logits, or never match."""
        for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("allowed_token_ids", sampling.allowed_token_ids or ()),
                          ("stop_token_ids", sampling.stop_token_ids)):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise InvalidRequest(f"{name} names token id {describe_value(outside[0])}, outside the model's "
                                     f"vocabulary of {self.vocab_size}")

    def bad_words_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of bad_words: each word (leading spaces stripped) alone, and with one leading
        space where that makes another first token of the same length (a word inside text)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                raise InvalidRequest(f"bad word {describe_value(word)} is empty after tokenization")
            out.append(alone)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        outside = [t for w in out for t in w if t >= self.vocab_size]
        if outside:
            raise InvalidRequest(f"bad_words tokenize to token id {outside[0]}, outside the model's vocabulary of "
                                 f"{self.vocab_size}")
        return tuple(out)

    def encode(self, prompt: Prompt, room: int = 1) -> list[int]:
        """The prompt's token ids (truncated if it asks for it, with `room` new tokens left for a truncation of
        -1), checked against the vocabulary and the context."""
        if isinstance(prompt, TokenPrompt):
            ids = list(prompt.token_ids)
        elif isinstance(prompt, ChatPrompt):
            # the template wrote the special tokens; add_special_tokens adds the tokenizer's on top
            ids = self.tokenizer.encode(self._checked_length(self.render(prompt), "the rendered chat", prompt),
                                        add_special_tokens=prompt.add_special_tokens)
        elif isinstance(prompt, TextPrompt):
            ids = self.tokenizer.encode(self._checked_length(prompt.text, "the prompt", prompt),
                                        add_special_tokens=prompt.add_special_tokens)
        else:
            raise TypeError(f"not a prompt: {type(prompt).__name__}")
        if prompt.truncation is not None:
            ids = prompt.truncation.apply(ids, self.context_tokens, room)
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenization")
        if max(ids) >= self.vocab_size:  # checked in C; the first offending id is looked for only then
            out_of_vocab = next(t for t in ids if t >= self.vocab_size)
            raise InvalidRequest(f"the prompt contains token id {describe_value(out_of_vocab)}, outside the model's "
                                 "vocabulary of "
                                 f"{self.vocab_size}")
        if len(ids) >= self.context_tokens:
            raise InvalidRequest(f"prompt of {count(len(ids), 'token')} does not fit the model's context of "
                                 f"{count(self.context_tokens, 'token')} (one position is needed for the reply)")
        return ids

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text of a chat, as transformers' apply_chat_template(tokenize=False) renders it."""
        if prompt.reasoning_effort is not None and not self.tokenizer.template_reads(
                prompt.tools).intersection(REASONING_VARIABLES):
            raise InvalidRequest(f"reasoning_effort: the chat template of {self.tokenizer.template_source} reads "
                                 "neither reasoning_effort nor enable_thinking, so it would change nothing (the "
                                 "model does not reason)")
        own = set(prompt.template_kwargs)
        if prompt.reasoning_effort is not None:  # its variables: the template reads one of them (checked above)
            own.difference_update(REASONING_VARIABLES)
        unread = unread_template_kwargs(own, self.tokenizer.template_reads(prompt.tools),
                                        self.tokenizer.template_source, "chat_template_kwargs")
        if unread:
            raise InvalidRequest(unread)
        text = self._render(prompt, prompt.messages)
        self._check_message_keys_written(prompt, text)
        return text

    def _render(self, prompt: ChatPrompt, messages: list[dict]) -> str:
        return self.tokenizer.render_chat(
            messages, add_generation_prompt=prompt.generation_prompt, tools=prompt.tools,
            continue_final_message=prompt.continue_final_message, documents=prompt.documents,
            **{**self.chat_template_kwargs, **prompt.template_kwargs})

    def _check_message_keys_written(self, prompt: ChatPrompt, text: str) -> None:
        """A message key that never reaches the prompt would change nothing: InvalidRequest, not a prompt without it.
        A `name` (OpenAI's: tells participants of one role apart) must be written for its message: one render with
        each name marked finds those written as they are; a name whose mark is missing counts as written only if
        the prompt without it differs (a template that changes or tests it). A tool message's name, like its
        tool_call_id, says which call it answers, which its place says too. Any other key (refusal, audio, a
        misspelled one) must be one the template reads off some value, or change the prompt (a message written
        whole, with tojson)."""
        messages = prompt.messages
        named = [i for i, message in enumerate(messages) if message.get("name") and message["role"] != "tool"]
        marked = [{**message, "name": f"{_NAME_MARK}{i}{_NAME_MARK}"} if i in named else message
                  for i, message in enumerate(messages)]
        try:
            shown = self._render(prompt, marked) if named else ""
        except InvalidRequest:  # a template that checks names: each is tried alone below
            shown = ""
        read = self.tokenizer.template_keys(prompt.tools)
        for i, message in enumerate(messages):
            # null or empty: nothing to lose (a reply pasted back whole carries "refusal": null, "annotations": [])
            keys = [key for key in message if key not in _MESSAGE_KEYS and message[key] not in (None, "", [], {})
                    and key not in read]
            if i in named and f"{_NAME_MARK}{i}{_NAME_MARK}" not in shown:
                keys.insert(0, "name")
            for key in keys:
                if self._changes_nothing(prompt, text, i, key):
                    shown = key if key.isidentifier() else describe_value(key)  # the user's key, as JSON writes it
                    raise InvalidRequest(f"messages[{i}].{shown}: the chat template of "
                                         f"{self.tokenizer.template_source} does not write this message's {shown} into "
                                         f"the prompt, so it would change nothing; "
                                         f"{_MESSAGE_KEY_ADVICE.get(key, 'leave it out')}")

    def _changes_nothing(self, prompt: ChatPrompt, text: str, i: int, key: str) -> bool:
        """Whether the chat renders as `text` without messages[i][key] (a template that needs it: it changes)."""
        without = [{k: v for k, v in message.items() if k != key} if j == i else message
                   for j, message in enumerate(prompt.messages)]
        try:
            return self._render(prompt, without) == text
        except InvalidRequest:
            return False

    def _checked_length(self, text: str, what: str, prompt: Prompt) -> str:
        # a prompt to be truncated may be longer (it is bounded by the line's byte limit)
        if len(text) > self.max_prompt_chars and prompt.truncation is None:
            raise InvalidRequest(
                f"{what} has {len(text)} characters: more than the model's context of {self.context_tokens} "
                f"tokens can hold (at most {self.max_prompt_chars} characters); it was not tokenized")
        return text
