"""Input lines in, result lines out: the file formats of `prefixrun batch`.

Input
=====
One JSON object per line (JSONL), UTF-8. Blank lines are skipped but still counted, so the line numbers in error
messages match what an editor shows. A UTF-8 byte-order mark at the start of the file is ignored. The input is read
as a stream: a million-line file is never held in memory at once.

Two line shapes are accepted, and may be mixed in one file.

Plain lines
-----------
Exactly one of the three prompt fields, plus optional `custom_id` and sampling fields::

    {"custom_id": "q1", "prompt": "The capital of France is", "max_tokens": 8}
    {"custom_id": "q2", "messages": [{"role": "user", "content": "Hi!"}], "temperature": 0}
    {"custom_id": "q3", "prompt_token_ids": [151644, 872, 198], "stop": ["\\n"]}

- `prompt`: a non-empty string, tokenized as is.
- `messages`: a non-empty list of `{"role": str, "content": ...}`; the model's chat template is applied by the
  engine. `content` is a string, a list of text parts (`{"type": "text", "text": str}`), or null (or left out) on
  an assistant message that carries `tool_calls`. Other keys of a message are passed to the template untouched;
  a `name` (but a tool message's) that the template does not write into the prompt is an error, as is another key
  (refusal, audio, a misspelled one) that the template never reads.
- `prompt_token_ids`: a non-empty list of non-negative integers.

A `messages` line may also carry what vLLM's chat completions take beside the messages:

- `tools`: a list of tool schemas (`{"type": "function", "function": {...}}`), rendered by the chat template
  (as transformers' `apply_chat_template(tools=...)` does).
- `chat_template_kwargs`: an object of extra template variables, e.g. `{"enable_thinking": false}`; its keys win
  over `--chat-template-kwargs`. It may not set messages, tools, documents, add_generation_prompt or
  continue_final_message, nor a variable the model's chat template never reads (it would change nothing).
- `add_generation_prompt` (default true) and `continue_final_message` (default false): with
  `continue_final_message` the prompt ends inside the last message (no end-of-turn), so the model continues it;
  `add_generation_prompt` then defaults to false, and both true is an error.
- `tool_choice`: `"auto"` (the default with tools: tool calls are read out of the reply, cli/tool_calls.py),
  `"none"` (the reply's text is its content), `"required"` or `{"type": "function", "function": {"name": ...}}`
  (the reply is forced into calls by the structured-output engine); `parallel_tool_calls: false` keeps the first
  call only; `include_reasoning: false` leaves reasoning_content null.
- `documents` (the template's documents, for RAG templates) and `reasoning_effort` (the template's variable;
  `"none"` also sets enable_thinking false, any other value true, unless chat_template_kwargs set it).

These keys on a `prompt` or `prompt_token_ids` line are an error. Any request may carry `truncate_prompt_tokens`
(keep the last N prompt tokens, -1: as many as the context holds beside the line's max_tokens;
`truncation_side: "right"` keeps the first),
`add_special_tokens` (default true for a text prompt, false for a chat, whose template writes them),
`return_token_ids` / `return_prompt_text` (added to the record as `prompt_token_ids`, each OpenAI choice's
`token_ids`, and `prompt_text`: the prompt's tokens decoded) and `detokenize: false` (an empty text).
`echo: true` puts the prompt before a completion's text (a token prompt decoded, special tokens included) and a
chat's last message before the reply's content when it has the reply's role (e.g. an assistant message continued
with `continue_final_message`).

OpenAI Batch API lines
----------------------
The request lines of the OpenAI Batch API (a line is read this way when it has `url` or `body` and none of the
plain prompt fields)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [...], "max_completion_tokens": 64}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "any", "prompt": "Once upon a time", "max_tokens": 64}}

- `method` must be `POST` (it may be left out); `url` is `/v1/chat/completions` (body needs `messages`) or
  `/v1/completions` (body needs `prompt`: a string, a list of token ids, or a one-element list of either).
- `body.model` is ignored: the model is the one given on the command line.
- `max_completion_tokens` and `max_tokens` mean the same; if both are given they must agree.
- `body.tools`, `body.chat_template_kwargs`, `body.add_generation_prompt` and `body.continue_final_message` work
  as on a plain line (below).
- `n` and `best_of` as on a plain line (below): `choices` then holds n entries, `index` 0 to n-1.

Common fields
-------------
- `custom_id`: a non-empty string (an integer is accepted and turned into a string). Without one, the line gets
  `line-<N>`, N being its 1-based line number. Every custom_id must be unique in the file; a repeated one is an
  error on the later line.
- Sampling, named as vLLM names them: `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`,
  `stop` (a string or a list of strings), `stop_token_ids`, `ignore_eos`, `n`, `best_of`. In OpenAI lines they
  live in `body`. A value on the line wins over the command-line / generation_config defaults, which win over
  the built-in ones (max_tokens: the rest of the model's context for a chat, 16 for a completion, as in vLLM and
  OpenAI; temperature 1.0, top_p 1.0, top_k off, min_p 0). A field set to null counts as not given.
- Structured output (engine/grammar/spec.py has the details): `response_format` (`{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}` or `{"type": "text"}`),
  vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`; at most one per line. Every token of the reply is drawn
  from those the grammar allows, so the text matches it whole unless max_tokens ends it first (`length`); a
  complete match ends the reply (`stop`). A schema or grammar the engine cannot compile is an error record.
- `n` (1 to 1024, default 1): completions per request. The n samples fork the prompt's state after one prefill
  (the prompt is computed once whatever n is). Sample i draws with seed + i (the line's `seed`, or without one
  the seed derived from custom_id and `--seed`), as vLLM seeds its samples: sample 0 is what the line gives with
  n = 1, and sample i is reproduced alone by the same line with n = 1 and seed + i. A greedy line (temperature 0
  or top_k 1) decodes once and returns its completion n times.
- `best_of` (n to 1024, default n): samples generated (seeded as above), of which the n with the highest
  cumulative logprob are returned, best first, as vLLM's best_of does. A sample's cumulative logprob is the sum of
  its tokens' logprobs under the model's raw distribution (log_softmax of the logits, before temperature and the
  filters: the likelihood of the text); a tie keeps the lower sample first. Greedy lines ignore it.
- Usage counts the prompt once and sums the completion tokens of every sample generated (best_of's unreturned
  samples included, as OpenAI counts them).
- Every other field is listed in cli/request_fields.py (the README's table of request fields is made from it):
  honoured, accepted because it changes nothing offline (`user`, `metadata`, `store`, `stream: false`, ...), or
  refused. A line that sets a refused field to anything but its "off" value, or has a key that is not in the
  registry (a misspelled `max_token`: the message suggests `max_tokens`), gets an error record naming the key.
  Your own data goes under `metadata`. With `--lenient` such keys are ignored instead; `prefixrun batch` names
  each when it first appears and counts the lines per key at the end. A field of chats (`tools`, ...) on a
  completion, or of completions (`suffix`) on a chat, is an error either way. An OpenAI line holds custom_id,
  method, url and body only.
- Size: a text (or rendered chat) with more characters than the model's context could hold even at the longest
  token of its vocabulary gets an error record without being tokenized (see prefixrun.engine.load.prompts).

Output
======
One JSON object per line, in input order (or in completion order with `--unordered`), each written and flushed
as soon as it and every line before it are done, so a killed run leaves a valid prefix of the output.

A plain line's result::

    {"custom_id": "q1", "text": " Paris.", "token_ids": [12095, 13], "finish_reason": "stop",
     "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
               "prompt_tokens_details": {"cached_tokens": 4}}}

A plain line with n > 1 has a `choices` list in place of text, token_ids and finish_reason; usage sums over
every completion::

    {"custom_id": "q4", "choices": [{"index": 0, "text": " Paris.", "token_ids": [12095, 13], "finish_reason": "stop"},
                                    {"index": 1, "text": " Lyon", "token_ids": [56125], "finish_reason": "length"}],
     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, ...}}

An OpenAI line's result, as the OpenAI Batch API writes it (`id`, `request_id` and the body's `id` are derived
from custom_id, the same in every run; `created` is the Unix time the request's window started and `model` the
model folder's name, so two runs' files differ in `created`, and in `cached_tokens` where the cache held more or
less; `body` is a `chat.completion` with `choices[0].message` or a `text_completion` with `choices[0].text`; with
n > 1, `choices[0..n-1]`)::

    {"id": "batch_req_…", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_…",
                  "body": {"id": "chatcmpl-…", "object": "chat.completion", "created": 1764720000, "model": "…",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "…"},
                                        "logprobs": null, "finish_reason": "stop"}],
                           "usage": {...as above...}}},
     "error": null}

`finish_reason` is `stop` (end-of-sequence token, stop string or stop token) or `length` (max_tokens or the end of
the model's context); for a chat, `tool_calls` when the reply called tools (tool_choice auto or required).

A chat's reply (cli/replies.py) is read as vLLM's chat completions read it: the reasoning of a `<think>` template
is split into `reasoning_content` (the key is there, null when there was none, for models whose template thinks),
tool calls into `tool_calls` (`[{"id": "chatcmpl-tool-…", "type": "function", "function": {"name": ...,
"arguments": "<JSON text>"}}]`, ids derived from custom_id), the rest is `content` (null when nothing is left). A
plain chat line's record keeps the generated `text` as it is and adds that `message`::

    {"custom_id": "q2", "text": "<think>…</think>Hello!", "message": {"role": "assistant", "content": "Hello!",
     "reasoning_content": "…"}, "token_ids": [...], "finish_reason": "stop", "usage": {...}}

Log-probabilities (asked for with `logprobs`: a chat's `true` plus `top_logprobs: k`, a completion's or plain
line's `k`, 0-20) are those of the raw logits, log_softmax before penalties, biases, masks and temperature (vLLM's
default `raw_logprobs`), per generated token, with the k most likely tokens at its position (ties: the lower id
first; cli/logprob_records.py). A chat's `choices[0].logprobs` is OpenAI's
`{"content": [{"token": " Paris", "logprob": -0.31, "bytes": [32, 80, 97, 114, 105, 115], "top_logprobs":
[{"token": ..., "logprob": ..., "bytes": [...]}, ...]}, ...], "refusal": null}`; a completion's is
`{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token text: logprob, ...}, ...], "text_offset":
[...]}`, each `top_logprobs` entry the token itself and then its k alternatives (up to k + 1 keys, as OpenAI's
legacy completions and vLLM write them); a plain line's result gains
`"logprobs": [{"token_id": 12095, "token": " Paris", "logprob": -0.31, "top_logprobs": [{"token_id": ...,
"token": ..., "logprob": ...}, ...]}, ...]` and `"cumulative_logprob"` (their sum). A token's `bytes` are the
bytes it stands for, exact for a token holding part of a UTF-8 character; -inf is written -9999.0.
`prompt_logprobs: k` (vLLM's, 0-20) adds each prompt token's logprob given the tokens before it: a plain line's
`"prompt_logprobs": [null, {"token_id": ..., "token": ..., "logprob": ..., "top_logprobs": [...]}, ...]` (one per
prompt token, the first null), and as vLLM's server writes it, `{"<token id>": {"logprob": ..., "decoded_token":
...}, ...}` per token (the token and its k alternatives) in each choice of a completion and beside a chat's
choices. Such a request never restores a state stored before its window (engine/run/prompt_logprobs.py says why);
a prefix it shares with other requests in the window is still computed once. A completion with `echo` and
`logprobs` lists its prompt's tokens first, as OpenAI's legacy completions and vLLM list them: their `tokens`,
`token_logprobs` and `top_logprobs` (the first token's null), then the generated ones', `text_offset` counting the
listed tokens' texts from 0 (a plain line's `logprobs` likewise starts with `prompt_logprobs`' entries, the first
null; its `cumulative_logprob` is the generated tokens'). The prompt's logprobs come from prefill as
`prompt_logprobs` do (with as many alternatives as `logprobs` asks for); the record carries a `prompt_logprobs`
field only when the line asked for one. `max_tokens: 0` with `echo` scores a prompt alone (what evaluation
harnesses send for log-likelihoods): as vLLM does, one token is generated (counted in usage) and left out of the
text, the token ids and the logprobs, whose listing is the prompt's.

A line that cannot be run gives an error record in its place, and the rest of the file is still processed::

    {"custom_id": "q9", "error": {"line": 9, "message": "temperature must be >= 0, got -1"}}
    {"id": "batch_req_…", "custom_id": "r9", "response": null,
     "error": {"code": "invalid_request", "message": "…", "line": 9}}

A message quotes the values and keys a line sent as JSON writes them (`true`, `"x"`, `{"a": null}`, control
characters as `\\u0001` escapes), never as Python would; a long value is cut to its first 50 characters.
`custom_id` is null in an error record when the line was too broken to read one. (A duplicate custom_id's record
carries it; being an error record, it is never taken for the earlier line's result.) A request the engine could
not run (e.g. a prompt that can never fit the state memory) also gets an error record in its place.

Resuming
========
`--resume` reads an existing output file, skips every request that already has a successful result there, and
appends the rest. A last line without its newline (a run killed mid-write) is cut off first. Results that had
finished but were waiting for an earlier line are in `<output>.journal` (cli/output.py); `--resume` moves them into
the output first. Without `--resume`, an output that already holds results needs `--overwrite`.

Limits
======
A line longer than `--max-line-bytes` (DEFAULT_MAX_LINE_BYTES, 4 MiB) gets an error record in its place; it is
read in chunks and dropped, never held in memory whole.

Exit codes
==========
====  ==================  ==========================================================================
code  name                meaning
====  ==================  ==========================================================================
0     EXIT_OK             every line was processed and produced a result
1     EXIT_FAILURE        the run was aborted (out of memory, an input read error, ...); finished results kept
2     EXIT_USAGE          bad command-line options, an unreadable input file or an unusable model
                          directory; nothing was run
3     EXIT_SOME_FAILED    some lines produced error records; every other line was processed
141   (cli.output)        stdout was closed by its reader (`| head`); the run stopped quietly
130   (cli.stop_signals)  Ctrl-C (SIGINT); finished results were kept (143: SIGTERM, 129: SIGHUP)
====  ==================  ==========================================================================
"""
from __future__ import annotations

