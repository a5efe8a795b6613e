"""The one shard-and-retry of both worker pools (engine/scale/sharded_window.py), with hand-made requests and
workers named by strings: no process, no model."""
from __future__ import annotations

from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.scale.sharded_window import ShardedWindow


def requests(n=6):
    sp = SamplingParams(max_tokens=4)
    # two documents of three questions each: the trie has two subtrees, one per worker
    return [Request(f"r{i}", [100 * (i // 3) + k for k in range(50)] + [9000 + i], sp, i) for i in range(n)]


def window(workers=("a", "b")):
    return ShardedWindow(requests(), list(workers), reuse=True, decode_weight=1.0)


def test_every_request_is_assigned_once_and_pending_until_delivered():
    w = window()
    assigned = sorted(r.index for a in w.assignments for r in a.requests)
    assert assigned == list(range(6)) and w.pending == set(range(6))
    assert {a.worker for a in w.assignments} == {"a", "b"}
    assert sum(a.distinct_tokens for a in w.assignments) == w.plan.distinct_tokens + w.plan.duplicated_tokens


def test_a_second_result_for_a_request_is_dropped():
    # a worker's late copy of a request that was handed on (or a duplicate) is not a second Result
    w = window()
    assert w.deliver(3) is True
    assert w.deliver(3) is False
    assert 3 not in w.pending


def test_a_failed_workers_requests_go_once_to_the_least_loaded_survivor():
    w = window(("a", "b", "c"))
    lost = requests()[:3]
    w.deliver(0)  # request 0 finished before the failure: it is not run again
    load = {"b": 5, "c": 1}
    moved = w.reassign(lost, ["b", "c"], load.get, "worker a failed: killed")
    assert moved.target == "c" and [r.index for r in moved.again] == [1, 2] and moved.failed == []
    assert w.pending == {1, 2, 3, 4, 5}


def test_a_request_whose_second_worker_fails_too_gets_an_error():
    w = window(("a", "b", "c"))
    lost = requests()[:2]
    first = w.reassign(lost, ["b", "c"], lambda s: 0, "worker a failed")
    assert first.target == "b" and len(first.again) == 2
    second = w.reassign(first.again, ["c"], lambda s: 0, "worker b failed: out of memory")
    assert second.target is None and second.again == []
    assert [(r.index, r.finish_reason, r.error) for r in second.failed] == \
        [(0, "error", "worker b failed: out of memory"), (1, "error", "worker b failed: out of memory")]
    assert w.pending == {2, 3, 4, 5}  # each request yields exactly one Result: the failed ones are done


def test_no_survivor_means_errors_at_once():
    w = window(("a",))
    moved = w.reassign(requests()[:2], [], lambda s: 0, "worker a failed")
    assert moved.target is None and [r.index for r in moved.failed] == [0, 1]
    assert all(r.usage.prompt_tokens == 51 and r.token_ids == [] for r in moved.failed)


def test_requests_already_delivered_or_failed_are_not_reassigned():
    w = window()
    w.deliver(1)
    w.reassign(requests()[2:3], [], lambda s: 0, "gone")  # request 2 failed
    moved = w.reassign(requests()[:3], ["b"], lambda s: 0, "worker a failed")
    assert [r.index for r in moved.again] == [0] and moved.failed == []
