"""Speculative decoding on the CPU reference (fp32): greedy outputs identical to speculation off for every family,
every draft count and mixed counts, with prefix reuse and from disk; rollback restores exactly the regions of a
non-speculative run after every possible accepted count; the sampled path keeps the target's distribution."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import PARITY_STD, TINY_LLAMA, TINY_QWEN3, TINY_QWEN3_5_MOE, new_state, random_prompt, rollbacks
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.spec.drafters import DraftInput, Drafter, NgramDrafter
from prefixrun.engine.spec.speculator import Speculator
from prefixrun.engine.spec.verify import accept_greedy, accept_sampled
from test_gemma3 import TINY_GEMMA3

FAMILIES = {"qwen3_5": TINY_QWEN3_5, "qwen3": TINY_QWEN3, "llama": TINY_LLAMA, "gemma3": TINY_GEMMA3,
            "qwen3_5_moe": TINY_QWEN3_5_MOE}


@pytest.fixture(scope="module")
def models(tmp_path_factory, cpu_ops):
    root = tmp_path_factory.mktemp("spec-models")
    return {name: load_model(make_model_dir(root / name, cfg, seed=7, init_std=PARITY_STD), cpu_ops)[0]
            for name, cfg in FAMILIES.items()}


def prompts():
    base = random_prompt(100, 37)
    return [base + random_prompt(101, 9), base + random_prompt(102, 4), base, [5, 6, 7] * 9,
            random_prompt(103, 17) * 2]


class OracleDrafter:
    """Drafts the true greedy continuation (from a run with speculation off) with deliberate errors, so steps
    accept every count from 0 to k; each sequence gets its own draft count (mixed k)."""

    method = "oracle"
    needs_hidden = False

    def __init__(self, reference: dict[str, list[int]], spread: bool = True):
        self.reference, self.spread = reference, spread

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        out = []
        for x in inputs:
            ref = self.reference[x.request.custom_id]
            done = len(x.tokens) - len(x.request.prompt_token_ids)  # tokens generated so far
            k = x.num_drafts
            if self.spread:
                k = 1 + (done + len(x.request.custom_id) * 3) % x.num_drafts  # per sequence and step
            draft = list(ref[done:done + k])
            for j in range(len(draft)):
                if (done * 7 + j * 3) % 11 == 0:  # a wrong token ends acceptance here
                    draft[j] = (draft[j] + 1) % 512
            out.append(draft)
        return out


def run(model, ops, prompt_list, opts, *, drafter=None, sampling=None, persist=None, verify_row_cost=None):
    eng = Engine(model, ops, options=opts, persist=persist)
    if verify_row_cost is not None:  # 0: every step with drafts verifies them (the adaptive policy otherwise on)
        eng.speculator.verify_row_cost = verify_row_cost
    if drafter is not None:  # a test drafter exercises the verify machinery on every step it can
        eng.speculator.drafter, eng.speculator.adaptive = drafter, False
    sp = sampling or SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompt_list)]
    out = {r.custom_id: r.token_ids for r in eng.run(reqs)}
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live and eng.state.blocks.free_count == eng.state.blocks.num_blocks
    stats = eng.speculator.stats if isinstance(eng.speculator, Speculator) else None
    return out, stats


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_identical_for_every_draft_count(family, models, cpu_ops):
    model = models[family]
    off, _ = run(model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4))
    rejected = 0
    for k in range(1, 9):
        spread = k % 2 == 0  # odd k: every sequence drafts k; even k: mixed counts per sequence and step
        opts = EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=k)
        on, stats = run(model, cpu_ops, prompts(), opts, drafter=OracleDrafter(off, spread))
        assert on == off, (family, k, spread)
        m = stats.methods["oracle"]
        assert m.drafted > 0 and 0 < m.accepted <= m.drafted
        rejected += m.drafted - m.accepted
    assert rejected > 0
    for overlap in (True, False):  # n-gram drafts decided beside the step in flight, or after it
        opts = EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=4, overlap_decode=overlap)
        on, stats = run(model, cpu_ops, prompts(), opts)
        # (beside the step in flight a draft needs its first token to come true: these models' chance matches
        # rarely do)
        assert on == off and (overlap or stats.methods["ngram"].drafted > 0)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_every_accepted_count_occurs_and_outputs_match(family, models, cpu_ops):
    """Across one run each accepted count 0..k occurs (so every rollback depth is exercised end to end)."""
    model = models[family]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref, _ = run(model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4), sampling=sp)
    seen: set[int] = set()
    drafter = OracleDrafter(ref, spread=False)
    eng = Engine(model, cpu_ops, options=EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=5))
    eng.speculator.drafter, eng.speculator.adaptive = drafter, False
    step = eng.speculator.step

    def spy(seqs, drafts):
        new = step(seqs, drafts)
        seen.update(len(t) - 1 for t, d in zip(new, drafts) if len(d) == 5)
        return new

    eng.speculator.step = spy
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts())])}
    eng.close()
    assert out == ref
    assert seen == set(range(6)), seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollback_restores_the_regions_of_a_plain_run(family, models, cpu_ops):
    """Feed R rows in one multi-row step, commit n (every n), and compare every region with a state that was fed
    the same first n tokens one decode step at a time."""
    model = models[family]
    prompt = random_prompt(5, 13)
    rows = random_prompt(6, 6)  # R = 6 <= the tiny Gemma's window of 8
    for n, st2, spec, plain in rollbacks(model, cpu_ops, prompt, rows):
        assert spec.length == plain.length == len(prompt) + n
        assert len(spec.blocks) == st2.blocks_for(spec.length)
        a, b = st2.export(spec), st2.export(plain)
        # equal up to fp32 rounding (the projections of 6 rows and of 1 row round differently in the last bits);
        # a state one row off differs by orders of magnitude more, which the continuation check below would show
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=2e-5, err_msg=f"{family} n={n} {name}")
        # and the rolled-back state continues exactly like the plain one
        la = model.forward(st2.prepare_step([spec], [[3]]), st2)
        lb = model.forward(st2.prepare_step([plain], [[3]]), st2)
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    assert st2.blocks.free_count == st2.blocks.num_blocks


def test_commit_and_prepare_refuse_misuse(models, cpu_ops):
    model = models["qwen3_5"]
    st = type(new_state(model, cpu_ops))(model.state_specs(), cpu_ops, num_slots=4, num_blocks=32, block_size=16,
                                         snapshot_capacity=3)
    h = st.new_sequence()
    with pytest.raises(RuntimeError, match="commit without"):
        st.commit([1])
    with pytest.raises(Exception, match="snapshot rows"):
        st.prepare_rows_step([h], [[1, 2, 3, 4, 5]])
    model.forward(st.prepare_rows_step([h], [[1, 2, 3]]), st, all_logits=True)
    with pytest.raises(RuntimeError, match="still waiting"):
        st.prepare_rows_step([h], [[1]])
    with pytest.raises(ValueError, match="commit keeps"):
        st.commit([4])
    st.commit([2])
    assert h.length == 2
    st.release(h)
    st.check_invariants()


def test_speculation_off_is_a_speculator_that_never_drafts(models, cpu_ops):
    # off (or auto where the backend may not use multi-row steps): the engine holds a NoSpeculation, so plain decode
    # steps keep their pipeline, nothing is timed, and the report has no speculative section
    from prefixrun.engine.spec.speculator import NoSpeculation

    class NoAuto(type(cpu_ops)):
        auto_speculation = False

    for ops, mode in ((cpu_ops, "off"), (NoAuto(), "auto")):
        eng = Engine(models["qwen3_5"], ops, options=EngineOptions(max_batch=4, speculative=mode))
        spec = eng.speculator
        assert isinstance(spec, NoSpeculation) and spec.overlaps_decode and spec.report() is None
        assert spec.drafts([object()]) is None and spec.redraft([object()]) is None and not spec.may_draft(1)
    on = Engine(models["qwen3_5"], cpu_ops, options=EngineOptions(max_batch=4, speculative="ngram"))
    # n-gram drafts need no hidden states: its plain steps keep the decode pipeline too
    assert isinstance(on.speculator, Speculator) and on.speculator.overlaps_decode
    assert on.speculator.may_draft(64)  # an explicit method drafts at any batch size; auto up to AUTO_MAX_BATCH
    auto = Engine(models["qwen3_5"], cpu_ops, options=EngineOptions(max_batch=32, speculative="auto")).speculator
    assert auto.may_draft(16) and not auto.may_draft(17)
    assert on.speculator.report()["mode"] == "ngram"


def test_snapshot_memory_comes_out_of_the_state_budget(models, cpu_ops):
    model = models["qwen3_5"]
    opts = dict(max_batch=4, state_memory_bytes=64 << 20)
    off = Engine(model, cpu_ops, options=EngineOptions(**opts, speculative="off"))
    on = Engine(model, cpu_ops, options=EngineOptions(**opts, speculative="ngram", num_draft_tokens=6))
    from prefixrun.engine.state.pools import snapshot_row_bytes

    rows = on.state.snapshot_capacity
    assert rows == 4 * 6 and off.state.snapshot_capacity == 0
    snap = (rows + 1) * snapshot_row_bytes(model.state_specs(), cpu_ops)  # + the scratch row
    assert snap > 0
    fewer = off.state.blocks.num_blocks - on.state.blocks.num_blocks  # the blocks the snapshot rows took
    assert snap // on.state.block_bytes <= fewer <= -(-snap // on.state.block_bytes)


def test_greedy_identical_with_prefix_reuse_and_from_disk(models, cpu_ops):
    from test_executor import StoredPrefixes

    model = models["qwen3_5"]
    ps = prompts() + [prompts()[0][:30] + [9, 9]]
    off, _ = run(model, cpu_ops, ps, EngineOptions(speculative="off", max_batch=4, reuse=False))
    disk = StoredPrefixes()
    opts = EngineOptions(max_batch=2, speculative="ngram", num_draft_tokens=3, retain_block=16)
    cold, _ = run(model, cpu_ops, ps, opts, drafter=OracleDrafter(off), persist=disk)
    assert disk.entries
    warm, _ = run(model, cpu_ops, ps, opts, drafter=OracleDrafter(off), persist=disk)
    assert cold == warm == off


def test_auto_drafts_only_for_greedy_requests_and_sampled_seeds_reproduce(models, cpu_ops):
    model = models["qwen3"]
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    off, _ = run(model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4), sampling=sp)
    auto, stats = run(model, cpu_ops, prompts(), EngineOptions(max_batch=4, speculative="auto"), sampling=sp)
    assert auto == off and stats.methods["ngram"].drafted == 0
    for overlap in (True, False):  # the drafts decided beside the step in flight, or after it
        opts = EngineOptions(max_batch=4, speculative="ngram", overlap_decode=overlap)
        a, sa = run(model, cpu_ops, prompts(), opts, sampling=sp, verify_row_cost=0)
        b, _ = run(model, cpu_ops, prompts(), opts, sampling=sp, verify_row_cost=0)
        assert a == b
        # (drafting on histories one token short finds none in these sampled replies, beside the step in flight)
        assert overlap or sa.methods["ngram"].drafted > 0 and sa.methods["ngram"].verify_steps > 0


# ---- verification rules --------------------------------------------------------------------------------------------
def test_accept_greedy_takes_the_longest_matching_prefix():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 9, 6], [4, 5, 6, 7]) == [4, 5]
    assert accept_greedy([9], [4, 5]) == [4]
    assert accept_greedy([], [4]) == [4]


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts from a deliberately different guess: the first two output tokens must still follow the target
    (chi-square against the exact distributions, 20000 seeds)."""
    rng = np.random.default_rng(0)
    v = 6
    rows = rng.normal(0, 1.5, (3, v)).astype(np.float32)  # [k + 1, V] the target's logits after each fed token
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_k=5)
    from prefixrun.kernels.sampling import filtered_probabilities

    p0 = filtered_probabilities(rows[0], 0.9, 5, 1.0, 0.0)
    p1 = filtered_probabilities(rows[1], 0.9, 5, 1.0, 0.0)
    drafts = [int(np.argsort(p0)[-2]), int(np.argmax(p1))]  # the second most likely first token: often rejected
    n = 20000
    first = np.zeros(v)
    second = np.zeros(v)
    for seed in range(n):
        toks = accept_sampled(drafts, rows, sp, seed, 3)
        assert 1 <= len(toks) <= 3
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
        assert toks == accept_sampled(drafts, rows, sp, seed, 3)  # reproducible per seed
    for counts, p in ((first, p0), (second, p1)):
        total = counts.sum()
        mask = p > 0
        assert counts[~mask].sum() == 0  # never a filtered-out token
        chi2 = (((counts - total * p) ** 2)[mask] / (total * p[mask])).sum()
        assert chi2 < 25, (chi2, counts / total, p)  # df <= 5: p-value ~1e-4


