"""What speculation costs when drafts fail, on the CPU (counters, never timing): the n-gram index gives exactly a
scan's drafts at a few microseconds per step; per-sequence pauses after rejected drafts and the step-level check
that drafts are expected to pay keep verify steps rare when nothing is accepted, and frequent when everything is;
verify steps' graphs are captured only for shapes that recur. And the bench fixture (bench/copy_prone.py) that
makes a made model's greedy output repeat, so that the device can measure speculation at high acceptance."""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import bench_script
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.spec.drafters import NgramDrafter, NgramIndex, TokenHistory
from prefixrun.engine.spec.speculator import Speculator
from prefixrun.engine.state.pools import StateHandle


def scan(tokens, k, min_n=1, max_n=4, lookback=1 << 16):
    """The n-gram lookup as a scan of the whole history (the definition the index must reproduce)."""
    if k < 1:
        return []
    arr = np.asarray(tokens[-lookback:], np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hit = arr[:length - n] == arr[length - n]
        for j in range(1, n):
            hit &= arr[j:length - n + j] == arr[length - n + j]
        found = np.flatnonzero(hit)
        if found.size:
            start, out = int(found[-1]) + n, []
            for m in range(k):
                out.append(int(arr[start + m]) if start + m < length else out[start + m - length])
            return out
    return []


def test_ngram_index_gives_the_scans_drafts_as_it_grows():
    rng = random.Random(1)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies: many candidates (the vectorised path too)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 400))]
        lookback = rng.choice([1 << 16, rng.randrange(2, 60)])
        min_n = rng.randrange(1, 3)
        max_n = rng.randrange(min_n, 6)
        index, pos = NgramIndex(min_n, max_n), 0
        while pos < len(tokens):  # a prompt at once, then steps of 1 .. k + 1 tokens
            step = rng.choice([1, 1, 2, 5, 100])
            index.extend(tokens[pos:pos + step])
            pos = min(pos + step, len(tokens))
            k = rng.randrange(0, 8)
            assert index.draft(k, lookback) == scan(tokens[:pos], k, min_n, max_n, lookback), (tokens[:pos], k)


def test_ngram_drafter_keeps_one_index_per_request_and_forgets_it():
    from prefixrun.engine.spec.drafters import DraftInput

    d = NgramDrafter()
    req = Request("a", [1, 2, 3, 4, 5, 9] * 20, SamplingParams(max_tokens=8), 0)
    out = []
    x = DraftInput(TokenHistory(req.prompt_token_ids, out), 3, StateHandle(slot=0), req)
    assert d.propose([x]) == [scan(req.prompt_token_ids, 3)]
    held = d._indexes[id(req)][1]
    out += [1, 2]
    assert d.propose([x]) == [scan(req.prompt_token_ids + out, 3)] and d._indexes[id(req)][1] is held
    assert len(held.tokens) == len(req.prompt_token_ids) + 2  # extended by the new tokens, not rebuilt
    d.forget(req)
    assert not d._indexes
    h = TokenHistory([1, 2, 3], [4, 5])
    assert len(h) == 5 and h[-1] == 5 and h[1:4] == [2, 3, 4] and h[3:] == [4, 5] and list(h) == [1, 2, 3, 4, 5]
    assert h.since(1) == [2, 3, 4, 5] and h.since(3) == [4, 5] and h.since(5) == [] and h[::2] == [1, 3, 5]


# ---- the policy (a fake model: only the drafts and their acceptance matter) ------------------------------------
class _State:
    snapshot_capacity, max_step_rows = 16 * 5, 64

    def commit(self, kept):
        pass


class _Runner:
    """Accepts every draft or none; counts the verify steps."""

    def __init__(self, accept: bool):
        self.accept, self.verifies = accept, 0
        self.decoder = type("Decoder", (), {"captures": 0, "rows_captures": 0, "rows_eager": 0,
                                            "replays_rows": True})()

    def verify(self, seqs, drafts, with_hidden=False, pad_to=None):
        self.verifies += 1
        return [list(d) + [s.fresh()] if self.accept else [s.fresh()] for s, d in zip(seqs, drafts)]


