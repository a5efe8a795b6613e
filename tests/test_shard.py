"""Sharding a window's trie over workers (engine/plan/shard.py): no model needed, exact token counts."""
from __future__ import annotations

import random

import pytest

from prefixrun.engine.plan.planner import build_trie, distinct_tokens
from prefixrun.engine.plan.shard import shard_window


def shared_system(requests=64, prefix=2048, suffix=256):
    return [list(range(prefix)) + [100000 + i * suffix + j for j in range(suffix)] for i in range(requests)]


def doc_qa(docs=4, per_doc=16, prefix=4096, suffix=128):
    return [[d * 10**6 + k for k in range(prefix)] + [d * 10**6 + 500000 + q * suffix + k for k in range(suffix)]
            for d in range(docs) for q in range(per_doc)]


def random_tree(seed, n=200):
    rng = random.Random(seed)
    return [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def check_exact(prompts, plan, workers):
    """Every request in exactly one shard; each shard's token count is the size of its own trie."""
    assigned = sorted(r for s in plan.shards for r in s.requests)
    assert assigned == list(range(len(prompts)))
    assert len(plan.shards) == workers
    for s in plan.shards:
        sub = [prompts[r] for r in s.requests]
        assert s.distinct_tokens == (distinct_tokens(build_trie(sub)) if sub else 0)
    assert plan.distinct_tokens == distinct_tokens(build_trie(prompts))
    assert plan.duplicated_tokens == sum(s.distinct_tokens for s in plan.shards) - plan.distinct_tokens >= 0


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", ["shared-system", "doc-qa", "random-0", "random-1", "duplicates"])
def test_shards_cover_every_request_once_with_exact_counts(shape, workers):
    prompts = {"shared-system": shared_system(16, 300, 40), "doc-qa": doc_qa(3, 5, 400, 20),
               "random-0": random_tree(0), "random-1": random_tree(1),
               "duplicates": [[1, 2, 3]] * 7 + [[4]]}[shape]
    plan = shard_window(build_trie(prompts), [8] * len(prompts), workers)
    check_exact(prompts, plan, workers)


def test_one_worker_is_the_whole_trie():
    prompts = random_tree(3)
    plan = shard_window(build_trie(prompts), [4] * len(prompts), 1)
    assert plan.duplicated_tokens == 0 and len(plan.shards[0].requests) == len(prompts)


def test_documents_stay_whole_when_they_divide_evenly():
    # 4 documents over 2 or 4 workers: each document's 4096 tokens are computed on one worker only
    for workers in (2, 4):
        plan = shard_window(build_trie(doc_qa()), [64] * 64, workers)
        assert plan.duplicated_tokens == 0
        assert plan.balance == pytest.approx(1.0)


def test_long_shared_root_is_duplicated_only_when_idling_costs_more():
    # 64 x (2048 shared + 256): splitting duplicates 2048 tokens per extra worker but halves the rest
    plan = shard_window(build_trie(shared_system()), [64] * 64, 2)
    assert plan.duplicated_tokens == 2048 and plan.balance == pytest.approx(1.0)
    # 5 copies of a 1000-token prompt and one 1-token prompt: duplicating the long prompt would save ~1% of the
    # wall time for 2000 more tokens; the copies stay together
    prompts = [list(range(1000))] * 5 + [[7]]
    plan = shard_window(build_trie(prompts), [4] * 6, 3)
    assert plan.duplicated_tokens == 0
    assert sorted(len(s.requests) for s in plan.shards) == [0, 1, 5]


def test_more_documents_than_workers_cut_at_most_where_needed():
    plan = shard_window(build_trie(doc_qa()), [64] * 64, 3)
    check_exact(doc_qa(), plan, 3)
    # 4 equal documents on 3 workers: the best contiguous cut splits documents at most twice
    assert plan.duplicated_tokens <= 2 * 4096
    assert plan.balance < 1.2


def test_decode_weight_moves_the_balance():
    # two prompts sharing nothing: one long prompt with a short answer, many short prompts with long answers
    prompts = [list(range(5000))] + [[10**6 + i] for i in range(50)]
    max_tokens = [1] + [100] * 50
    light = shard_window(build_trie(prompts), max_tokens, 2, decode_weight=0.01)
    heavy = shard_window(build_trie(prompts), max_tokens, 2, decode_weight=10.0)
    for plan in (light, heavy):
        check_exact(prompts, plan, 2)
    # prefill-dominated: the long prompt alone on one worker; decode-dominated: the long prompt counts for about
    # five short ones and the work is even
    assert min(len(s.requests) for s in light.shards) == 1
    assert max(len(s.requests) for s in heavy.shards) < 30 and heavy.balance < 1.05


def test_no_reuse_trie_balances_by_prompt():
    prompts = shared_system(8, 100, 10)
    plan = shard_window(build_trie(prompts, share=False), [4] * 8, 2)
    assert [len(s.requests) for s in plan.shards] == [4, 4]
    assert plan.duplicated_tokens == 0  # without sharing there is nothing to duplicate


def test_empty_window_and_bad_worker_count():
    plan = shard_window(build_trie([]), [], 3)
    assert [s.requests for s in plan.shards] == [(), (), ()] and plan.balance == 0.0
    with pytest.raises(ValueError):
        shard_window(build_trie([[1]]), [1], 0)