def test_ngram_lookup():
    d = NgramDrafter()
    assert isinstance(d, Drafter)
    assert d.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    assert d.lookup([5, 5, 5], 4) == [5, 5, 5, 5]  # a run continues past the history
    assert d.lookup([1, 2, 3, 1, 2, 3, 1], 5) == [2, 3, 1, 2, 3]
    assert d.lookup([1, 2, 3], 2) == [] and d.lookup([1], 3) == [] and d.lookup([1, 2, 1], 0) == []
    assert d.lookup([7, 1, 2, 8, 1, 2], 1) == [8]  # the longest suffix that matched (n = 2)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


# ---- CLI -------------------------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("isolated_env")
def test_cli_flags_report_and_same_output(tmp_path, models):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    model_dir = make_model_dir(tmp_path / "m", TINY_QWEN3, seed=7, init_std=PARITY_STD)
    work = tmp_path / "in.jsonl"
    with open(work, "w") as f:
        for i, p in enumerate(prompts()):
            f.write(json.dumps({"custom_id": f"c{i}", "prompt_token_ids": p, "max_tokens": 20, "temperature": 0,
                                "ignore_eos": True}) + "\n")
    runner = CliRunner()
    outs = {}
    for mode in ("off", "ngram", "auto"):
        rep = tmp_path / f"{mode}.json"
        res = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu", "--no-cache",
                                  "--speculative", mode, "--num-draft-tokens", "4", "-o", str(tmp_path / f"{mode}.out"),
                                  "--json-report", str(rep)])
        assert res.exit_code == 0, res.output
        outs[mode] = [json.loads(line)["token_ids"] if "token_ids" in json.loads(line) else json.loads(line)
                      for line in (tmp_path / f"{mode}.out").read_text().splitlines()]
        report = json.loads(rep.read_text())
        if mode == "off":
            assert "speculative" not in report.get("engine", report)
        else:
            spec = report.get("speculative") or report["engine"]["speculative"]
            m = spec["methods"]["ngram"]
            assert m["drafted"] > 0 and m["accepted"] > 0 and 0 < m["acceptance_rate"] <= 1
            assert "time_saved_seconds" in spec and "speculative ngram" in res.stderr
    assert outs["off"] == outs["ngram"] == outs["auto"]
    for run_no in range(2):  # with the persistent cache: cold, then every prompt restored from disk
        rep = tmp_path / f"disk{run_no}.json"
        res = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu", "--cache-dir",
                                  str(tmp_path / "cache"), "--speculative", "ngram", "-o",
                                  str(tmp_path / f"disk{run_no}.out"), "--json-report", str(rep)])
        assert res.exit_code == 0, res.output
        got = [json.loads(line)["token_ids"] for line in (tmp_path / f"disk{run_no}.out").read_text().splitlines()]
        assert got == outs["off"]
        report = json.loads(rep.read_text())
        if run_no:
            assert (report.get("reused_from_disk_tokens") or report["engine"]["reused_from_disk_tokens"]) > 0
    bad = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu", "--speculative", "x"])
    assert bad.exit_code == 2 and "--speculative must be one of" in bad.stderr
    bad = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu",
                              "--num-draft-tokens", "0"])
    assert bad.exit_code == 2 and "--num-draft-tokens" in bad.stderr


