"""Text <-> token ids for a Hugging Face model directory, rendered and encoded exactly as transformers does it.

Prefix reuse only works if prefixrun produces the same token ids a model was trained and evaluated with, so this
module follows transformers 5.x behaviour wherever it is observable:

- `tokenizer.json` (the `tokenizers` serialization) is the only vocabulary format read. Its post-processor alone
  decides whether `encode` adds a BOS: transformers 5 drops `add_bos_token` from tokenizer_config.json whenever a
  tokenizer.json exists, so honouring that flag here would add a BOS transformers never adds.
- Chat templates are rendered in the same sandboxed jinja2 environment (engine/load/chat_template.py, imported at
  the first chat a run renders) with the same variables (messages, tools, documents, add_generation_prompt, every
  named special token, extra kwargs).
- A rendered chat is encoded without adding special tokens: the template already wrote them (no double BOS).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.messages import check_messages, check_tools
from prefixrun.engine.request import InvalidRequest, ModelProcessing, SamplingDefaults

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
EXTRA_CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"

# Named special tokens as transformers lists them; each one that is set is passed to the chat template.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REPLACEMENT_CHARACTER = "\ufffd"


class Tokenizer:
    """A model's tokenizer and chat template. Build it with `Tokenizer.from_model_dir`."""

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str],
                 chat_templates: dict[str, str], template_source: str):
        """`special_tokens` maps template variable names (bos_token, image_token, ...) to token strings;
        `chat_templates` maps template names ("default", "tool_use", ...) to jinja source."""
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self._template_source = template_source
        self._compiled_templates: dict = {}  # name -> engine/load/chat_template.py ChatTemplate
        # name -> why it does not compile: a broken template is compiled once, not once per chat line
        self._template_errors: dict[str, str] = {}

    @classmethod
    def from_model_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json (optional) and the chat template files of a model directory.

        Chat template precedence follows transformers: chat_template.jinja (plus any additional_chat_templates/
        *.jinja) replaces whatever tokenizer_config.json holds; a config template given as a list of
        {name, template} becomes a set of named templates.
        """
        path = Path(path)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file}: not found; prefixrun needs the fast-tokenizer file "
                                 f"{TOKENIZER_FILE} in the model directory")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for malformed files
            raise ModelLoadError(f"{tokenizer_file}: cannot be loaded by the tokenizers library: {exc}") from exc
        # transformers turns off any truncation/padding stored in tokenizer.json unless asked for it per call.
        backend.no_truncation()
        backend.no_padding()

        config = _read_json_object(path / TOKENIZER_CONFIG_FILE, missing_ok=True)
        special_tokens = _special_tokens_of(config, path / TOKENIZER_CONFIG_FILE)
        if "added_tokens_decoder" not in config:
            # Older repositories keep their special tokens in special_tokens_map.json instead.
            legacy_map_file = path / SPECIAL_TOKENS_MAP_FILE
            legacy = _special_tokens_of(_read_json_object(legacy_map_file, missing_ok=True), legacy_map_file)
            special_tokens.update(legacy)
        _register_missing_special_tokens(backend, special_tokens.values())

        chat_templates, template_source = _chat_templates_of(path, config)
        return cls(backend, special_tokens, chat_templates, template_source)

    # ---- plain text -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, whatever tokenizer.json's post-processor adds (BOS)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def to_json(self) -> str:
        """The vocabulary as tokenizer.json text (added tokens included), for libraries that read that format."""
        return self._backend.to_str()

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary entry of an id as tokenizer.json spells it (byte-level: one character per byte)."""
        return self._backend.id_to_token(token_id)

    @cached_property
    def byte_level(self) -> bool:
        """Whether vocabulary entries spell bytes in GPT-2's byte-to-character alphabet (a ByteLevel decoder)."""
        return type(self._backend.decoder).__name__ == "ByteLevel"

    @cached_property
    def added_tokens(self) -> dict[int, str]:
        """The added tokens (special tokens among them): id -> the token's text."""
        return {token_id: token.content for token_id, token in self._backend.get_added_tokens_decoder().items()}

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The added tokens marked special (the ones skip_special_tokens leaves out of a text)."""
        return frozenset(i for i, token in self._backend.get_added_tokens_decoder().items() if token.special)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of (normalized) text one token can cover: its longest vocabulary entry, added
        tokens included. Byte-level entries spell one byte per character, and a character is at least a byte."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def has_normalizer(self) -> bool:
        """Whether text is normalized (which may shorten it) before it is split into tokens."""
        return self._backend.normalizer is not None

    @cached_property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce, added tokens included.

        This is the bound a model's embedding must cover. (transformers' `vocab_size` excludes added tokens;
        its `len(tokenizer)` is what this matches when ids have no gaps.)
        """
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def bos_token_id(self) -> int | None:
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_token_id("pad_token")

    def _special_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    # ---- chat ---------------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template_text(self) -> str:
        """The source of every chat template the model has (to tell which reply formats it asks for)."""
        return "\n".join(self._chat_templates.values())

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt text of a conversation, as transformers' `apply_chat_template(..., tokenize=False)`.

        `extra` becomes template variables (e.g. enable_thinking=False) and overrides special-token variables of
        the same name, as in transformers. With `continue_final_message` the text ends right after the last
        message's content (no end-of-turn tokens), for the model to continue it. Invalid messages, or a template
        that refuses them (raise_exception), raise InvalidRequest.
        """
        check_messages(messages)
        if tools is not None:
            check_tools(tools)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both be true")
        from prefixrun.engine.load import chat_template

        template = self._template_for(tools)
        if tools and "tools" not in template.reads:
            raise InvalidRequest(f"the chat template of {self._template_source} does not read tools, so they would "
                                 "not reach the prompt: describe the functions in the messages, or leave tools out")
        if extra.get("documents") is not None and "documents" not in template.reads:
            raise InvalidRequest(f"the chat template of {self._template_source} does not read documents, so they "
                                 "would not reach the prompt: put them into the messages")
        if continue_final_message:
            messages = _tag_final_message(messages)
        variables = {**self._special_tokens, **extra}
        variables.setdefault("documents", None)
        try:
            rendered = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       **variables)
        except InvalidRequest:
            raise
        except chat_template.RENDER_ERRORS as exc:
            raise InvalidRequest(f"the chat template of {self._template_source} cannot render these "
                                 f"messages: {type(exc).__name__}: {exc}") from exc
        return _cut_after_final_message(rendered) if continue_final_message else rendered

    def encode_chat(self, messages: list[dict], **kw: Any) -> list[int]:
        """Token ids of a rendered conversation. Special tokens are not added again: the template wrote them,
        and transformers' apply_chat_template(tokenize=True) does not add them either (no double BOS)."""
        return self.encode(self.render_chat(messages, **kw), add_special_tokens=False)

    @property
    def template_source(self) -> str:
        """Where the chat templates come from (for messages)."""
        return self._template_source

    def template_reads(self, tools: list[dict] | None = None) -> frozenset[str]:
        """The variables the chat template used for a chat with `tools` reads from its caller."""
        return self._template_for(tools).reads

    def template_keys(self, tools: list[dict] | None = None) -> frozenset[str]:
        """The attribute and item names the chat template used for a chat with `tools` reads off any value."""
        return self._template_for(tools).keys

    def variables_read_by_any_template(self) -> frozenset[str]:
        """The variables one of the model's chat templates (that compiles) reads from its caller: the names an
        engine-wide template variable may have (a chat with tools may be rendered with another template)."""
        reads: set[str] = set()
        for name in self._chat_templates:
            try:
                reads.update(self._compiled(name).reads)
            except InvalidRequest:  # a template that does not compile fails its chats with its own error
                pass
        return frozenset(reads)

    def _template_for(self, tools: list[dict] | None):
        """The compiled template to use; with several named templates, "tool_use" when tools are given and it
        exists, else "default" (transformers' choice)."""
        if not self._chat_templates:
            raise InvalidRequest(f"{self._template_source} has no chat template; send a plain `prompt` "
                                 "instead of `messages`")
        if tools is not None and "tool_use" in self._chat_templates:
            name = "tool_use"
        elif "default" in self._chat_templates:
            name = "default"
        else:
            raise InvalidRequest(f"{self._template_source} has several chat templates "
                                 f"({', '.join(sorted(self._chat_templates))}) and none named 'default'")
        return self._compiled(name)

    def _compiled(self, name: str):
        """The chat template `name`, compiled once; InvalidRequest (every time) if it does not compile."""
        if name in self._template_errors:
            raise InvalidRequest(self._template_errors[name])
        if name not in self._compiled_templates:
            from prefixrun.engine.load import chat_template

            try:
                self._compiled_templates[name] = chat_template.compile_template(self._chat_templates[name])
            except chat_template.COMPILE_ERRORS as exc:
                # A request error, not a load error: as in transformers, the folder still serves plain prompts,
                # and each chat line gets an error record instead of the run aborting at the first one.
                self._template_errors[name] = f"{self._template_source}: chat template {name!r} is not valid " \
                                              f"jinja: {exc}"
                raise InvalidRequest(self._template_errors[name]) from exc
        return self._compiled_templates[name]