class _Seq:
    def __init__(self, i, repeats: bool):
        # a history that repeats (n-gram drafts every step) or one without a single repeated token
        prompt = [5, 6, 7, 8] * 8 if repeats else list(range(1000 + 100 * i, 1032 + 100 * i))
        self.request = Request(f"s{i}", prompt, SamplingParams(max_tokens=100_000, temperature=0), i)
        self.tokens, self.handle, self.max_context = [], StateHandle(slot=i, length=len(prompt)), 1 << 20
        self.remaining, self.repeats = 100_000, repeats

    def fresh(self) -> int:
        """The next token of a plain step: 7 again (a repeated run), or a token never seen before."""
        return 7 if self.repeats else 10_000 + 1000 * self.request.index + len(self.tokens)


def _drive(runner, seqs, steps=512, mode="ngram", verify_row_cost=None):
    spec = Speculator(NgramDrafter(), mode, 5, _State(), runner, 16)
    if verify_row_cost is not None:
        spec.verify_row_cost = verify_row_cost
    verify = 0
    for _ in range(steps):
        drafts = spec.drafts(seqs)
        if drafts is None:
            spec.plain_step_done(len(seqs), None)
            new = [[s.fresh()] for s in seqs]
        else:
            new = spec.step(seqs, drafts)
            verify += 1
        for s, t in zip(seqs, new):
            s.tokens += t
            s.handle.length += len(t)
    return spec.stats, verify


def test_rejected_drafts_pause_their_sequence_and_probe_again_later():
    """Batch 1, every draft rejected: a verify step at the first match, then after pauses of 1, 2, 4 .. 128 steps
    (a probe each time), so 512 steps take about ten verify steps, not 512."""
    stats, verify = _drive(_Runner(accept=False), [_Seq(0, repeats=True)])
    m = stats.methods["ngram"]
    assert 6 <= verify <= 12 and m.accepted == 0 and m.drafted == 5 * verify, (verify, stats)
    assert stats.paused_sequence_steps > 400 and stats.declined_steps == 0
    # the same sequence with every draft accepted: a verify step on every step but the timing probes
    stats, verify = _drive(_Runner(accept=True), [_Seq(0, repeats=True)], steps=100)
    assert verify >= 95 and stats.paused_sequence_steps == 0
    assert stats.methods["ngram"].tokens == 6 * verify


def test_a_step_verifies_only_when_its_drafts_may_pay_for_it():
    """Batch 16: one sequence with a match does not make all 16 take 6 rows (declined: a plain step); all 16
    matching do."""
    seqs = [_Seq(0, repeats=True)] + [_Seq(i, repeats=False) for i in range(1, 16)]
    stats, verify = _drive(_Runner(accept=True), seqs, steps=50)
    assert verify == 0 and stats.declined_steps >= 45 and stats.methods["ngram"].drafted == 0
    stats, verify = _drive(_Runner(accept=True), [_Seq(i, repeats=True) for i in range(16)], steps=50)
    assert verify >= 45 and stats.declined_steps == 0
    # more sequences than the snapshot pool holds rows for: as many drafts each as b x (rows - 1) allows (at no
    # verify cost: 16 of 40 sequences drafting 2 tokens cannot pay 40 x 3 rows otherwise)
    stats, verify = _drive(_Runner(accept=True), [_Seq(i, repeats=True) for i in range(40)], steps=20)
    assert verify == 0 and stats.declined_steps == 19  # the 20th: a timing probe (plain)
    runner = _Runner(accept=True)
    stats, verify = _drive(runner, [_Seq(i, repeats=True) for i in range(40)], steps=20, verify_row_cost=0)
    assert verify >= 15 and stats.methods["ngram"].drafted == 16 * 2 * verify  # 1 + 80 // 40 = 3 rows: k = 2