# ---- the MTP head as a drafter (engine/models/mtp.py) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory, cpu_ops):
    path = make_model_dir(tmp_path_factory.mktemp("mtp"), TINY_QWEN3_5, seed=11, init_std=0.05, dtype="float32",
                          mtp=True)
    return load_model(path, cpu_ops, mtp=True)[0]


def test_mtp_drafts_keep_greedy_tokens_and_roll_back_its_state(mtp_model, cpu_ops):
    off, _ = run(mtp_model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4))
    for k in (1, 3, 6):
        on, stats = run(mtp_model, cpu_ops, prompts(), EngineOptions(max_batch=4, speculative="mtp",
                                                                     num_draft_tokens=k))
        assert on == off, k
        assert stats.methods["mtp"].drafted > 0
    # with the oracle's rejections the head's own regions (its K/V rows, mtp.hidden) are rolled back too: a wrong
    # mtp.hidden would change the head's later drafts, never the tokens, so compare the regions directly
    prompt, rows = random_prompt(5, 13), random_prompt(6, 5)
    assert any(s.name.startswith("mtp.") and s.snapshot for s in mtp_model.state_specs())
    for n, st, spec, plain in rollbacks(mtp_model, cpu_ops, prompt, rows, slots=8, blocks=64):
        a, b = st.export(spec), st.export(plain)
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=2e-5, err_msg=f"n={n} {name}")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "gemma3"])
def test_verify_steps_replayed_as_graphs_give_the_eager_tokens(family, models, cpu_ops):
    """The graph path (forced on with a replaying stand-in for capture): R rows per sequence, shorter draft lists
    padded with rows that are computed and rejected, padding sequences on the scratch state."""
    from test_engine import _ReplayOps

    model = models[family]
    off, _ = run(model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4))
    ops = _ReplayOps(cpu_ops)
    eng = Engine(model, ops, options=EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=5))
    eng.speculator.drafter, eng.speculator.adaptive = OracleDrafter(off, spread=True), False
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts())])}
    assert got == off
    rows_graphs = [k for k in eng.decoder.graphs if k[0] == "rows"]
    assert rows_graphs and {k[2] for k in rows_graphs} != {1}, eng.decoder.graphs.keys()
    assert 6 in {k[2] for k in rows_graphs}  # padded to 1 + num_draft_tokens rows where they fit
    assert any(k[1] > 1 for k in rows_graphs)  # padded batches too
    eng.close()
    eng.check_invariants()
    assert not eng.state.live


