"""The command line's options about chat lines: their --help panel and the check of --chat-template-kwargs
(--tool-call-parser and --reasoning-parser are checked by cli/replies.py, which uses them)."""
from __future__ import annotations

import json

import typer

from prefixrun.cli.reasoning import REASONING_PARSERS
from prefixrun.cli.tool_calls import TOOL_CALL_PARSERS

PANEL = "Chat requests"
TOOL_CALL_PARSER_HELP = f"reads tool calls out of chat replies: {', '.join(TOOL_CALL_PARSERS)} (auto: as the chat " \
                        "template asks)"
REASONING_PARSER_HELP = f"splits <think> reasoning out of chat replies: {', '.join(REASONING_PARSERS)} (auto: " \
                        "as the chat template writes)"


def parse_chat_template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs: a JSON object, checked as a line's chat_template_kwargs is."""
    from prefixrun.engine.load.messages import check_template_kwargs

    if text is None:
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise typer.BadParameter(f'--chat-template-kwargs is not valid JSON ({detail}); give an object such as '
                                 f'\'{{"enable_thinking": false}}\'') from None
    return check_template_kwargs(value, "--chat-template-kwargs")
