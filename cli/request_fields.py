"""Every field a request line may carry, and what prefixrun does with it: the one registry of request fields.

A field is HONOURED (it changes the result as documented), HARMLESS (accepted; it changes nothing in an offline
batch, e.g. `user`, `store`), or REFUSED (a line that sets it to anything but an inert value gets an error record
naming the field, exit code 3; `--lenient` ignores it instead, with a warning that counts the lines per key).
A key that is not in this registry is refused the same way, with the closest known name suggested
(`max_token` -> `max_tokens`).

The line parser (cli/lines.py), the README's table of request fields and the tests all read this table; nothing
else decides whether a field is accepted.

To make a field honoured, implement it, then flip its line below: `REFUSED` -> `HONOURED` (keep the text in
`does`, it is the README's description; drop `why` and `inert` if they no longer apply), and rewrite the README
table with `python -m prefixrun.cli.request_fields --write-readme`. A test checks that every honoured field is read
by something: SamplingParams (engine/request.py; every field of it must be listed here as honoured) or the line
parser's own READ_BY_PARSER (cli/lines.py), and that the README table matches this registry.

`applies_to` says which requests a field belongs to: CHAT (messages: a plain `messages` line or
/v1/chat/completions), COMPLETION (a plain `prompt` / `prompt_token_ids` line or /v1/completions), or BOTH. A field
given to the other kind of request is an error naming the kind it belongs to. `inert` lists values that mean
"off" and are accepted even while the field is refused (`stream: false`, `modalities: ["text"]`); null always
counts as not given. A refused field says `why` (the error record and the README quote it): what prefixrun does
instead, or why the field has no meaning here.
"""
from __future__ import annotations

import difflib
import enum
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Status(enum.Enum):
    HONOURED = "honoured"
    HARMLESS = "accepted, changes nothing"
    REFUSED = "refused"


HONOURED, HARMLESS, REFUSED = Status.HONOURED, Status.HARMLESS, Status.REFUSED


class Kind(enum.Flag):
    CHAT = enum.auto()
    COMPLETION = enum.auto()


CHAT, COMPLETION = Kind.CHAT, Kind.COMPLETION
BOTH = CHAT | COMPLETION


@dataclass(frozen=True)
class RequestField:
    name: str
    status: Status
    applies_to: Kind
    does: str  # what the field means (the README's description)
    why: str = ""  # REFUSED: why prefixrun refuses it (required); HARMLESS: why it changes nothing here
    inert: tuple = ()  # values that change nothing and are accepted even while the field is refused
    takes: str = ""  # HARMLESS: the JSON type of its value ("a string", "an object", ...; "" any), as OpenAI/vLLM

    def is_inert(self, value: Any) -> bool:
        return value is None or any(_same_json_value(value, off) for off in self.inert)

    def wrong_type(self, value: Any) -> bool:
        """A value of another type than the field takes: a mistake in the line (OpenAI and vLLM refuse `"user":
        5`), never taken for a field that changes nothing."""
        return bool(self.takes) and value is not None and _json_kind(value) != self.takes

    @property
    def refusal(self) -> str:
        return self.why


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    kinds = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "an array"}
    return kinds.get(type(value), type(value).__name__)


def _same_json_value(value: Any, other: Any) -> bool:
    # JSON types, not Python's: true is not 1, and 0 equals 0.0
    if isinstance(value, bool) or isinstance(other, bool):
        return isinstance(value, bool) and isinstance(other, bool) and value == other
    if isinstance(value, (int, float)) and isinstance(other, (int, float)):
        return value == other
    return type(value) is type(other) and value == other