import io
import json
import os
from typing import Any, BinaryIO, TextIO

from prefixrun.cli.line_reader import RawLine
from prefixrun.cli.lines import ParsedRequest

EXIT_OK = 0
"""Every line was processed and produced a result."""
EXIT_FAILURE = 1
"""The run was aborted; the output holds the results finished before that."""
EXIT_USAGE = 2
"""Bad command-line options or an unreadable input file; nothing was run."""
EXIT_SOME_FAILED = 3
"""Some lines produced error records; every other line was processed."""


# ---------------------------------------------------------------------------------------------------------------
# Output records that --resume and the writer look at


def is_success_record(record: Any) -> bool:
    """A result line that --resume counts as done (not an error record)."""
    return _is_success_record(record)


def _is_success_record(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str) or record.get("error") is not None:
        return False
    response = record.get("response")
    return "text" in record or "choices" in record or (
        isinstance(response, dict) and response.get("status_code") == 200)


def _is_error_record(record: dict) -> bool:
    return record.get("error") is not None


# ---------------------------------------------------------------------------------------------------------------
# Writing


class OrderedWriter:
    """Writes output records as JSON lines, in input order, each flushed as soon as it can be.

    With ordered=True a record waits until the records of every lower index have been written (or skipped);
    with ordered=False each record is written when added. Each record becomes exactly one `write()` of a whole
    line, so the output never holds a partial line except when the process dies mid-write (which --resume
    repairs). `stream` may be a text stream or a binary one. Not thread-safe: call it from one thread.
    """

    def __init__(self, stream: TextIO | BinaryIO, ordered: bool = True, journal=None):
        self._stream = stream
        # Ordered mode: a record that must wait for an earlier line is also appended to the journal at once
        # (anything with an `add(line)`, see cli/output.py), so a killed run loses only the lines in flight.
        self._journal = journal
        mode = getattr(stream, "mode", "")
        self._binary = isinstance(stream, (io.RawIOBase, io.BufferedIOBase)) or (isinstance(mode, str) and "b" in mode)
        self.ordered = ordered
        self._next_index = 0  # ordered mode: the lowest index not yet written or skipped
        self._pending: dict[int, tuple[str, bool] | None] = {}  # index -> (line, is_error); None marks a skip
        self._pending_records = 0  # the non-skip entries of _pending
        self._closed = False
        self.written_ok = 0
        self.written_errors = 0

    @property
    def pending_count(self) -> int:
        """Records added but not yet written (waiting for a lower index)."""
        return self._pending_records

    @property
    def next_index(self) -> int:
        """Ordered mode: the index whose record everything pending waits for."""
        return self._next_index

    def add(self, index: int, record: dict) -> None:
        """Queue the record of input line `index`; write it and any records it was holding back."""
        # Serialize now, so a record that cannot be written fails here, at its own add, not at a later one.
        self._enqueue(index, (_to_json_line(record), _is_error_record(record)))

    def skip(self, index: int) -> None:
        """Mark input line `index` as having no record in this output (e.g. already done in a resumed run)."""
        self._enqueue(index, None)

    def write_pending_out_of_order(self) -> int:
        """Write everything pending, in index order, ignoring the gaps. For a run that is aborting: results
        already computed land in the output, where --resume finds them. Returns the number written."""
        written = 0
        for index in sorted(self._pending):
            entry = self._pending.pop(index)
            if entry is not None:
                self._write(*entry)
                written += 1
        self._pending_records = 0
        self._flush()
        return written

    def close(self) -> None:
        """Flush, and check that nothing is still waiting. Does not close the stream (the caller owns it)."""
        self._flush()
        self._closed = True
        if self._pending:
            raise RuntimeError(
                f"{self.pending_count} output record(s) were never written: they wait for input line index "
                f"{self._next_index}, which was never added or skipped"
            )

    def __enter__(self) -> OrderedWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            # Don't mask the real error with a "pending records" one.
            self._flush()
            self._closed = True

    def _enqueue(self, index: int, entry: tuple[str, bool] | None) -> None:
        if self._closed:
            raise RuntimeError("OrderedWriter is closed")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative integer, got {index!r}")
        if not self.ordered:
            if entry is not None:
                self._write(*entry)
                self._flush()
            return
        if index < self._next_index or index in self._pending:
            raise ValueError(f"a record for index {index} was already added")
        self._pending[index] = entry
        self._pending_records += entry is not None
        if entry is not None and index != self._next_index and self._journal is not None:
            self._journal.add(entry[0])
        wrote_any = False
        while self._next_index in self._pending:
            ready = self._pending.pop(self._next_index)
            if ready is not None:
                self._pending_records -= 1
                self._write(*ready)
                wrote_any = True
            self._next_index += 1
        if wrote_any:
            self._flush()

    def _write(self, line: str, is_error: bool) -> None:
        self._stream.write(line.encode("utf-8") if self._binary else line)
        if is_error:
            self.written_errors += 1
        else:
            self.written_ok += 1

    def _flush(self) -> None:
        self._stream.flush()


