"""The window executor (engine/run/executor.py) alone on the CPU: hand-built plans, the real pools, and a fake model
runner whose next token is (last token x 7 + 3) mod 61, so every step's work is known and recorded. Its
collaborators (pools, runner, cache, speculator, statistics) are passed in as WindowParts; each case says what it
checks."""
from __future__ import annotations

import numpy as np

from prefixrun.engine.cache.no_cache import NoCache
from prefixrun.engine.grammar.compiler import GrammarCompiler
from prefixrun.engine.plan.planner import make_plan
from prefixrun.engine.plan.trace import Trace
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import EngineOptions, RunStats
from prefixrun.engine.run.executor import WindowExecutor, WindowParts
from prefixrun.engine.spec.speculator import NoSpeculation
from prefixrun.engine.state.checkpoints import CheckpointPool
from prefixrun.engine.step.sequence import DecodingStarts
from prefixrun.engine.state.pools import ModelState, RegionSpec
from prefixrun.kernels.reference import NumpyOps

VOCAB = 61
BS = 4
SPECS = [RegionSpec("s", False, (2,), "float32"), RegionSpec("kv", True, (2,), "act")]


def next_token(t: int) -> int:
    return (t * 7 + 3) % VOCAB


class FakeRunner:
    """The model runner's interface over the real pools: states advance (blocks reserved, lengths), logits are one-hot
    at next_token(last token); each prefill step's pieces and each decode step's batch size are recorded."""

    generated_tokens_as_steps = False  # a prefill and a decode step compute a token alike
    vocab_size = VOCAB

    def __init__(self, state: ModelState):
        self.state = state
        self.prefills: list[list[list[int]]] = []
        self.decodes: list[int] = []

    def _logits(self, last: list[int]) -> np.ndarray:
        out = np.zeros((len(last), VOCAB), np.float32)  # [B, V]
        out[np.arange(len(last)), [next_token(t) for t in last]] = 1.0
        return out

    def prefill(self, handles, pieces):
        self.state.prepare_step(handles, pieces)
        self.prefills.append([list(p) for p in pieces])
        return self._logits([p[-1] for p in pieces])

    def prepare_decode(self, handles):
        pass

    def sample(self, seqs, logits) -> list[int]:
        return [int(i) for i in np.argmax(np.asarray(logits), axis=-1)]

    def decode(self, seqs) -> list[int]:
        self.state.prepare_step([s.handle for s in seqs], [[s.tokens[-1]] for s in seqs])
        self.decodes.append(len(seqs))
        return [next_token(s.tokens[-1]) for s in seqs]


class StoredPrefixes(NoCache):
    """A persistent cache holding some prefixes' states (exported from the pools), read back on lookup."""

    keeps_states = True

    def __init__(self):
        self.entries: dict[tuple, tuple] = {}

    def lookup(self, tokens, minimum, maximum, state, share=None, usable=None):
        for n in range(maximum, minimum, -1):
            hit = self.entries.get(tuple(tokens[:n]))
            if hit is not None and (n < maximum or hit[1] is not None):
                return state.import_state(hit[0], n, share=share), (hit[1] if n == maximum else None)
        return None

    def offer(self, tokens, state, handle, logits):
        self.entries.setdefault(tuple(tokens), (state.export(handle), None if logits is None else logits.copy()))
        return True

    def may_retain(self, tokens, nbytes):
        return True


def parts(*, max_batch=8, max_prefill_tokens=1000, slots=32, blocks=128, cache=None, reuse=True):
    state = ModelState(SPECS, NumpyOps(), num_slots=slots, num_blocks=blocks, block_size=BS)
    options = EngineOptions(max_batch=max_batch, max_prefill_tokens=max_prefill_tokens, block_size=BS,
                            speculative="off", overlap_decode=False, reuse=reuse)
    return WindowParts(options, state, CheckpointPool(state, budget_bytes=1 << 30), FakeRunner(state), state.ops,
                       cache or NoCache(), NoSpeculation(), RunStats(),
                       DecodingStarts(None, 4096, frozenset(), GrammarCompiler(None, VOCAB)))


def run(prompts, p, max_tokens=3, reuse=True):
    requests = [Request(f"r{i}", list(x), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), i)
                for i, x in enumerate(prompts)]
    plan, trace = make_plan([r.prompt_token_ids for r in requests], share=reuse), Trace()
    results = {r.custom_id: r for r in WindowExecutor(requests, plan, trace, p).execute()}
    return results, plan, trace