# ---- auto's policy (fake model: only the timing and the acceptance matter) -------------------------------------------
class _FakeState:
    snapshot_capacity, max_step_rows = 1000, 1000

    def commit(self, kept):
        pass


class _FakeRunner:
    def __init__(self, seconds, accept):
        self.seconds, self.accept = seconds, accept
        self.decoder = type("Decoder", (), {"captures": 0, "rows_captures": 0, "rows_eager": 0,
                                                 "replays_rows": False})()

    def verify(self, seqs, drafts, with_hidden=False, pad_to=None):
        import time

        time.sleep(self.seconds)
        return [list(d) + [1] if self.accept else [1] for d in drafts]


class _FakeSeq:
    def __init__(self, greedy=True):
        from prefixrun.engine.state.pools import StateHandle

        self.request = Request("x", [1, 2, 3] * 10, SamplingParams(max_tokens=10_000,
                                                                   temperature=0 if greedy else 1.0), 0)
        self.tokens, self.handle, self.max_context = [1, 2, 3], StateHandle(slot=0, length=32), 1 << 20

    @property
    def remaining(self):
        return 10_000


def _drive(runner, seqs, steps=200, plain_seconds=0.001, adaptive=False):
    from prefixrun.engine.spec.drafters import NgramDrafter
    from prefixrun.engine.spec.speculator import Speculator

    spec = Speculator(NgramDrafter(), "auto", 5, _FakeState(), runner, 16)
    spec.adaptive = adaptive  # off: auto's yield alone decides (the counters' policy: test_speculative_policy.py)
    verify = 0
    for _ in range(steps):
        drafts = spec.drafts(seqs)
        if drafts is None:
            spec.plain_step_done(len(seqs), plain_seconds)
        else:
            spec.step(seqs, drafts)
            verify += 1
    return spec.stats, verify