def _to_json_line(record: dict) -> str:
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # U+2028/U+2029 and NEL (U+0085) are legal inside JSON strings but are line breaks to str.splitlines() (the
    # first two to JavaScript too); json escapes the other characters splitlines() breaks at, being below U+0020.
    # Escaped, a record stays one line for every reader. (They can only occur inside strings, so this is exact.)
    # (str.replace, not str.translate: 30x faster on a line that has none of them, the usual case)
    return line.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Resuming


class InputPositions:
    """Where each input line's record belongs in the output: by custom_id for a result (ids of results are unique:
    a repeated id is an error), by line number for an error record, if its custom_id is the one this run read on
    that line (the input may have changed since the record was written)."""

    def __init__(self):
        self.by_id: dict[str, int] = {}
        self.by_line: dict[int, tuple[int, str | None]] = {}  # line number -> (output position, custom_id)

    def note(self, raw: RawLine, item) -> None:
        self.by_line[raw.line_no] = (raw.index, item.custom_id)
        if isinstance(item, ParsedRequest):
            self.by_id.setdefault(item.custom_id, raw.index)

    def of(self, record: Any) -> int | None:
        """The output position of a record, None where no input line of this run made it."""
        if not isinstance(record, dict):
            return None
        error = record.get("error")
        if error is not None:
            line = error.get("line") if isinstance(error, dict) else None
            here = self.by_line.get(line) if isinstance(line, int) and not isinstance(line, bool) else None
            return here[0] if here is not None and here[1] == record.get("custom_id") else None
        custom_id = record.get("custom_id")
        return self.by_id.get(custom_id) if isinstance(custom_id, str) else None