_F = RequestField
FIELDS: tuple[RequestField, ...] = (
    # ---- the prompt ----
    _F("prompt", HONOURED, COMPLETION, "the text to complete (OpenAI: also a token list, or a list of one)"),
    _F("prompt_token_ids", HONOURED, COMPLETION, "the prompt as token ids (plain lines)"),
    _F("messages", HONOURED, CHAT, "the conversation, rendered through the model's chat template"),
    _F("model", HARMLESS, BOTH, "the model name", why="the model is the one given on the command line",
       takes="a string"),
    # ---- chat template ----
    _F("tools", HONOURED, CHAT, "function schemas, rendered by the chat template (a template that never reads them: "
       "an error)"),
    _F("chat_template_kwargs", HONOURED, CHAT, "extra chat-template variables, e.g. {\"enable_thinking\": false} (a "
       "variable the template never reads: an error, --lenient too, as it would change nothing)"),
    _F("add_generation_prompt", HONOURED, CHAT, "end the prompt with the assistant header (default true)"),
    _F("continue_final_message", HONOURED, CHAT, "leave the last message open for the model to continue"),
    _F("documents", HONOURED, CHAT, "documents for templates that render them (RAG): the template's documents (a "
       "template that never reads them: an error)"),
    _F("chat_template", REFUSED, CHAT, "a Jinja chat template for this request",
       why="a template is code: as vLLM without --trust-request-chat-template, every chat is rendered with the "
           "model's own template"),
    _F("add_special_tokens", HONOURED, BOTH, "add the tokenizer's special tokens (BOS) to the prompt text "
       "(default: true for completions, false for chats, whose template writes them)"),
    _F("reasoning_effort", HONOURED, CHAT, "the template's reasoning_effort variable; \"none\" also sets "
       "enable_thinking false, any other value true (unless chat_template_kwargs set it), as vLLM does; a template "
       "that reads neither: an error, as OpenAI refuses it for a model that does not reason"),
    _F("include_reasoning", HONOURED, CHAT, "false: no reasoning_content in the message"),
    _F("thinking_token_budget", REFUSED, CHAT, "the most tokens a reasoning model may think",
       why="no sampler here ends a think block after N tokens: bound the reply with max_tokens"),
    _F("tool_choice", HONOURED, CHAT, "none (the text is the content), auto (the default with tools: tool calls "
       "parsed out of the text), required or a named function (the reply forced into calls)"),
    _F("parallel_tool_calls", HONOURED, CHAT, "false: only the first tool call is kept"),
    _F("functions", REFUSED, CHAT, "deprecated form of tools", why="deprecated by OpenAI: use tools"),
    _F("function_call", REFUSED, CHAT, "deprecated form of tool_choice", why="deprecated by OpenAI: use tool_choice"),
    _F("mm_processor_kwargs", REFUSED, CHAT, "options of a multimodal processor",
       why="prefixrun runs text models only", inert=({},)),
    _F("media_io_kwargs", REFUSED, CHAT, "options of media loaders", why="prefixrun runs text models only",
       inert=({},)),
    _F("modalities", REFUSED, CHAT, "output modalities", why="prefixrun generates text only", inert=(["text"],)),
    _F("audio", REFUSED, CHAT, "audio output", why="prefixrun generates text only"),
    # ---- length and stopping ----
    _F("max_tokens", HONOURED, BOTH, "the most tokens to generate (chat: the rest of the context if not given; "
       "completions: 16; 0 with echo on a completion: its prompt alone, e.g. scored with logprobs, as vLLM; more than "
       "the context leaves after the prompt: an error, as vLLM and OpenAI refuse it)"),
    _F("max_completion_tokens", HONOURED, BOTH, "the same as max_tokens (OpenAI's newer name)"),
    _F("min_tokens", HONOURED, BOTH, "the fewest tokens before end-of-sequence, a stop token or a stop string may "
       "end the output (as in vLLM, stop strings are not looked for in those tokens' text; a structured output "
       "complete before them: an error)"),
    _F("stop", HONOURED, BOTH, "strings that end the output (not included in it)"),
    _F("stop_token_ids", HONOURED, BOTH, "token ids that end the output (an id outside the vocabulary: an error, as "
       "for every token id a request names)"),
    _F("ignore_eos", HONOURED, BOTH, "keep generating after the end-of-sequence token"),
    _F("include_stop_str_in_output", HONOURED, BOTH, "keep the matched stop string, or the text of the stop token "
       "(stop_token_ids, end of sequence) that ended the reply, in the text, as vLLM does"),
    _F("truncate_prompt_tokens", HONOURED, BOTH, "keep only the last N prompt tokens (-1: as many as the context "
       "holds beside the reply's max_tokens)"),
    _F("truncation_side", HONOURED, BOTH, "\"left\" (default: the last tokens kept) or \"right\" (the first)"),
    # ---- sampling ----
    _F("temperature", HONOURED, BOTH, "sampling temperature; 0 is greedy"),
    _F("top_p", HONOURED, BOTH, "nucleus sampling: the smallest set of tokens whose probability reaches top_p"),
    _F("top_k", HONOURED, BOTH, "sample among the k most likely tokens (0 or -1: all)"),
    _F("min_p", HONOURED, BOTH, "drop tokens less likely than min_p times the most likely one"),
    _F("seed", HONOURED, BOTH, "the request's random seed, -2**63 to 2**63 - 1 (default: derived from custom_id)"),
    _F("n", HONOURED, BOTH, "how many completions to return (1 to 1024), all forked from one prefill; sample i draws "
       "with seed + i"),
    _F("best_of", HONOURED, BOTH, "sample best_of completions (n to 1024), return the n of highest cumulative "
       "logprob, best first; greedy lines ignore it"),
    _F("presence_penalty", HONOURED, BOTH, "penalise tokens that appeared in the output"),
    _F("frequency_penalty", HONOURED, BOTH, "penalise tokens by how often they appeared in the output"),
    _F("repetition_penalty", HONOURED, BOTH, "penalise tokens that appeared in the prompt or output"),
    _F("logit_bias", HONOURED, BOTH, "token id -> bias added to its logit"),
    _F("bad_words", HONOURED, BOTH, "words that may not be generated"),
    _F("allowed_token_ids", HONOURED, BOTH, "the only token ids that may be generated"),
    _F("use_beam_search", REFUSED, BOTH, "beam search instead of sampling",
       why="prefixrun samples (use n with best_of for the most likely of several samples)", inert=(False,)),
    _F("length_penalty", REFUSED, BOTH, "beam search's length penalty", why="beam search is not used",
       inert=(1,)),
    _F("watermarking", REFUSED, BOTH, "watermark the sampled text", why="no watermarking scheme is implemented",
       inert=(False,)),
    _F("repetition_detection", REFUSED, BOTH, "end the output when an n-gram repeats",
       why="outputs end only by stop rules and length here: use stop strings or max_tokens"),
    # ---- log probabilities ----
    _F("logprobs", HONOURED, BOTH, "log probabilities of the output tokens under the raw logits (chat: true/false; "
       "completions: how many alternatives, 0-20)"),
    _F("top_logprobs", HONOURED, CHAT, "how many most likely alternatives to list per token (0-20)"),
    _F("prompt_logprobs", HONOURED, BOTH, "log probabilities of the prompt tokens, k alternatives each (vLLM; "
       "0-20); such a request does not restore states stored before its window"),
    _F("logprob_token_ids", REFUSED, BOTH, "token ids whose log probabilities to return at every step",
       why="logprobs list the sampled token and the most likely ones (top_logprobs / logprobs: k), not a fixed "
           "set of ids"),
    _F("return_tokens_as_token_ids", REFUSED, BOTH, "name logprob tokens as token_id:N", inert=(False,),
       why="logprob tokens are written as their text with their bytes; token ids are in token_ids"),
    # ---- structured output ----
    _F("response_format", HONOURED, BOTH, "text, json_object, or json_schema (enforced, strict or not)"),
    _F("structured_outputs", HONOURED, BOTH, "vLLM's constraints: json, regex, choice, grammar (Lark or GBNF), "
       "json_object; disable_any_whitespace"),
    _F("guided_json", HONOURED, BOTH, "a JSON schema the output must follow (vLLM's older name)"),
    _F("guided_regex", HONOURED, BOTH, "a regular expression the output must match (vLLM's older name)"),
    _F("guided_choice", HONOURED, BOTH, "the output is one of these strings (vLLM's older name)"),
    _F("guided_grammar", HONOURED, BOTH, "a grammar the output must follow (vLLM's older name)"),
    _F("structural_tag", REFUSED, BOTH, "tagged regions with their own schemas",
       why="a constraint covers the whole reply here: use response_format or structured_outputs"),
    _F("guided_decoding_backend", HARMLESS, BOTH, "which grammar engine vLLM uses",
       why="prefixrun has one grammar engine (llguidance); every engine enforces the same constraint",
       takes="a string"),
    _F("guided_whitespace_pattern", REFUSED, BOTH, "whitespace allowed in guided JSON",
       why="a pattern of the outlines backend: JSON whitespace is on or off here "
           "(structured_outputs.disable_any_whitespace)"),
    # ---- output text ----
    _F("echo", HONOURED, BOTH, "completions: the prompt is prepended to the text (with logprobs, its tokens are "
       "listed first, the first with a null logprob, as OpenAI and vLLM list them); chat: the last message's "
       "content to the reply's, if it has the reply's role"),
    _F("skip_special_tokens", HONOURED, BOTH, "leave special tokens out of the text (default true)"),
    _F("spaces_between_special_tokens", HONOURED, BOTH, "false: no space between two special tokens in the "
       "text (with skip_special_tokens false; default true)"),
    _F("detokenize", HONOURED, BOTH, "false: an empty text (token ids only)"),
    _F("return_token_ids", HONOURED, BOTH, "the prompt's token ids in the record (prompt_token_ids) and, in an "
       "OpenAI response, each choice's token_ids"),
    _F("return_prompt_text", HONOURED, CHAT, "the prompt as the model read it (its tokens decoded) in the record "
       "(prompt_text)"),
    _F("suffix", REFUSED, COMPLETION, "text that follows the completion (fill-in-the-middle)",
       why="fill-in-the-middle needs the model's own FIM prompt format: write it into the prompt"),
    _F("verbosity", REFUSED, CHAT, "how long the answer should be (OpenAI)",
       why="no model-independent meaning: ask for it in the messages"),
    _F("web_search_options", REFUSED, CHAT, "web search (OpenAI)", why="offline inference has no web search"),
    _F("prediction", HARMLESS, CHAT, "predicted output (OpenAI)",
       why="a prediction only speeds up generation; it never changes the output", takes="an object"),
    _F("logits_processors", REFUSED, BOTH, "custom logits processors (vLLM)",
       why="code cannot be loaded from a request line"),
    _F("vllm_xargs", REFUSED, BOTH, "arguments for vLLM extensions", why="prefixrun has no extensions"),
    _F("extra_args", REFUSED, BOTH, "arguments for custom sampling code", why="prefixrun has no extensions"),
    _F("trace_decode_token_ids", REFUSED, BOTH, "force these output tokens (vLLM debugging)",
       why="a debugging aid of vLLM's engine: put known tokens in prompt_token_ids instead"),
    # ---- streaming and serving (nothing to do offline) ----
    _F("stream", REFUSED, BOTH, "stream the response",
       why="a batch writes each result as one line: leave stream out or false", inert=(False,)),
    _F("stream_options", HARMLESS, BOTH, "streaming options", why="nothing is streamed", takes="an object"),
    _F("stream_interval", HARMLESS, BOTH, "tokens per streamed chunk", why="nothing is streamed", takes="an integer"),
    _F("output_kind", HARMLESS, BOTH, "vLLM's streaming mode", why="a batch returns final outputs only"),
    _F("user", HARMLESS, BOTH, "an end-user id", why="kept by the API provider only", takes="a string"),
    _F("metadata", HARMLESS, BOTH, "your own key-value data", why="for your records (plain lines too)"),
    _F("store", HARMLESS, BOTH, "store the completion with the provider", why="nothing is stored", takes="a boolean"),
    _F("service_tier", HARMLESS, BOTH, "the provider's processing tier", why="one tier: this machine",
       takes="a string"),
    _F("safety_identifier", HARMLESS, BOTH, "an end-user id for abuse detection",
       why="kept by the API provider only", takes="a string"),
    _F("prompt_cache_key", HARMLESS, BOTH, "a prompt-cache routing hint",
       why="prefixrun finds shared prefixes itself", takes="a string"),
    _F("prompt_cache_retention", HARMLESS, BOTH, "how long the provider keeps cached prompts",
       why="the persistent cache has its own budget (--cache-budget)", takes="a string"),
    _F("cache_salt", HARMLESS, BOTH, "separates prefix caches of different users",
       why="a batch belongs to one user; cached state never changes an answer", takes="a string"),
    _F("skip_reading_prefix_cache", HARMLESS, BOTH, "bypass the prefix cache",
       why="cached state never changes an answer (use --no-reuse to measure without it)", takes="a boolean"),
    _F("request_id", HARMLESS, BOTH, "the server's request id", why="ids are derived from custom_id", takes="a string"),
    _F("session_id", HARMLESS, BOTH, "a session id for routing", why="nothing is routed", takes="a string"),
    _F("priority", HARMLESS, BOTH, "scheduling priority", why="a batch runs every line; order changes no answer",
       takes="an integer"),
    _F("kv_transfer_params", HARMLESS, BOTH, "disaggregated-serving parameters", why="one engine, no transfer",
       takes="an object"),
    _F("ec_transfer_params", HARMLESS, BOTH, "encoder-cache transfer parameters", why="one engine, no transfer",
       takes="an object"),
    _F("routed_experts_prompt_start", HARMLESS, BOTH, "vLLM debugging of MoE routing",
       why="routing data is not returned", takes="an integer"),
    _F("flat_logprobs", HARMLESS, BOTH, "vLLM's in-memory logprobs layout", why="only the output shape counts",
       takes="a boolean"),
)