def test_forced_ngram_on_a_model_whose_drafts_fail_is_mostly_plain_steps(cpu_ops, tmp_path):
    """End to end on the CPU with graphs (a replaying stand-in): a random model at a weight scale where its output
    does not repeat; greedy tokens are those of `off`. Alone (batch 1), each sequence's failing drafts end up
    paused; in a batch of 4, where one sequence's match cannot pay a 4 x 6-row step, steps are declined too."""
    from test_engine import _ReplayOps

    model = load_model(make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.3), cpu_ops)[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] * 2 for _ in range(4)]
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    reqs = lambda: [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    off = {r.custom_id: r.token_ids for r in Engine(model, cpu_ops, options=EngineOptions(speculative="off",
                                                                                          max_batch=4)).run(reqs())}
    for batch in (1, 4):
        # beside the step in flight (the pipeline) a draft must also predict that step's token, so fewer verify
        # steps are tried than after it (no pipeline), where the pauses and declines are what keep them rare
        piped = Engine(model, _ReplayOps(cpu_ops), options=EngineOptions(max_batch=batch, speculative="ngram"))
        assert {r.custom_id: r.token_ids for r in piped.run(reqs())} == off
        s = piped.speculator.stats
        assert s.methods["ngram"].verify_steps <= 8 and s.plain_steps > 160 // batch, s
        piped.close()
        eng = Engine(model, _ReplayOps(cpu_ops), options=EngineOptions(max_batch=batch, speculative="ngram",
                                                                        overlap_decode=False))
        got = {r.custom_id: r.token_ids for r in eng.run(reqs())}
        assert got == off
        s = eng.speculator.stats
        m = s.methods["ngram"]
        if batch == 1:
            assert m.drafted and m.accepted < 0.5 * m.drafted, s  # this model's drafts mostly fail
            # attempts after pauses of 1, 2, 4, 8, 16 steps: at most ~6 of 47 steps per sequence
            assert m.verify_steps <= 4 * 6 and s.paused_sequence_steps >= 4 * 10 and s.plain_steps > 4 * 30, s
            assert s.eager_verify_steps + s.verify_graph_captures <= m.verify_steps
        else:
            # a match of one sequence cannot pay 4 x 6 rows (declined); of two at once it can, then both pause
            assert m.verify_steps <= 8 and s.declined_steps > 5 and s.paused_sequence_steps > 10, s
            assert s.plain_steps > 38
        eng.close()


def test_verify_graphs_are_captured_only_for_shapes_that_recur(cpu_ops, tmp_path):
    """The first verify step of a shape runs eagerly on the padded batch; its second captures the graph; the
    copy-prone model's drafts are all accepted, so the tokens come from verify steps and must be off's."""
    from test_engine import _ReplayOps

    src = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.3)
    dst = tmp_path / "copy"
    bench_script("copy_prone").make_copy_prone(src, dst)
    model = load_model(dst, cpu_ops)[0]
    prompts = [[11, 12, 13, 14] * 10, [21, 22, 23] * 12]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reqs = lambda: [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    off = {r.custom_id: r.token_ids for r in Engine(model, cpu_ops, options=EngineOptions(speculative="off",
                                                                                          max_batch=2)).run(reqs())}
    ops = _ReplayOps(cpu_ops)
    eng = Engine(model, ops, options=EngineOptions(max_batch=2, speculative="ngram"))
    got = {r.custom_id: r.token_ids for r in eng.run(reqs())}
    assert got == off
    s, dec = eng.speculator.stats, eng.decoder
    shapes = {k for k in dec.graphs if k[0] == "rows"}
    assert shapes and s.verify_graph_captures == len(shapes) == dec.rows_captures
    assert s.eager_verify_steps >= len(shapes)  # each captured shape ran eagerly once before
    assert s.methods["ngram"].verify_steps > s.eager_verify_steps  # the rest were replays
    eng.close()


# ---- the bench fixture ---------------------------------------------------------------------------------------------
def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_copy_prone_model_keeps_every_tensor_and_makes_ngram_drafts_accepted(cpu_ops, tmp_path):
    cfg = dict(TINY_QWEN3_5, vocab_size=1024)
    src = make_model_dir(tmp_path / "m", cfg, seed=3, init_std=0.3)
    dst = tmp_path / "copy"
    mod = bench_script("copy_prone")
    assert mod.make_copy_prone(src, dst) == 3 * 2 + 1 * 2  # out_proj + down_proj x 3, o_proj + down_proj x 1
    a, b = _header(src / "model.safetensors"), _header(dst / "model.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in a.items() if k != "__metadata__"} == \
        {k: (v["dtype"], v["shape"]) for k, v in b.items() if k != "__metadata__"}
    assert (src / "model.safetensors").stat().st_size == (dst / "model.safetensors").stat().st_size
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in dst.iterdir())
    import torch
    from safetensors.torch import load_file as load_torch

    x, y = load_torch(src / "model.safetensors"), load_torch(dst / "model.safetensors")
    for name in x:
        if mod.RESIDUAL_OUTPUTS.search(name):
            assert torch.equal(y[name], (x[name].float() * mod.DEFAULT_FACTOR).to(torch.bfloat16)), name  # exact
        else:
            assert torch.equal(x[name], y[name]), name

    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(60)]

    def acceptance(model_dir):
        model = load_model(model_dir, cpu_ops)[0]
        sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        off = list(Engine(model, cpu_ops, options=EngineOptions(speculative="off",
                                                                max_batch=1)).run([Request("a", prompt, sp, 0)]))
        eng = Engine(model, cpu_ops, options=EngineOptions(max_batch=1, speculative="ngram"))
        on = list(eng.run([Request("a", prompt, sp, 0)]))
        assert on[0].token_ids == off[0].token_ids
        m = eng.speculator.stats.methods["ngram"].as_dict()
        return m

    m = acceptance(src)
    assert m["drafted"] > 0 and m["acceptance_rate"] < 0.5  # random weights: drafts mostly fail (here 1 of 10)
    m = acceptance(dst)
    assert m["acceptance_rate"] > 0.9 and m["tokens_per_step"] > 4  # the output repeats: ~k + 1 tokens per step
    with pytest.raises(FileNotFoundError):
        mod.make_copy_prone(tmp_path / "nowhere", tmp_path / "x")
    with pytest.raises(FileExistsError):
        mod.make_copy_prone(src, dst)
    assert not (tmp_path / "copy.partial").exists()