def record_key(record: Any):
    """What identifies an output record's input line across runs: its custom_id, else (for an error record of a
    line without one) its line number; None for anything else."""
    if not isinstance(record, dict):
        return None
    custom_id = record.get("custom_id")
    if isinstance(custom_id, str):
        return custom_id
    error = record.get("error")
    line = error.get("line") if isinstance(error, dict) else None
    return ("line", line) if isinstance(line, int) and not isinstance(line, bool) else None


def read_completed_ids(path: str | os.PathLike) -> set[str]:
    """The custom_ids that have a successful result in an existing output file (empty if there is no file).

    A last line without its newline is a write cut short by a killed run; it is not counted, even if it parses,
    because truncate_partial_last_line() removes it. Error records are not counted, so those lines run again.
    Raises ValueError if a complete line is not JSON: that file is not a prefixrun output.
    """
    completed: set[str] = set()
    try:
        output = open(path, "rb")
    except FileNotFoundError:
        return completed
    with output:
        for line_no, data in enumerate(output, start=1):
            if not data.endswith(b"\n"):
                break  # the cut-off last line
            if not data.strip():
                continue
            try:
                record = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                raise ValueError(
                    f"{os.fspath(path)}, line {line_no}: not a JSON line; is this a prefixrun output file?"
                ) from None
            if _is_success_record(record):
                completed.add(record["custom_id"])
    return completed


def truncate_partial_last_line(path: str | os.PathLike) -> int:
    """Cut a last line that lacks its newline, so records can be appended. Returns the number of bytes removed."""
    chunk_size = 1 << 16
    with open(path, "r+b") as output:
        size = output.seek(0, os.SEEK_END)
        end = size
        # Scan backwards for the last newline; the partial line is everything after it.
        while end > 0:
            start = max(0, end - chunk_size)
            output.seek(start)
            chunk = output.read(end - start)
            newline_at = chunk.rfind(b"\n")
            if newline_at != -1:
                keep = start + newline_at + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            output.truncate(keep)
        return size - keep
