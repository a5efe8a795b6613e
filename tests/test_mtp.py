"""The MTP head (engine/models/mtp.py) against a NumPy reference, and its drafter.

transformers 5.17 does not implement the head (it drops `mtp.*` on load), so the reference here is written from the
checkpoint layout alone, in float64, reading the safetensors file itself: entry e = fc([norm(embed(x_{e+1})),
norm(h_e)]) -> one gated full-attention decoder layer at rotary position e (causal over entries 0..e) -> norm ->
LM head, with h_e the target's final-normed hidden state from transformers (float64, same weights), and drafts
chained on the head's own output. Nothing of prefixrun's engine is used to compute the expected values.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TINY_QWEN3_5, TINY_QWEN3_5_MOE, TINY_QWEN3_NEXT, new_state, random_prompt, rollbacks
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.models.mtp import MtpDrafter
from prefixrun.engine.spec.drafters import DraftInput
from prefixrun.engine.spec.speculator import Speculator
from prefixrun.engine.state.pools import StateLayoutError, layout_digest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

TOL = 1e-4
CONFIGS = {"qwen3_5": TINY_QWEN3_5, "qwen3_5_moe": TINY_QWEN3_5_MOE, "qwen3_next": TINY_QWEN3_NEXT}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-models")
    return {name: make_model_dir(root / name, cfg, seed=11, init_std=0.05, dtype="float32", mtp=True)
            for name, cfg in CONFIGS.items()}


@pytest.fixture(scope="module")
def mtp_models(mtp_dirs, cpu_ops):
    return {name: load_model(path, cpu_ops, mtp=True)[0] for name, path in mtp_dirs.items()}


@pytest.fixture(scope="module")
def references(mtp_dirs):
    return {name: Reference(path) for name, path in mtp_dirs.items()}


class Reference:
    """The target's hidden states from transformers, the head in float64 NumPy from the safetensors file."""

    def __init__(self, path):
        raw = json.loads((path / "config.json").read_text())
        self.cfg = raw.get("text_config", raw)
        self.w = {k: v.astype(np.float64) for k, v in safetensors_numpy.load_file(path / "model.safetensors").items()}
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                                    experts_implementation="eager").eval()
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def hidden(self, tokens):
        """[n, D] final-normed hidden states of the target."""
        with torch.no_grad():
            return self.hf.model(torch.tensor([tokens])).last_hidden_state[0].numpy()

    def norm(self, x, name):
        eps = self.cfg["rms_norm_eps"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + self.w[name])

    def rotate(self, x, pos):  # x [n, H, hd], partial rotate-half rotary
        hd = x.shape[-1]
        rope = self.cfg["rope_parameters"]
        rd = int(hd * rope["partial_rotary_factor"])
        inv = 1.0 / rope["rope_theta"] ** (np.arange(0, rd, 2) / rd)
        ang = np.asarray(pos, np.float64)[:, None] * inv[None]  # [n, rd/2]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        r = x[..., :rd]
        half = np.concatenate([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return np.concatenate([r * cos + half * sin, x[..., rd:]], -1)

    def mlp(self, x, p):
        silu = lambda a: a / (1.0 + np.exp(-a))
        ffn = lambda a, q: (silu(a @ self.w[q + "gate_proj.weight"].T) * (a @ self.w[q + "up_proj.weight"].T)) \
            @ self.w[q + "down_proj.weight"].T
        if p + "gate.weight" not in self.w:
            return ffn(x, p)
        logits = x @ self.w[p + "gate.weight"].T  # [n, E]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        k = self.cfg["num_experts_per_tok"]
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:k]
            wts = probs[t, top]
            if self.cfg.get("norm_topk_prob", True):
                wts = wts / wts.sum()
            for e, wt in zip(top, wts):
                out[t] += wt * ffn(x[t:t + 1], f"{p}experts.{e}.")[0]
        if p + "shared_expert.gate_proj.weight" in self.w:
            gate = 1.0 / (1.0 + np.exp(-(x @ self.w[p + "shared_expert_gate.weight"].T)))  # [n, 1]
            out += gate * ffn(x, p + "shared_expert.")
        return out

    def entries(self, hiddens, tokens):
        """Head outputs g [n, D] for entries e = 0..n-1 from hiddens [n, D] (h_e) and tokens [n] (x_{e+1})."""
        w, c = self.w, self.cfg
        n = len(tokens)
        hq, hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        emb = w["model.embed_tokens.weight"][np.asarray(tokens)]
        u = np.concatenate([self.norm(emb, "mtp.pre_fc_norm_embedding.weight"),
                            self.norm(hiddens, "mtp.pre_fc_norm_hidden.weight")], -1) @ w["mtp.fc.weight"].T
        p = "mtp.layers.0."
        a = self.norm(u, p + "input_layernorm.weight")
        qg = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(n, hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, hq * hd)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(n, hkv, hd)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(n, hkv, hd)
        q = self.rotate(self.norm(q, p + "self_attn.q_norm.weight"), range(n))
        k = self.rotate(self.norm(k, p + "self_attn.k_norm.weight"), range(n))
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # [n, Hq, hd]
        s = np.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, v).reshape(n, hq * hd) / (1.0 + np.exp(-gate))
        u = u + o @ w[p + "self_attn.o_proj.weight"].T
        u = u + self.mlp(self.norm(u, p + "post_attention_layernorm.weight"), p + "mlp.")
        return self.norm(u, "mtp.norm.weight")

    def chain(self, tokens, k):
        """The state after tokens[:-1], then k chained drafts from tokens[-1] -> (drafts, logits [k, V])."""
        hid = list(self.hidden(tokens[:-1]))
        toks = list(tokens[1:])
        drafts, logits = [], []
        for _ in range(k):
            g = self.entries(np.array(hid), toks)[-1]
            lg = g @ self.lm_head.T
            logits.append(lg)
            drafts.append(int(np.argmax(lg)))
            hid.append(g)
            toks.append(drafts[-1])
        return drafts, np.array(logits)