class _Waits:
    """The replaying stand-in (graphs on) counting every wait for the device: syncs and synchronous copies."""

    def __init__(self, base):
        from test_engine import _ReplayOps

        self._base, self.waits = _ReplayOps(base), 0

    def __getattr__(self, name):
        return getattr(self._base, name)

    def synchronize(self):
        self.waits += 1

    def to_host(self, array):
        self.waits += 1
        return self._base.to_host(array)


def test_steps_without_drafts_wait_for_the_device_as_often_as_off(cpu_ops, tmp_path):
    """Speculation on, no draft found: its plain steps keep the decode pipeline (queued one ahead, drafting beside
    the step in flight, timed where their tokens arrive), so the run waits for the device exactly as often as `off`
    does; a sync to time each plain step took host/device overlap away."""
    model = load_model(make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.3), cpu_ops)[0]
    prompts = [list(range(3 + 120 * i, 43 + 120 * i)) for i in range(3)]  # no token repeats
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for m in ("off", "auto"):
        ops = _Waits(cpu_ops)
        eng = Engine(model, ops, options=EngineOptions(max_batch=4, speculative=m))
        out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
        runs[m] = out, ops.waits, eng.speculator.report()
        eng.close()
    (off, off_waits, _), (on, waits, report) = runs["off"], runs["auto"]
    assert on == off and report["methods"]["ngram"]["drafted"] == 0, report
    assert report["plain_steps"] >= 23 and waits == off_waits, (waits, off_waits, report)


def test_a_wrong_guess_beside_the_step_in_flight_pauses_the_sequence_like_a_rejected_draft():
    """Beside the step in flight a draft's first token guesses that step's token; where the guess is wrong the
    wait for the step (the pipeline drained) bought nothing: the sequence pauses 1, 2, 4 .. steps as after a
    rejected verify step, so a history that keeps matching but never continues as it did drains the pipeline
    about ten times in 512 steps, not on every other step."""
    seq = _Seq(0, repeats=True)  # prompt 5 6 7 8 5 6 7 8 ...: after a 5 the drafter guesses 6
    runner = _Runner(accept=False)
    spec = Speculator(NgramDrafter(), "ngram", 5, _State(), runner, 16)
    for step in range(512):
        stale = spec.drafts([seq])  # on the host's history, while the step computes the next token
        token = 5 if step % 2 else 20_000 + step  # a 5 (then never a 6), or a token never seen before
        seq.tokens.append(token)
        seq.handle.length += 1
        if stale is not None:
            drafts = spec.redraft([seq])
            if drafts is not None:
                for t in spec.step([seq], drafts)[1:]:
                    seq.tokens.append(t)
                    seq.handle.length += 1
    assert 6 <= spec.stats.drained_steps <= 12 and runner.verifies == 0, spec.stats
    assert spec.stats.paused_sequence_steps > 400
