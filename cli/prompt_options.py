"""The request fields that change how a prompt becomes tokens, beside the prompt itself: `documents`,
`add_special_tokens`, `truncate_prompt_tokens` / `truncation_side` and `reasoning_effort`, as vLLM reads them."""
from __future__ import annotations

import dataclasses
from typing import Any

from prefixrun.engine.load.messages import check_documents
from prefixrun.engine.load.prompts import ChatPrompt, Prompt, Truncation
from prefixrun.engine.request import InvalidRequest, describe_value

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def with_prompt_options(prompt: Prompt, fields: dict, where: str) -> Prompt:
    """`prompt` with the options its request gives (null: not given); InvalidRequest naming a bad one."""
    changes: dict[str, Any] = {}
    tokens = fields.get("truncate_prompt_tokens")
    if tokens is not None:
        try:
            changes["truncation"] = Truncation(tokens, fields.get("truncation_side") or "left")
        except InvalidRequest as err:
            raise InvalidRequest(f"{where}{err}") from None
    elif fields.get("truncation_side") not in (None, "left", "right"):
        raise InvalidRequest(f'{where}truncation_side must be "left" or "right", got '
                             f"{describe_value(fields['truncation_side'])}")
    special = fields.get("add_special_tokens")
    if special is not None:
        if not isinstance(special, bool):
            raise InvalidRequest(f"{where}add_special_tokens must be true or false, got {describe_value(special)}")
        if not hasattr(prompt, "add_special_tokens"):
            raise InvalidRequest(f"{where}add_special_tokens does not apply to prompt_token_ids (they are used "
                                 "as given)")
        changes["add_special_tokens"] = special
    if isinstance(prompt, ChatPrompt):
        if fields.get("documents") is not None:
            changes["documents"] = check_documents(fields["documents"], f"{where}documents")
        effort = fields.get("reasoning_effort")
        if effort is not None:
            changes["template_kwargs"] = _with_reasoning_effort(prompt.template_kwargs, effort, where)
            changes["reasoning_effort"] = effort
    return dataclasses.replace(prompt, **changes) if changes else prompt


def _with_reasoning_effort(template_kwargs: dict, effort: Any, where: str) -> dict:
    """As vLLM passes it: the template's `reasoning_effort` variable, and thinking on unless it is "none" (for
    templates that switch thinking with enable_thinking), the request's own chat_template_kwargs winning."""
    if effort not in REASONING_EFFORTS:
        raise InvalidRequest(f"{where}reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                             f"{describe_value(effort)}")
    return {"reasoning_effort": effort, "enable_thinking": effort != "none", **template_kwargs}