def _draft(model, state, handle, tokens, k):
    drafter = MtpDrafter(model, state)
    drafts = drafter.propose([DraftInput(tokens=tokens, num_drafts=k, handle=handle, request=None)])[0]
    return drafts, np.concatenate(drafter.last_logits)


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("length", [2, 17, 40])
def test_head_logits_match_reference(family, length, mtp_models, references, cpu_ops):
    """One prefill, then the drafter's chain: every step's logits equal the reference's (the first step reads
    every row the prefill wrote; later steps read the chain's own rows)."""
    model, ref = mtp_models[family], references[family]
    tokens = random_prompt(length, length)
    state = new_state(model, cpu_ops)
    h = state.new_sequence()
    model.forward(state.prepare_step([h], [tokens[:-1]]), state)
    drafts, logits = _draft(model, state, h, tokens, 4)
    want_drafts, want_logits = ref.chain(tokens, 4)
    np.testing.assert_allclose(logits, want_logits, atol=TOL, rtol=0)
    assert drafts == want_drafts
    assert h.length == length - 1  # drafting leaves the sequence where it was
    state.release(h)
    state.check_invariants()


def test_rows_follow_every_step_kind(mtp_models, references, cpu_ops):
    """Pieces, single-token steps, forks at block-aligned and unaligned lengths, a batch of uneven sequences: the
    head's rows and hidden state are those of one prefill (block size 16)."""
    model, ref = mtp_models["qwen3_5"], references["qwen3_5"]
    a, b = random_prompt(3, 50), random_prompt(4, 50)
    b[:32] = a[:32]
    state = new_state(model, cpu_ops)
    h = state.new_sequence()
    model.forward(state.prepare_step([h], [a[:32]]), state)  # block-aligned end
    fork = state.fork(h)
    model.forward(state.prepare_step([h, fork], [a[32:37], b[32:45]]), state)  # uneven pieces, partial blocks
    fork2 = state.fork(h)  # unaligned: shares a partial block
    for t in range(37, 41):
        model.forward(state.prepare_step([h, fork2], [[a[t]], [b[t]]]), state)
    for handle, tokens in ((h, a[:42]), (fork, b[:46]), (fork2, a[:37] + b[37:42])):
        drafts, logits = _draft(model, state, handle, tokens, 3)
        want_drafts, want_logits = ref.chain(tokens, 3)
        np.testing.assert_allclose(logits, want_logits, atol=TOL, rtol=0)
        assert drafts == want_drafts
    state.check_invariants()


