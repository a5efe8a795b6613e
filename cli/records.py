"""Finished requests -> output records: a result or an error record in the shape of the line that asked for it
(plain, or an OpenAI Batch response). The formats are described in the docstring of prefixrun.cli.io."""
from __future__ import annotations

import hashlib

from prefixrun.cli.lines import LineError, ParsedRequest
from prefixrun.cli.logprob_records import EchoedPrompt, TokenText, chat_logprobs, completion_logprobs, \
    plain_logprobs, plain_prompt_logprobs, vllm_prompt_logprobs, with_alternatives
from prefixrun.cli.replies import RAW_REPLY, ReplyShaper
from prefixrun.engine.load.prompts import ChatPrompt
from prefixrun.engine.request import Completion, Result


def format_result(req: ParsedRequest, result: Result, *, model: str = "", created: int = 0,
                  reply: ReplyShaper = RAW_REPLY, tokens: TokenText | None = None) -> dict:
    """The output record for a finished request, in the format of the line's shape.

    `model` and `created` (Unix seconds) fill the OpenAI response body's fields of those names; the caller passes
    the model name and the run's start time. created defaults to 0 so that output stays reproducible in tests.
    `reply` turns each generated text into its reply (echo; a chat's reasoning and tool calls: cli/replies.py).
    `tokens`: the token texts of logprobs records (the model's tokenizer; without it, empty texts).
    """
    tokens = tokens if tokens is not None else TokenText()
    if result.custom_id != req.custom_id:
        raise ValueError(f"result {result.custom_id!r} does not belong to request {req.custom_id!r}")
    usage = _usage_record(result)
    chat = isinstance(req.prompt, ChatPrompt)
    asked = _asked_prompt_logprobs(req, result)
    echoed = EchoedPrompt.of(reply.echo_token_ids, result.prompt_logprobs, req.sampling.logprob_alternatives) \
        if reply.echo_token_ids else None
    shown = [_shown(c, reply) for c in result.choices]
    if req.shape == "plain":
        prompt = plain_prompt_logprobs(asked, tokens)
        if req.sampling.n == 1:
            return {"custom_id": req.custom_id, **_plain_choice(shown[0], reply, chat),
                    **plain_logprobs(shown[0], tokens, echoed), **prompt, "usage": usage, **reply.extras()}
        choices = [{"index": i, **_plain_choice(c, reply, chat), **plain_logprobs(c, tokens, echoed)}
                   for i, c in enumerate(shown)]
        return {"custom_id": req.custom_id, "choices": choices, **prompt, "usage": usage, **reply.extras()}
    if req.shape == "openai_chat":
        body = {
            "id": _derived_id("chatcmpl-", req.custom_id),
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {"index": i, **_chat_choice(c, reply), "logprobs": chat_logprobs(c, tokens), **_token_ids(c, reply)}
                for i, c in enumerate(shown)
            ],
            "usage": usage,
            **reply.extras(),
        }
        if asked is not None:  # vLLM's server puts a chat's beside its choices
            body["prompt_logprobs"] = vllm_prompt_logprobs(asked, tokens)
    else:
        body = {
            "id": _derived_id("cmpl-", req.custom_id),
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": i, "text": reply.text(c.text), "logprobs": completion_logprobs(c, tokens, echoed),
                         "finish_reason": c.finish_reason, **_token_ids(c, reply), **_completion_prompt(asked, tokens)}
                        for i, c in enumerate(shown)],
            "usage": usage,
            **reply.extras(),
        }
    return {
        "id": _batch_request_id(req.custom_id),
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": _derived_id("req_", req.custom_id), "body": body},
        "error": None,
    }


def _plain_choice(choice: Completion, reply: ReplyShaper, chat: bool) -> dict:
    """A plain line's completion: a chat keeps its raw text beside its message."""
    if not chat:
        return {"text": reply.text(choice.text), "token_ids": list(choice.token_ids),
                "finish_reason": choice.finish_reason}
    message, finish_reason = reply.message(choice.text, choice.finish_reason)
    text = choice.text if reply.options.detokenize else ""
    return {"text": text, "message": message, "token_ids": list(choice.token_ids), "finish_reason": finish_reason}


def _shown(choice: Completion, reply: ReplyShaper) -> Completion:
    """The choice as its record shows it: for an echo with max_tokens 0 (vLLM's echo without generation, which
    draws one token and leaves it out), no generated token, so the record holds the prompt alone."""
    if not reply.options.echo_only:
        return choice
    listed = None if choice.logprobs is None else []
    return Completion([], "", choice.finish_reason, listed, None if listed is None else 0.0)


def _asked_prompt_logprobs(req: ParsedRequest, result: Result) -> list | None:
    """The prompt logprobs the line asked for (`prompt_logprobs: k`, k alternatives each), or None: an echo of a
    completion's logprobs has them computed without asking for the field (cli/replies.py `echoes_logprobs`)."""
    k = req.sampling.prompt_logprobs
    if k is None or result.prompt_logprobs is None:
        return None
    return with_alternatives(result.prompt_logprobs, k)


def _completion_prompt(asked: list | None, tokens: TokenText) -> dict:
    """vLLM's server puts a completion's prompt logprobs in each choice."""
    if asked is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(asked, tokens)}


def _token_ids(choice: Completion, reply: ReplyShaper) -> dict:
    return {"token_ids": list(choice.token_ids)} if reply.options.return_token_ids else {}


def _chat_choice(choice: Completion, reply: ReplyShaper) -> dict:
    message, finish_reason = reply.message(choice.text, choice.finish_reason)
    return {"message": message, "finish_reason": finish_reason}


def format_error(err: LineError) -> dict:
    """The output record for a line that produced no result."""
    if not err.openai_shape:
        return {"custom_id": err.custom_id, "error": {"line": err.line_no, "message": err.message}}
    return {
        "id": _batch_request_id(err.custom_id if err.custom_id is not None else f"line-{err.line_no}"),
        "custom_id": err.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": err.message, "line": err.line_no},
    }


def _usage_record(result: Result) -> dict:
    usage = result.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _batch_request_id(custom_id: str) -> str:
    return _derived_id("batch_req_", custom_id)


def _derived_id(prefix: str, custom_id: str) -> str:
    # The prefix is hashed too, so a request's batch id, request id and completion id all differ.
    digest = hashlib.sha256(f"{prefix}\0{custom_id}".encode("utf-8")).hexdigest()
    return f"{prefix}{digest[:32]}"