class StreamDetokenizer:
    """Turns generated token ids into text one token at a time, for streaming and stop-string checks.

    A character can span several byte-level tokens (emoji, CJK) and a SentencePiece token's leading space only
    shows when it is decoded after another token, so each step decodes a short window of recent tokens and emits
    the part after the window's already-emitted prefix, holding text back while it still ends in U+FFFD (an
    incomplete UTF-8 sequence). Once every character is complete, `text` equals decoding all fed ids at once.

    `spaces_between_special_tokens` false (with `skip_special_tokens` false) writes an added token that follows
    another added token as its bare text, without the space some decoders (WordPiece's) put between tokens, as
    vLLM's detokenizer does.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._bare_after_added = (tokenizer.added_tokens if not (skip_special_tokens or spaces_between_special_tokens)
                                  else {})
        self._last_added = False
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: context that is already emitted
        self._read_offset = 0  # end of what has been emitted
        self._text = ""

    def feed(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        new_text = self._emit(hold_incomplete=True)
        if self._bare_after_added:
            bare = self._bare_after_added.get(token_id)
            if bare is not None and self._last_added and new_text:
                self._text = self._text[:len(self._text) - len(new_text)] + bare
                new_text = bare
            self._last_added = bare is not None
        return new_text

    def flush(self) -> str:
        """Emit whatever is held back (with U+FFFD for bytes that never completed), e.g. at end of generation."""
        return self._emit(hold_incomplete=False)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text

    def _emit(self, hold_incomplete: bool) -> str:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        emitted_part = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        window_text = decode(window, self._skip_special_tokens)
        if len(window_text) <= len(emitted_part):
            return ""
        if hold_incomplete and window_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        new_text = window_text[len(emitted_part):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += new_text
        return new_text


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's stop tokens and its own sampling defaults, from generation_config.json."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingDefaults = SamplingDefaults()
    processing: ModelProcessing = ModelProcessing()  # suppressed tokens, no_repeat_ngram_size
    not_applied: tuple[str, ...] = ()  # fields set that transformers would apply and prefixrun does not

    @classmethod
    def from_model_dir(cls, path: Path, config_eos: int | list[int] | None = None,
                       tokenizer: Tokenizer | None = None, vocab_size: int | None = None) -> GenerationDefaults:
        """Read generation_config.json (optional) and collect every token that ends generation.

        Stop tokens are the union of generation_config's `eos_token_id`, config.json's (`config_eos`) and the
        tokenizer's eos token, because chat models often list the turn-end token in only one of them. The
        tokenizer is loaded from `path` when not passed and tokenizer.json exists. `do_sample: false` means greedy
        decoding in transformers, so it turns into temperature 0.
        """
        path = Path(path)
        config_file = path / GENERATION_CONFIG_FILE
        config = _read_json_object(config_file, missing_ok=True)
        if tokenizer is None and (path / TOKENIZER_FILE).is_file():
            tokenizer = Tokenizer.from_model_dir(path)

        eos_ids: list[int] = []
        for source, value in ((config_file.name + ": eos_token_id", config.get("eos_token_id")),
                              ("config.json: eos_token_id", config_eos),
                              ("tokenizer eos_token", tokenizer.eos_token_id if tokenizer else None)):
            for token_id in _token_id_list(value, source):
                if token_id not in eos_ids:
                    eos_ids.append(token_id)

        reader = _GenerationConfigReader(config, config_file.name)
        temperature = reader.number("temperature", minimum=0.0)
        if reader.flag("do_sample") is False:
            temperature = 0.0
        sampling = SamplingDefaults(
            temperature=temperature,
            top_p=reader.number("top_p", minimum=0.0, maximum=1.0),
            top_k=reader.integer("top_k", minimum=-1),
            min_p=reader.number("min_p", minimum=0.0, maximum=1.0),
            max_tokens=reader.integer("max_new_tokens", minimum=1),
            repetition_penalty=reader.number("repetition_penalty", minimum=1e-6, maximum=1e6),
            min_tokens=reader.integer("min_new_tokens", minimum=0),
        )
        processing = _model_processing(config, reader, config_file.name, vocab_size, eos_ids)
        return cls(eos_token_ids=tuple(eos_ids), sampling=sampling, processing=processing,
                   not_applied=tuple(k for k, off in _NOT_APPLIED.items() if config.get(k, off) not in (off, None)))


# generation_config fields that change what transformers generates, with the value that changes nothing: a run
# over a model that sets one says so (GenerationDefaults.not_applied) instead of ignoring it silently.
_NOT_APPLIED = {"force_words_ids": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
                "exponential_decay_length_penalty": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "num_beams": 1, "penalty_alpha": None, "guidance_scale": None,
                "stop_strings": None, "max_time": None, "watermarking_config": None,
                # a decoder-only model's "encoder" input is its prompt: transformers boosts the prompt's tokens
                "encoder_repetition_penalty": 1.0, "top_h": None, "token_healing": False, "dola_layers": None}


def _model_processing(config: dict, reader, file_name: str, vocab_size: int | None, eos_ids) -> ModelProcessing:
    """generation_config's fields of transformers' logits processors that prefixrun applies to every request."""
    token_lists = {name: tuple(_token_id_list(config.get(name), f"{file_name}: {name}"))
                   for name in ("suppress_tokens", "begin_suppress_tokens")}
    words = config.get("bad_words_ids")
    if words is not None and (not isinstance(words, list) or not all(isinstance(w, list) and w for w in words)):
        raise ModelLoadError(f"{file_name}: bad_words_ids must be a list of non-empty lists of token ids, got "
                             f"{words!r}"[:200])
    # transformers leaves out a one-token bad word that is an end-of-sequence id
    words = tuple(tuple(_token_id_list(w, f"{file_name}: bad_words_ids")) for w in words or ()
                  if not (len(w) == 1 and w[0] in eos_ids))
    for name, ids in [*token_lists.items(), ("bad_words_ids", [t for w in words for t in w])]:
        outside = [t for t in ids if vocab_size is not None and t >= vocab_size]
        if outside:
            raise ModelLoadError(f"{file_name}: {name} names token id {outside[0]}, outside the model's "
                                 f"vocabulary of {vocab_size}")
    return ModelProcessing(no_repeat_ngram_size=reader.integer("no_repeat_ngram_size", minimum=0) or 0,
                           min_length=reader.integer("min_length", minimum=0) or 0, bad_words_ids=words,
                           **token_lists)


class _GenerationConfigReader:
    """Typed access to generation_config.json fields, with errors that name the file and field."""

    def __init__(self, config: dict, file_name: str):
        self._config = config
        self._file_name = file_name

    def number(self, key: str, minimum: float, maximum: float = math.inf) -> float | None:
        value = self._config.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= maximum:
            raise ModelLoadError(f"{self._file_name}: {key} must be a number in [{minimum}, {maximum}], "
                                 f"got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool | None:
        value = self._config.get(key)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # transformers reads it by truth
            return bool(value)
        raise ModelLoadError(f"{self._file_name}: {key} must be true or false, got {value!r}")

    def integer(self, key: str, minimum: int) -> int | None:
        value = self._config.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelLoadError(f"{self._file_name}: {key} must be an integer >= {minimum}, got {value!r}")
        return value


# ---- loading helpers ---------------------------------------------------------------------------------------


def _read_json_object(path: Path, missing_ok: bool) -> dict:
    if not path.is_file():
        if missing_ok:
            return {}
        raise ModelLoadError(f"{path}: not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object at the top level")
    return value


def _special_tokens_of(config: dict, source: Path) -> dict[str, str]:
    """Template variables for special tokens: the named ones plus model-specific `*_token` keys (image_token,
    ...), each given as a string or an AddedToken dict, as transformers passes them to the chat template."""
    tokens = {}
    for key, value in config.items():
        if not key.endswith("_token") or value is None or isinstance(value, bool):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            if key in NAMED_SPECIAL_TOKENS:
                raise ModelLoadError(f"{source}: {key} must be a string or an AddedToken object, got {value!r}")
            continue
        tokens[key] = value
    return tokens


def _register_missing_special_tokens(backend: BackendTokenizer, tokens) -> None:
    """transformers adds configured special tokens that tokenizer.json lacks as new special tokens; do the same
    so both assign them the same ids."""
    missing = [t for t in dict.fromkeys(tokens) if backend.token_to_id(t) is None]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _chat_templates_of(path: Path, config: dict) -> tuple[dict[str, str], str]:
    """Named chat templates and a description of where they came from (for error messages)."""
    templates: dict[str, str] = {}
    jinja_file = path / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        templates["default"] = _read_template(jinja_file)
    extra_dir = path / EXTRA_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        for template_file in sorted(extra_dir.glob("*.jinja")):
            templates[template_file.name.removesuffix(".jinja")] = _read_template(template_file)
    if templates:
        return templates, str(jinja_file if "default" in templates else extra_dir)

    config_file = path / TOKENIZER_CONFIG_FILE
    configured = config.get("chat_template")
    if configured is None:
        return {}, str(path)
    if isinstance(configured, str):
        return {"default": configured}, str(config_file)
    if isinstance(configured, list):
        for entry in configured:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ModelLoadError(f"{config_file}: chat_template list entries must be objects with string "
                                     f"'name' and 'template', got {entry!r}")
            templates[entry["name"]] = entry["template"]
        return templates, str(config_file)
    raise ModelLoadError(f"{config_file}: chat_template must be a string or a list of {{name, template}}, "
                         f"got {type(configured).__name__}")


def _token_id_list(value, source: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for token_id in values:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ModelLoadError(f"{source} must be a non-negative integer or a list of them, got {value!r}")
    return list(values)


# ---- continue_final_message ---------------------------------------------------------------------------------

# transformers marks the end of the final message with this tag, renders, and cuts the text at the tag; the same
# here gives the same text (and the same errors) for every template.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> list[dict]:
    """A copy of `messages` whose final content ends with the tag (in its last text part, for a list of parts)."""
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):
        parts = [dict(part) for part in content]
        text_parts = [part for part in parts if "text" in part]
        if not text_parts:
            raise InvalidRequest("continue_final_message is set but the final message has no text to continue")
        text_parts[-1]["text"] += _CONTINUE_TAG
        final["content"] = parts
    else:
        raise InvalidRequest("continue_final_message is set but the final message has no content to continue")
    return [*messages[:-1], final]


def _cut_after_final_message(rendered: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered:
        raise InvalidRequest("continue_final_message is set but the chat template drops the final message's "
                             "text, so there is nothing to continue")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space, and the tag's with it