BY_NAME: dict[str, RequestField] = {field.name: field for field in FIELDS}


def lookup(name: str) -> RequestField | None:
    return BY_NAME.get(name)


def closest_name(name: str) -> str | None:
    """The known field a misspelled key most likely meant (`temprature` -> `temperature`), or None."""
    found = difflib.get_close_matches(name, BY_NAME, n=1, cutoff=0.75)
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------------------------
# The README table

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_START = "<!-- request fields: generated by `python -m prefixrun.cli.request_fields --write-readme` -->"
TABLE_END = "<!-- end of request fields -->"
_KIND_NAMES = {BOTH: "both", CHAT: "chat", COMPLETION: "completions"}


def markdown_table() -> str:
    """The README's table of request fields, one row per field of the registry."""
    rows = ["| field | requests | status | what it does |", "|---|---|---|---|"]
    for field in FIELDS:
        status = field.status.value
        note = field.does
        if field.status is REFUSED:
            note += f". Refused: {field.refusal}"
            if field.inert:
                note += f" (accepted: {', '.join(_json(v) for v in field.inert)})"
        elif field.status is HARMLESS:
            note += f". {field.why[:1].upper()}{field.why[1:]}" if field.why else ""
        rows.append(f"| `{field.name}` | {_KIND_NAMES[field.applies_to]} | {status} | {note} |")
    return "\n".join(rows)


def _json(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"


def readme_with_table(readme: str) -> str:
    start, end = readme.index(TABLE_START), readme.index(TABLE_END)
    return readme[:start + len(TABLE_START)] + "\n" + markdown_table() + "\n" + readme[end:]


def main(argv: list[str]) -> int:
    if argv == ["--write-readme"]:
        README.write_text(readme_with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
