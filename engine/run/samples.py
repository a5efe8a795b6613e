"""A request's samples gathered into its one Result.

A request decodes `sampling.sequences` sequences (engine/request.py): n samples, or best_of candidates of which the
n of highest cumulative logprob are returned (vLLM's best_of: the sum of the sampled tokens' logprobs, best first),
or one for a greedy request (its n choices are that one completion). Each finished sequence (or each sample refused
for the state memory) is added to the request's `SampleSet`; the last one makes the Result. Usage is the
response's: the prompt counted once, completion tokens summed over every sample generated (best_of's candidates
that are not returned included, as OpenAI counts them) and over the choices (a greedy request's n identical
choices each count).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from prefixrun.engine.request import Completion, Request, Result, Usage


@dataclass(eq=False)
class SampleSet:
    """The samples of one request that have ended so far."""

    request: Request
    completions: dict[int, Completion] = field(default_factory=dict)  # sample index -> its completion
    errors: dict[int, str] = field(default_factory=dict)  # sample index -> why it could not run
    computed: int = -1  # prompt tokens computed for the request (the most any sample's chain was charged)
    from_disk: int = 0  # of the others, those restored from the persistent store (that same chain's)
    prompt_logprobs: list | None = None  # engine/run/prompt_logprobs.py, when the request asks for them

    @property
    def expected(self) -> int:
        return self.request.sampling.sequences

    @property
    def complete(self) -> bool:
        return len(self.completions) + len(self.errors) == self.expected

    def add(self, sample: int, completion: Completion, computed: int, from_disk: int):
        """A sample's sequence ended; `computed` and `from_disk`: the prompt tokens its state's chain charged."""
        self._check_new(sample)
        self.completions[sample] = completion
        if computed > self.computed:  # a sample rebased under memory pressure may have recomputed part of it
            self.computed, self.from_disk = computed, from_disk

    def fail(self, sample: int, message: str):
        self._check_new(sample)
        self.errors[sample] = message

    def _check_new(self, sample: int):
        if not 0 <= sample < self.expected or sample in self.completions or sample in self.errors:
            raise ValueError(f"sample {sample} of request {self.request.custom_id!r} ended twice or does not exist")

    @property
    def error(self) -> str | None:
        """Why the request failed (its first failed sample's reason); None if every sample ran."""
        return self.errors[min(self.errors)] if self.errors else None

    def result(self) -> Result:
        """The request's Result once `complete` and no sample failed."""
        if not self.complete or self.errors:
            raise RuntimeError(f"request {self.request.custom_id!r} has no result yet")
        sp = self.request.sampling
        generated = [self.completions[i] for i in range(self.expected)]
        choices = generated
        if len(generated) < sp.n:  # a greedy request's samples are all its one completion
            choices = [dataclasses.replace(generated[0], token_ids=list(generated[0].token_ids))
                       for _ in range(sp.n)]
        elif len(generated) > sp.n:  # best_of: the n most likely, best first (a tie keeps the lower sample first)
            choices = sorted(generated, key=lambda c: -c.cumulative_logprob)[:sp.n]
        prompt = len(self.request.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in (generated if len(generated) > sp.n else choices))
        usage = Usage(prompt, completion_tokens, prompt - max(self.computed, 0), self.from_disk)
        return Result(self.request.custom_id, self.request.index, choices, usage,
                      prompt_logprobs=self.prompt_logprobs)


def error_result(r: Request, message: str, stats) -> Result:
    """The Result of a request the engine cannot run (counted in the run's statistics)."""
    stats.failed_requests += 1
    return Result(r.custom_id, r.index, [], Usage(len(r.prompt_token_ids), 0, 0, 0), error=message)