def test_auto_backs_off_when_drafts_are_rejected_and_stays_on_when_they_pay():
    # whatever the clock says: a slow verify step whose drafts are all accepted keeps auto on, a fast one whose
    # drafts all fail turns it off (auto's choices, and so a GPU run's tokens, never depend on timing)
    slow, verify = _drive(_FakeRunner(0.0, accept=False), [_FakeSeq(), _FakeSeq()])
    assert slow.backoffs >= 2 and verify < 60, (slow, verify)  # exponential back-off: mostly plain steps
    fast, verify = _drive(_FakeRunner(0.003, accept=True), [_FakeSeq(), _FakeSeq()], plain_seconds=0.01)
    assert fast.backoffs == 0 and verify > 190 and fast.saved_seconds > 0
    assert fast.methods["ngram"].accepted == fast.methods["ngram"].drafted > 0
    big, verify = _drive(_FakeRunner(0.0, accept=True), [_FakeSeq() for _ in range(17)])
    assert verify == 0  # more than AUTO_MAX_BATCH sequences: plain steps only
    assert big.plain_steps == 200 and big.saved_seconds == 0
    sampled, verify = _drive(_FakeRunner(0.0, accept=True), [_FakeSeq(greedy=False)])
    assert verify == 0  # auto never drafts for sampled requests