def expected_tokens(prompt, n=3):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = next_token(t)
        out.append(t)
    return out


def test_a_shared_prefix_is_prefilled_once_and_every_request_decodes_its_own_tokens():
    # three requests over one 12-token prefix: the prefix is computed once, saved, and forked by each suffix;
    # every token is the fake model's, and the pools are whole afterwards
    prefix = [5] * 12
    prompts = [prefix + [1, 2], prefix + [3], prefix + [4, 5, 6]]
    p = parts()
    results, plan, trace = run(prompts, p)
    assert {k: r.token_ids for k, r in results.items()} == {f"r{i}": expected_tokens(x) for i, x in
                                                            enumerate(prompts)}
    computed = sum(len(piece) for step in p.runner.prefills for piece in step)
    assert computed == plan.distinct_tokens == 12 + 2 + 1 + 3
    assert len(trace.of("save")) == 1 and len(trace.of("fork")) == 3
    assert p.stats.computed_prompt_tokens == 18 and p.stats.completion_tokens == 9
    # the first request under the prefix is charged for it; the other two reused it
    assert [results[f"r{i}"].usage.cached_tokens for i in range(3)] == [0, 12, 12]
    p.state.check_invariants()
    p.pool.drain()
    assert not p.state.live and p.state.blocks.free_count == p.state.blocks.num_blocks


def test_a_step_takes_at_most_the_prefill_token_budget():
    # a 30-token prompt with 8 tokens per step: four steps of 8, 8, 8 and 6 tokens
    p = parts(max_prefill_tokens=8)
    run([list(range(30))], p)
    assert [sum(len(x) for x in step) for step in p.runner.prefills] == [8, 8, 8, 6]


def test_decode_steps_hold_at_most_max_batch_sequences():
    # five unrelated requests with two seats: decode steps of at most two, and all five finish
    p = parts(max_batch=2)
    results, _, _ = run([[i + 1] * 5 for i in range(5)], p, max_tokens=4)
    assert len(results) == 5 and max(p.runner.decodes) <= 2
    assert p.stats.peak_decode_batch == 2


def test_a_request_that_can_never_fit_gets_an_error_and_the_others_run():
    # 12 blocks of 4 tokens (one held for the decode graphs' scratch): a 60-token prompt can never fit, the short
    # ones run; the error names the option to raise
    p = parts(blocks=12)
    results, _, trace = run([[1] * 4, list(range(60)), [2] * 4], p)
    assert results["r1"].error is not None and "--state-memory" in results["r1"].error
    assert results["r0"].error is None and results["r2"].error is None
    assert p.stats.failed_requests == 1 and len(trace.of("error")) == 1


def test_states_from_the_persistent_cache_are_not_computed_again():
    # a first window offers the cache its branch point (while fresh) and each prompt's end state; a second window
    # over the same prompts restores them instead of prefilling anything, and the usage says they came from disk
    prefix = [9] * 12
    prompts = [prefix + [1, 2], prefix + [3, 4]]
    cache = StoredPrefixes()
    run(prompts, parts(cache=cache))
    assert set(cache.entries) == {tuple(prefix), *map(tuple, prompts)}
    p = parts(cache=cache)
    results, _, trace = run(prompts, p)
    assert [e.note for e in trace.of("hit")] == ["disk"] * 3 and p.runner.prefills == []
    assert p.stats.computed_prompt_tokens == 0
    assert [r.usage.cached_from_disk_tokens for r in results.values()] == [14, 14]
    assert {k: r.token_ids for k, r in results.items()} == {f"r{i}": expected_tokens(x) for i, x in
                                                            enumerate(prompts)}


def test_without_reuse_every_request_is_prefilled_whole():
    # reuse off: no checkpoint, no fork; each request's whole prompt is computed
    prefix = [3] * 8
    prompts = [prefix + [1], prefix + [2]]
    p = parts(reuse=False)
    results, _, trace = run(prompts, p, reuse=False)
    assert sum(len(x) for step in p.runner.prefills for x in step) == 18
    assert not trace.of("save") and not trace.of("fork")
    assert all(r.usage.cached_tokens == 0 for r in results.values())
