"""The scheduler (engine/plan/scheduler.py) alone on the CPU: hand-built plans over small pools, no model.

Pools of 4-token blocks; each case says what the one admission rule (seats, slots, blocks) or the stack decides.
"""
from __future__ import annotations

import pytest

from prefixrun.engine.plan.planner import make_plan
from prefixrun.engine.plan.scheduler import Handoff, Scheduler
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.state.checkpoints import CheckpointPool
from prefixrun.engine.state.pools import ModelState, RegionSpec
from prefixrun.engine.step.sequence import Sequence
from prefixrun.kernels.reference import NumpyOps

BS = 4  # tokens per K/V block
SPECS = [RegionSpec("s", False, (2,), "float32"), RegionSpec("kv", True, (2,), "act")]


def pools(slots=16, blocks=64):
    state = ModelState(SPECS, NumpyOps(), num_slots=slots, num_blocks=blocks, block_size=BS)
    return state, CheckpointPool(state, budget_bytes=1 << 30)


def requests_of(prompts, max_tokens=4):
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens), i) for i, p in enumerate(prompts)]


def scheduler(prompts, *, slots=16, blocks=64, max_batch=8, max_prefill_tokens=1000, max_context=4096,
              max_tokens=4, reserved_blocks=0):
    state, pool = pools(slots, blocks)
    requests = requests_of(prompts, max_tokens)
    plan = make_plan([r.prompt_token_ids for r in requests])
    sched = Scheduler(state, pool, requests, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                      max_context=max_context, reserved_blocks=reserved_blocks)
    sched.push(plan.roots, None)
    return sched, plan, state, pool


def test_pushed_consumers_run_first_one_first():
    # three unrelated prompts: three root tasks; the stack's top is the first, so work goes in plan order
    sched, plan, _, _ = scheduler([[1] * 8, [2] * 8, [3] * 8])
    assert [t.id for t in reversed(sched.pending)] == [t.id for t in plan.roots]
    assert all(sched.base[t.id] is None and sched.base_length(t) == 0 for t in plan.roots)