def test_auto_resumes_after_its_back_off_and_its_pauses_double_while_drafts_keep_failing():
    from prefixrun.engine.spec.drafters import NgramDrafter
    from prefixrun.engine.spec.speculator import Speculator

    runner = _FakeRunner(0.0, accept=False)
    spec = Speculator(NgramDrafter(), "auto", 5, _FakeState(), runner, 16)
    spec.adaptive = False
    seqs = [_FakeSeq()]
    pattern = []
    for _ in range(120):
        drafts = spec.drafts(seqs)
        pattern.append(drafts is not None)
        if drafts is None:
            spec.plain_step_done(1, None)
        else:
            spec.step(seqs, drafts)
    runs, gap, verifies = [], 0, 0  # the plain steps between groups of verify steps: 1, 2, 4, 8 ...
    for verified in pattern:
        if verified and gap:
            runs.append((gap, verifies))
            gap = verifies = 0
        verifies += verified
        gap += not verified
    # step 2 is a timing probe; then 4 failing verify steps (judged afresh after each pause) and a pause, doubling
    assert runs[:6] == [(1, 1), (1, 3), (2, 4), (4, 4), (8, 4), (16, 4)], (runs, pattern)
    # drafts accepted again: auto stays on (the yield is judged afresh after each pause)
    runner.accept = True
    before = spec.stats.backoffs
    for _ in range(40):
        drafts = spec.drafts(seqs)
        if drafts is not None:
            spec.step(seqs, drafts)
    assert spec.stats.backoffs == before


class _HiddenOracle(OracleDrafter):
    """A needs_hidden drafter: checks what it is handed against the interface's promise (hidden[-1] is the row whose
    logits gave tokens[-1]; m = the rows the previous step kept) and drafts like the oracle."""

    needs_hidden = True

    def __init__(self, reference, model):
        super().__init__(reference, spread=True)
        self.model, self.seen = model, []

    def propose(self, inputs):
        for x in inputs:
            assert x.hidden is not None and x.hidden.ndim == 2 and x.hidden.shape[1] == self.model.cfg.hidden_size
            logits = self.model.ops.logits(x.hidden[-1:], self.model.lm_head)  # [1, V]
            assert int(np.argmax(logits[0])) == x.tokens[-1]  # greedy: the row's argmax is the token it gave
            self.seen.append(x.hidden.shape[0])
        return super().propose(inputs)


def test_needs_hidden_drafters_get_the_kept_rows_hidden_states(models, cpu_ops):
    model = models["qwen3"]
    off, _ = run(model, cpu_ops, prompts(), EngineOptions(speculative="off", max_batch=4))
    drafter = _HiddenOracle(off, model)
    on, stats = run(model, cpu_ops, prompts(), EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=4),
                    drafter=drafter)
    assert on == off
    assert drafter.seen and max(drafter.seen) > 1 and min(drafter.seen) == 1  # m = n + 1 kept rows
    assert stats.methods["oracle"].accepted > 0


def test_sampled_outputs_follow_the_non_speculative_distribution(models, cpu_ops):
    """End to end: many seeds of one prompt, sampled with top-k 3 (so the joint law of the first three tokens has
    few cells), every decode step drafting (the greedy continuation, a deterministic guess that is often right)
    against speculation off — a two-sample chi-square test on (token 2, token 3), the tokens verify steps make."""
    model = models["qwen3"]
    prompt = [5, 6, 7, 8] * 6
    n = 256
    greedy, _ = run(model, cpu_ops, [prompt], EngineOptions(speculative="off"),
                    sampling=SamplingParams(max_tokens=8, temperature=0))
    reference = {f"s{i}": greedy["r0"] for i in range(n)}

    def sample(opts):
        eng = Engine(model, cpu_ops, options=opts)
        if isinstance(eng.speculator, Speculator):
            eng.speculator.drafter, eng.speculator.adaptive = OracleDrafter(reference, spread=False), False
        reqs = [Request(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i,
                                                        ignore_eos=True), i) for i in range(n)]
        out = [tuple(r.token_ids[1:3]) for r in eng.run(reqs)]
        stats = eng.speculator.stats if isinstance(eng.speculator, Speculator) else None
        eng.close()
        return out, stats

    off, _ = sample(EngineOptions(speculative="off", max_batch=16))
    on, stats = sample(EngineOptions(max_batch=16, speculative="ngram", num_draft_tokens=2))
    m = stats.methods["oracle"]
    assert m.drafted > 200 and 0 < m.accepted < m.drafted
    cells = sorted(set(off) | set(on))
    a = np.array([off.count(c) for c in cells], float)
    b = np.array([on.count(c) for c in cells], float)
    keep = (a + b) >= 10  # pool rare cells
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    ok = (a + b) > 0
    chi2 = (((a - b) ** 2)[ok] / (a + b)[ok]).sum()  # equal sample sizes
    df = int(ok.sum()) - 1
    assert chi2 < df + 5 * np.sqrt(2 * df) + 10, (chi2, df)
    assert off != on  # the speculative sampler draws its own numbers (only the law is the same)