def test_batched_drafts_equal_single(mtp_models, cpu_ops):
    """Several sequences with different lengths and draft counts (0 included) in one propose."""
    model = mtp_models["qwen3_5_moe"]
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([5, 33, 16, 21])]
    wants = [3, 1, 0, 4]
    state = new_state(model, cpu_ops)
    handles = [state.new_sequence() for _ in prompts]
    model.forward(state.prepare_step(handles, [p[:-1] for p in prompts]), state)
    singles = [_draft(model, state, h, p, k)[0] if k else [] for h, p, k in zip(handles, prompts, wants)]
    drafter = MtpDrafter(model, state)
    batched = drafter.propose([DraftInput(tokens=p, num_drafts=k, handle=h, request=None)
                               for h, p, k in zip(handles, prompts, wants)])
    assert batched == singles
    assert [len(d) for d in batched] == wants
    state.check_invariants()


def test_state_export_import_and_layout(mtp_models, loaded, cpu_ops):
    """The head's regions travel with a state (the persistent cache's path): an imported state drafts the same;
    a state without them is refused, and the layouts' digests (part of every cache key) differ."""
    model = mtp_models["qwen3_5"]
    tokens = random_prompt(5, 30)
    state = new_state(model, cpu_ops)
    h = state.new_sequence()
    model.forward(state.prepare_step([h], [tokens[:-1]]), state)
    regions = state.export(h)
    assert {"mtp.layers.0.k", "mtp.layers.0.v", "mtp.hidden"} <= set(regions)
    want = _draft(model, state, h, tokens, 3)
    other = new_state(model, cpu_ops)
    restored = other.import_state(regions, h.length)
    got = _draft(model, other, restored, tokens, 3)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    plain = loaded["qwen3_5"]
    assert layout_digest(model.state_specs(), cpu_ops) != layout_digest(plain.state_specs(), cpu_ops)
    no_mtp = {k: v for k, v in regions.items() if not k.startswith("mtp.")}
    with pytest.raises(StateLayoutError):
        other.validate_import(no_mtp, h.length)
    with pytest.raises(StateLayoutError):
        new_state(plain, cpu_ops).validate_import(regions, h.length)


def test_head_does_not_change_the_target(mtp_models, mtp_dirs, cpu_ops):
    """Loading the head adds state and work, never a different answer: the target's logits are identical."""
    prompt = random_prompt(6, 45)
    with_head = mtp_models["qwen3_next"]
    without, _ = load_model(mtp_dirs["qwen3_next"], cpu_ops)
    outs = []
    for model in (with_head, without):
        state = new_state(model, cpu_ops)
        h = state.new_sequence()
        outs.append(model.forward(state.prepare_step([h], [prompt]), state, all_logits=True))
        outs.append(model.forward(state.prepare_step([h], [[7]]), state))
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])


def test_clear_errors(model_dirs, loaded, cpu_ops, tmp_path):
    with pytest.raises(ModelLoadError, match="no MTP head"):
        load_model(model_dirs["qwen3_5"], cpu_ops, mtp=True)  # a checkpoint without mtp.*
    with pytest.raises(ModelLoadError, match="has no MTP head"):
        load_model(model_dirs["qwen3"], cpu_ops, mtp=True)  # a family without one
    with pytest.raises(ModelLoadError, match="mtp"):
        MtpDrafter(loaded["qwen3_5"], new_state(loaded["qwen3_5"], cpu_ops))
    # a composite's stand-in mtp.fc of the wrong shape is named, not a traceback
    bad = make_model_dir(tmp_path / "composite", TINY_QWEN3_5, seed=1, composite=True)
    with pytest.raises(ModelLoadError, match="mtp.fc.weight"):
        load_model(bad, cpu_ops, mtp=True)


def test_composite_layout(mtp_models, tmp_path, cpu_ops):
    """The vision-language layout keeps `mtp.*` at the top level; same seed, same weights, same drafts."""
    path = make_model_dir(tmp_path / "vl", TINY_QWEN3_5, seed=11, init_std=0.05, dtype="float32", mtp=True,
                          composite=True)
    composite, _ = load_model(path, cpu_ops, mtp=True)
    tokens = random_prompt(8, 20)
    got = []
    for model in (composite, mtp_models["qwen3_5"]):
        state = new_state(model, cpu_ops)
        h = state.new_sequence()
        model.forward(state.prepare_step([h], [tokens[:-1]]), state)
        got.append(_draft(model, state, h, tokens, 2)[0])
    assert got[0] == got[1]


# ---- with the speculative loop (engine/spec/drafters.py) ----------------------------------------------------------
def _prompts():
    base = random_prompt(100, 37)
    return [base + random_prompt(101, 9), base + random_prompt(102, 4), base, [5, 6, 7] * 9, random_prompt(103, 17)]