def test_a_request_task_counts_its_blocks_up_to_its_growth_margin():
    # 10 prompt tokens + its first new ones, at most one block's worth (4) and at most max_tokens - 1 (the last
    # token is never written): 13 positions -> 4 blocks of 4, plus one for the copy of a shared partial block
    sched, plan, _, _ = scheduler([list(range(10))], max_tokens=4)
    (task,) = plan.roots
    assert sched.task_blocks(task) == -(-(10 + 4 - 1) // BS) + 1
    assert sched.todo_tokens(task) == 10
    # with up to 1,000 new tokens it is still admitted for what it needs now: 10 + 4 positions, not 1,009
    sched, plan, _, _ = scheduler([list(range(10))], max_tokens=1000)
    assert sched.task_blocks(plan.roots[0]) == -(-(10 + BS) // BS) + 1 == 5
    # one new token: only the prompt's positions
    sched, plan, _, _ = scheduler([list(range(10))], max_tokens=1)
    assert sched.task_blocks(plan.roots[0]) == -(-10 // BS) + 1


def test_the_context_caps_a_requests_admitted_length():
    # 10 tokens + a margin of 4 past a context of 12: the blocks stop at the context (3 blocks, + 1)
    sched, plan, _, _ = scheduler([list(range(10))], max_tokens=1000, max_context=12)
    assert sched.task_blocks(plan.roots[0]) == 12 // BS + 1


def test_a_base_checkpoints_blocks_are_not_counted_again():
    # two requests over a shared 8-token prefix: the prefix task saves a checkpoint (2 blocks); each suffix task
    # needs only the blocks past it
    sched, plan, state, pool = scheduler([[7] * 8 + [1, 2], [7] * 8 + [3, 4]], max_tokens=2)
    (prefix,) = plan.roots
    assert prefix.saves and len(prefix.consumers) == 2
    h = state.new_sequence()
    state.reserve(h, 8)
    h.length = 8
    entry, _ = pool.save(prefix.path, h, None, consumers=[c.id for c in prefix.consumers])
    sched.admit(sched.next_group([]))
    sched.push(prefix.consumers, entry)
    child = prefix.consumers[0]
    assert sched.base_length(child) == 8 and sched.todo_tokens(child) == 2
    assert sched.task_blocks(child) == state.blocks_for(8 + 2 + 2 - 1) - 2 + 1
    assert sched.task_blocks(child, None) == state.blocks_for(11) + 1  # from scratch: every block


def test_seats_bound_the_requests_of_a_group_with_the_decoding_ones():
    # max_batch 2 with one sequence decoding: a group of two requests does not fit, one does
    sched, plan, state, _ = scheduler([[1] * 4, [2] * 4, [3] * 4], max_batch=2)
    decoding = [Sequence(requests_of([[9]])[0], state.new_sequence(), None, 4096)]
    assert not sched.can_admit(plan.roots[:2], decoding)
    assert sched.can_admit(plan.roots[:1], decoding)
    assert [t.id for t in sched.next_group(decoding)] == [plan.roots[0].id]


def test_a_group_needs_one_slot_per_task_plus_a_spare():
    # 3 free slots: two tasks (+ the spare for a retained copy) fit, three do not
    sched, plan, _, _ = scheduler([[1] * 4, [2] * 4, [3] * 4], slots=3)
    assert sched.can_admit(plan.roots[:2], [])
    assert not sched.can_admit(plan.roots, [])


def test_blocks_count_the_growth_margin_of_decoding_sequences_not_their_last_length():
    # 8 blocks, 7 free beside a decoding sequence at length 4 with 12 tokens to go: it counts the block of its
    # next 4 tokens, not the 3 of its last length; a task of 5 tokens with 100 new ones to come is admitted for
    # its first 4 (9 positions: 3 blocks, + 1), not for all 100 (26 blocks); one of 20 tokens (6 + 1) is not
    sched, plan, state, _ = scheduler([[1] * 5, list(range(20))], blocks=8, max_tokens=100)
    h = state.new_sequence()
    state.reserve(h, 4)
    h.length = 4
    seq = Sequence(Request("d", [0] * 4, SamplingParams(max_tokens=13), 9), h, None, 4096)
    seq.tokens.append(5)  # one token generated: 12 to go
    assert sched.growth([seq]) == state.blocks_needed(h, 4 + BS) == 1
    small, large = plan.roots
    assert sched.task_blocks(small) == 4 and sched.task_blocks(large) == 7
    assert sched.can_admit([small], [seq]) and not sched.can_admit([large], [seq])
    # with two tokens to go it counts the block of those two only, and none once done
    seq.tokens.extend([6] * 10)
    assert seq.remaining == 2 and sched.growth([seq]) == state.blocks_needed(h, 6) == 1
    seq.tokens.extend([6] * 2)
    assert sched.growth([seq]) == 0


def test_a_group_stops_at_the_step_token_budget():
    # three 6-token siblings with 13 tokens per step: the first two go together, the third waits
    sched, plan, _, _ = scheduler([[1] * 6, [2] * 6, [3] * 6], max_prefill_tokens=13)
    assert [t.id for t in sched.next_group([])] == [t.id for t in plan.roots[:2]]


def test_a_task_over_the_budget_still_runs_alone():
    # a single task longer than one step's budget is a group of its own (the executor splits it into steps)
    sched, plan, _, _ = scheduler([[1] * 50, [2] * 6], max_prefill_tokens=13)
    assert [t.id for t in sched.next_group([])] == [plan.roots[0].id]


def test_a_handed_over_state_runs_alone():
    # a state handed over whole (no checkpoint) is never prefilled in a group with another task
    sched, plan, state, _ = scheduler([[1] * 4, [2] * 4])
    first, second = plan.roots
    sched.set_base(first, Handoff(state.new_sequence(), None))
    assert [t.id for t in sched.next_group([])] == [first.id]
    sched.set_base(first, None)
    sched.set_base(second, Handoff(state.new_sequence(), None))
    assert [t.id for t in sched.next_group([])] == [first.id]  # stops before the hand-over


def test_admit_takes_the_group_off_the_top_and_refuses_anything_else():
    sched, plan, _, _ = scheduler([[1] * 4, [2] * 4, [3] * 4])
    with pytest.raises(RuntimeError, match="not the top"):
        sched.admit([plan.roots[1]])
    sched, plan, _, _ = scheduler([[1] * 4, [2] * 4, [3] * 4])
    sched.admit(plan.roots[:2])
    assert [t.id for t in sched.pending] == [plan.roots[2].id]


def test_a_task_that_cannot_fit_an_empty_pool_is_known_as_such():
    # 5 blocks, one held back for the decode graphs' scratch: a request of 16 tokens (+1) needs 5 and never fits
    sched, plan, _, _ = scheduler([list(range(13)), [1] * 4], blocks=5, reserved_blocks=1, max_tokens=4)
    big, small = plan.roots
    assert not sched.fits_alone(big) and sched.fits_alone(small)


def test_consumers_of_a_base_and_the_pending_ids():
    sched, plan, state, _ = scheduler([[1] * 4, [2] * 4, [3] * 4])
    handoff = Handoff(state.new_sequence(), None)
    sched.set_base(plan.roots[1], handoff)
    assert sched.consumers_of(handoff) == [plan.roots[1]]
    assert sched.pending_ids() == {t.id for t in plan.roots}
    assert sched.pop() is plan.roots[0]
