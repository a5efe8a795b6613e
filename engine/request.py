"""What goes into the engine (Request, SamplingParams) and what comes out (Result, Usage).

These are the only types shared between cli/ and engine/: the CLI turns input lines into Requests and
Results into output lines; the engine never sees JSON.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request that cannot be run as given; the message is meant for the person who wrote it."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, named as vLLM names them. Validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(msg):
            raise InvalidRequest(msg)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class Request:
    """One prompt to complete. `prompt_token_ids` is filled by the tokenizer before planning."""

    custom_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    index: int = 0  # position in the input, used to write results in input order


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from a checkpoint instead of computed
    cached_from_disk_tokens: int = 0  # the part of cached_tokens that came from the persistent store


@dataclass
class Result:
    custom_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos, stop string or stop token), "length", or "error" (see `error`)
    usage: Usage
    error: str | None = None  # why the request could not run (e.g. its state can never fit the state memory)