def _run(model, ops, prompt_list, opts, persist=None, max_tokens=12):
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine

    eng = Engine(model, ops, options=opts, persist=persist)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompt_list)])}
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live and eng.state.blocks.free_count == eng.state.blocks.num_blocks
    return out, (eng.speculator.stats if isinstance(eng.speculator, Speculator) else None)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_with_mtp_drafts_identical_to_off(family, mtp_models, cpu_ops):
    from prefixrun.engine.run.core import EngineOptions

    model = mtp_models[family]
    off, _ = _run(model, cpu_ops, _prompts(), EngineOptions(speculative="off", max_batch=4))
    for k in range(1, 5):
        on, stats = _run(model, cpu_ops, _prompts(), EngineOptions(max_batch=4, speculative="mtp",
                                                                   num_draft_tokens=k))
        assert on == off, (family, k)
        assert stats.methods["mtp"].drafted > 0 and stats.methods["mtp"].verify_steps > 0


def test_greedy_identical_with_prefix_reuse_and_from_disk(mtp_models, cpu_ops):
    """Shared prefixes (branch and block-aligned checkpoints carry the head's rows), then the same batch restored
    from a stand-in of the persistent store: the same tokens as a run without reuse or speculation."""
    from prefixrun.engine.run.core import EngineOptions
    from test_executor import StoredPrefixes

    model = mtp_models["qwen3_5"]
    ps = _prompts() + [_prompts()[0][:32] + [9, 9]]
    off, _ = _run(model, cpu_ops, ps, EngineOptions(speculative="off", max_batch=4, reuse=False))
    disk = StoredPrefixes()
    opts = EngineOptions(max_batch=2, speculative="mtp", num_draft_tokens=3, retain_block=16)
    cold, _ = _run(model, cpu_ops, ps, opts, persist=disk)
    assert disk.entries and all("mtp.hidden" in e[0] for e in disk.entries.values())
    warm, stats = _run(model, cpu_ops, ps, opts, persist=disk)
    assert cold == warm == off
    assert stats.methods["mtp"].drafted > 0


def test_rollback_restores_the_head_state_of_a_plain_run(mtp_models, cpu_ops):
    """A multi-row step of R rows committed at every n: the head's rows and hidden state equal those of a state
    fed the same n tokens one step at a time, and both draft the same continuation."""
    model = mtp_models["qwen3_5"]
    prompt, rows = random_prompt(5, 13), random_prompt(6, 6)
    for n, st, spec, plain in rollbacks(model, cpu_ops, prompt, rows):
        a, b = st.export(spec), st.export(plain)
        for name in ("mtp.layers.0.k", "mtp.layers.0.v", "mtp.hidden"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=2e-5, err_msg=f"n={n} {name}")
        tokens = prompt + rows[:n] + [3]
        da, la = _draft(model, st, spec, tokens, 3)
        db, lb = _draft(model, st, plain, tokens, 3)
        assert da == db
        np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("isolated_env")
def test_cli_make_model_with_head_and_batch_with_mtp_drafts(tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    runner = CliRunner()
    model_dir, plain_dir = tmp_path / "m", tmp_path / "plain"
    assert runner.invoke(app, ["make-model", str(model_dir), "--mtp", "--seed", "3"]).exit_code == 0
    assert runner.invoke(app, ["make-model", str(plain_dir), "--seed", "3"]).exit_code == 0
    work = tmp_path / "in.jsonl"
    lines = [{"custom_id": f"c{i}", "prompt_token_ids": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
             for i, p in enumerate(_prompts())]
    work.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # one cache folder for all runs: a run without the head must not be served the entries of a run with it (their
    # state layouts differ, so do their keys), nor the other way round; a second run with the head reads its own
    outs, cached = [], []
    for n, mode in enumerate(("off", "mtp", "mtp", "off")):
        out, rep = tmp_path / f"{n}.out", tmp_path / f"{n}.json"
        res = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu",
                                  "--speculative", mode, "--num-draft-tokens", "3", "-o", str(out),
                                  "--json-report", str(rep)])
        assert res.exit_code == 0, res.output
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        outs.append([line["token_ids"] for line in lines])
        cached.append(sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in lines))
        if mode == "mtp":
            report = json.loads(rep.read_text())
            spec = report.get("speculative") or report["engine"]["speculative"]
            assert spec["methods"]["mtp"]["drafted"] > 0
    assert outs[0] == outs[1] == outs[2] == outs[3]
    total = sum(len(p) for p in _prompts())
    within_run = cached[0]  # the prompts' shared prefix, reused in memory
    assert within_run < total and cached[1] == within_run and cached[2] == total and cached[3] == total
    # a checkpoint without the head: one clear error, no traceback
    res = runner.invoke(app, ["batch", str(work), "--model", str(plain_dir), "--device", "cpu", "--speculative", "mtp"])
    assert res.exit_code != 0 and "no MTP head" in res.output and "Traceback" not in res.output


def test_drafter_without_room_proposes_nothing_and_leaves_the_pools_intact(mtp_models, cpu_ops):
    """No free block for the chain's rows: that sequence gets no drafts (a plain row), the others theirs."""
    from prefixrun.engine.state.pools import ModelState

    model = mtp_models["qwen3_5"]
    st = ModelState(model.state_specs(), cpu_ops, num_slots=4, num_blocks=4, block_size=16)
    full, short = st.new_sequence(), st.new_sequence()
    a, b = random_prompt(20, 33), random_prompt(21, 10)
    model.forward(st.prepare_step([full, short], [a[:32], b[:9]]), st)  # 2 + 1 blocks; 1 free
    st.blocks.allocate(1)  # now none
    drafter = MtpDrafter(model, st)
    got = drafter.propose([DraftInput(tokens=a, num_drafts=3, handle=full, request=None),
                           DraftInput(tokens=b, num_drafts=3, handle=short, request=None)])
    assert got[0] == [] and len(got[1]) == 3
    assert len(full.blocks) == 2 and len(short.blocks) == 1 and st.blocks.free_count == 0


def test_drafting_changes_no_state_it_does_not_own(mtp_models, cpu_ops):
    """A chain writes only rows past the sequences' lengths: every region of every state (the drafting ones, and a
    fork sharing their partial last block) exports the same before and after, and drafting twice gives the same."""
    model = mtp_models["qwen3_5"]
    tokens = random_prompt(30, 40)
    state = new_state(model, cpu_ops)
    h = state.new_sequence()
    model.forward(state.prepare_step([h], [tokens[:-1]]), state)  # 39 tokens: a partial last block
    sibling = state.fork(h)  # shares it
    before = {id(x): state.export(x) for x in (h, sibling)}
    first = _draft(model, state, h, tokens, 4)
    second = _draft(model, state, sibling, tokens, 4)
    for x in (h, sibling):
        after = state.export(x)
        for name, arr in before[id(x)].items():
            np.testing.assert_array_equal(after[name], arr, err_msg=name)
    assert first[0] == second[0]
    np.testing.assert_array_equal(first[1], second[1])
    assert _draft(model, state, h, tokens, 4)[0] == first[0]
    state.check_invariants()


def test_echo_head_accepts_drafts_in_the_real_loop(tmp_path, cpu_ops):
    """A random head's drafts are almost never accepted, so the loop above mostly rolls back to one row. Here the
    head is made to echo its input token (fc passes the normed embedding through; the layer's outputs scaled down),
    which the tiny model's repetitive greedy output accepts often: partial acceptances of the MTP drafter's own
    chains, cold and restored from a store, with the same tokens as speculation off."""
    from safetensors.numpy import load_file

    from prefixrun.engine.load.model_maker import write_safetensors
    from prefixrun.engine.run.core import EngineOptions
    from test_executor import StoredPrefixes

    path = make_model_dir(tmp_path / "echo", TINY_QWEN3_5, seed=11, init_std=0.05, dtype="float32", mtp=True)
    w = load_file(path / "model.safetensors")
    d = w["mtp.fc.weight"].shape[0]
    w["mtp.fc.weight"] = np.concatenate([np.eye(d, dtype=np.float32), 0.1 * w["mtp.fc.weight"][:, d:]], 1)
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        w[name] = 0.1 * w[name]
    write_safetensors(path / "model.safetensors", w, {"format": "pt"})
    model = load_model(path, cpu_ops, mtp=True)[0]
    off, _ = _run(model, cpu_ops, _prompts(), EngineOptions(speculative="off", max_batch=4), max_tokens=30)
    disk = StoredPrefixes()
    opts = EngineOptions(max_batch=4, speculative="mtp", num_draft_tokens=4, retain_block=16)
    for _ in range(2):  # cold, then from the store
        on, stats = _run(model, cpu_ops, _prompts(), opts, persist=disk, max_tokens=30)
        assert on == off
        m = stats.methods["mtp"]
        assert 0.1 * m.drafted < m.accepted < m.drafted and m.tokens > m.sequence_steps
