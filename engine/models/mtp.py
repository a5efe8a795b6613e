"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints, and the drafter built on it.

Layout (checkpoint names, top-level `mtp.*` in the plain and the vision-language layouts): `fc` [D, 2D],
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, one gated full-attention decoder layer `layers.0.*` (q/k norms, output
gate, partial rotary; an MoE MLP where the model's layer 0 is sparse) and `norm`, all norms zero-centred; the
embedding and the LM head are the model's own (or `mtp.embed_tokens` where a checkpoint ships one). transformers
5.17 drops `mtp.*` on load (`_keys_to_ignore_on_load_unexpected`), so tests/test_mtp.py checks this head against a
NumPy reference written from that layout. The head's entry e combines the target's final-normed hidden state h_e
of position e with the embedding of token e+1, at rotary position e:

    u_e = fc([norm_emb(embed(x_{e+1})), norm_hidden(h_e)]);  g_e = norm(layer(u_e));  logits_e = lm_head(g_e)

and predicts token e+2; drafting chains it: the next entry takes (g_e, argmax logits_e).

State (regions of the sequence, so forks, checkpoints, the persistent cache and commit cover it):
- `mtp.layers.0.k` / `.v`, paged: entry e sits in the row of token e+1, the row the step that feeds x_{e+1}
  writes anyway. So the head's rows are written by the model's own forward for every step (prefill, decode,
  verify), a block's rows depend only on the tokens up to it, and rows past a kept length are trimmed as any
  attention's. Row 0 holds no entry; the attention leaves it out exactly (`MtpAttention`).
- `mtp.hidden`, a slot region [D]: h of the sequence's last position, which the next fed token pairs with.
  Rolled back by `commit` like a recurrent state (snapshot per row).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from prefixrun.engine.step.forward_batch import build_batch
from prefixrun.engine.load.config import HybridConfig
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm, WeightLoader
from prefixrun.engine.load.moe_config import MoeHybridConfig
from prefixrun.engine.state.pools import ForwardBatch, ModelState, RegionSpec

PREFIX = "mtp."


def has_mtp_weights(load: WeightLoader) -> bool:
    return load.has(PREFIX + "fc.weight")


class MtpAttention(Attention):
    """The head's gated attention. Its query for the entry stored at row p (rotary position p - 1) must see rows
    1..p only: row 0 holds no entry. The paged attention op sees every row from 0, so the row is left out by
    normalising instead of masking: row 0 stores K = 0 and V = 0, every other row stores V and, as extra value
    heads, ones. Each query head runs twice (heads [q, q] over K/V heads [k, k] / [v, 1]): with Z the sum of the
    real rows' exp-scores, the first copy yields N / (1 + Z) and the second Z / (1 + Z) (row 0 scores exp(0) = 1
    and adds nothing), so their ratio is exactly the attention over rows 1..p. (It costs the head's K/V twice the
    memory, on one layer, and needs no mask support in the attention kernels.)"""

    def __init__(self, cfg: HybridConfig, load: WeightLoader, prefix: str):
        super().__init__(cfg, load, prefix, 0, qk_norm=True, output_gate=True, zero_centered_norm=True)
        self.k_region = PREFIX + "layers.0.k"
        self.v_region = PREFIX + "layers.0.v"

    def state_specs(self) -> list[RegionSpec]:
        return [RegionSpec(self.k_region, True, (2 * self.hkv, self.hd), "act"),
                RegionSpec(self.v_region, True, (2 * self.hkv, self.hd), "act")]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        # entries are stored one row after their rotary position (module doc)
        return super().__call__(ops, x, dataclasses.replace(batch, positions=batch.positions - 1), state)

    def attend(self, ops, q, k, v, batch: ForwardBatch, state: ModelState):
        t, hq, hkv, f32 = q.shape[0], self.hq, self.hkv, np.float32
        # the masking arithmetic runs in fp32 (explicit casts: no bf16 arithmetic outside the kernels)
        real = ops.upload((batch.positions + 1).clip(0, 1), f32).reshape(t, 1, 1)  # [T, 1, 1]: 0 for row 0
        k32, v32 = ops.upload(k, f32) * real, ops.upload(v, f32) * real  # [T, Hkv, hd]
        k2, v2 = ops.zeros((t, 2 * hkv, self.hd), f32), ops.zeros((t, 2 * hkv, self.hd), f32)  # [T, 2 Hkv, hd]
        k2[:, :hkv] = k32
        k2[:, hkv:] = k32
        v2[:, :hkv] = v32
        v2[:, hkv:] = real
        q2 = ops.zeros((t, 2 * hq, self.hd))  # [T, 2 Hq, hd]
        q2[:, :hq] = q
        q2[:, hq:] = q
        k_cache, v_cache = state.arrays[self.k_region], state.arrays[self.v_region]
        ops.write_kv(k_cache, v_cache, ops.upload(k2), ops.upload(v2), batch.kv_write_index)
        o = ops.paged_attention(q2, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.cu_seqlens,
                                self.scale, shared=batch.shared, prefill=batch.prefill)
        o = ops.upload(o, f32)  # [T, 2 Hq, hd]
        # the row-0 token's query sees row 0 alone (0 / 0): its output is unused, make it 0 instead of NaN
        return ops.upload(o[:, :hq] / (o[:, hq:] + (1 - real)))  # [T, Hq, hd]


class MtpHead:
    """The MTP head on the backend: built from a checkpoint's `mtp.*` (the model's `mtp` attribute when asked for).

    `absorb` runs inside the model's forward on every step; `step` is one pass of the head over explicit inputs,
    which the drafter chains."""

    def __init__(self, cfg: HybridConfig, load: WeightLoader, embed_tokens, lm_head):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = load.matrix(PREFIX + "fc.weight", (d, 2 * d))
        names = [n for n in load.tensors.names() if n.startswith(PREFIX + "layers.")]
        layers = sorted({int(n.split(".")[2]) for n in names if n.split(".")[2].isdigit()})
        if layers != [0]:
            raise ModelLoadError(f"{load.tensors.model_dir}: the MTP head has layers {layers}; exactly one "
                                 f"(mtp.layers.0) is supported")
        norm = lambda name: RMSNorm(load, PREFIX + name, d, eps, zero_centered=True)
        self.norm_embedding = norm("pre_fc_norm_embedding.weight")
        self.norm_hidden = norm("pre_fc_norm_hidden.weight")
        self.final_norm = norm("norm.weight")
        lp = PREFIX + "layers.0."
        if isinstance(cfg, MoeHybridConfig) and cfg.moe is not None and cfg.moe.sparse_layers[0]:
            # sparse as the model's layer 0 is (vLLM's rule for the MTP layer)
            from prefixrun.engine.models.moe import SparseMoeBlock

            mlp = SparseMoeBlock(d, cfg.moe, load, lp + "mlp.")
        else:
            mlp = GatedMLP(cfg, load, lp + "mlp.")
        self.layer = DecoderLayer(MtpAttention(cfg, load, lp + "self_attn."), mlp,
                                  RMSNorm(load, lp + "input_layernorm.weight", d, eps, zero_centered=True),
                                  RMSNorm(load, lp + "post_attention_layernorm.weight", d, eps, zero_centered=True))
        own = PREFIX + "embed_tokens.weight"
        self.embed_tokens = load.matrix(own, (cfg.vocab_size, d)) if load.has(own) else embed_tokens
        self.lm_head = lm_head
        self.hidden_size = d
        self.hidden_region = PREFIX + "hidden"

    def state_specs(self) -> list[RegionSpec]:
        # mtp.hidden rolls back with a speculative step's commit: absorb writes every row's value to its snapshot
        return self.layer.state_specs() + [RegionSpec(self.hidden_region, False, (self.hidden_size,), "act",
                                                      snapshot=True)]

    def step(self, ops, token_ids, hidden, batch: ForwardBatch, state: ModelState):
        """Entries for tokens `token_ids` [T] (at batch's rows: rotary position = row - 1) paired with the hidden
        states `hidden` [T, D] of the positions before them; their K/V rows are written. -> normed g [T, D]."""
        t, d = hidden.shape
        x = ops.zeros((t, 2 * d))  # [T, 2D]: [normed embedding, normed hidden], fc's input order
        x[:, :d] = self.norm_embedding(ops, ops.embed(self.embed_tokens, token_ids))
        x[:, d:] = self.norm_hidden(ops, hidden)
        x = self.layer(ops, ops.linear(x, self.fc), batch, state)
        return self.final_norm(ops, x)

    def absorb(self, ops, hidden, batch: ForwardBatch, state: ModelState):
        """The step's entries from the target's final-normed hidden states `hidden` [T, D] (a sequence's first
        new token pairs with the hidden state the sequence's last step left in `mtp.hidden`), then that region
        takes each sequence's last hidden state."""
        t, d = hidden.shape
        pending = state.arrays[self.hidden_region]
        before = ops.zeros((t + 1, d))  # [T + 1, D]: row i = the hidden state before token i
        before[1:] = hidden
        before[batch.cu_seqlens[:-1]] = pending[batch.slots]
        self.step(ops, batch.token_ids, before[:t], batch, state)
        pending[batch.slots] = hidden[batch.last_token_index]
        if batch.snapshot_rows is not None:  # a multi-row step: the value after each row, for ModelState.commit
            snaps = state.snapshots[self.hidden_region]  # rows marked -1 land in its last row, scratch (graph-safe)
            snaps[batch.snapshot_rows % snaps.shape[0]] = hidden


def attach_mtp(model, cfg: HybridConfig, load: WeightLoader):
    """Give `model` (a CausalLM) its MTP head from the checkpoint's `mtp.*`; a clear error when it has none."""
    if not has_mtp_weights(load):
        raise ModelLoadError(f"{load.tensors.model_dir}: this checkpoint has no MTP head (no mtp.fc.weight), so "
                             f"it cannot draft with --speculative mtp")
    model.mtp = MtpHead(cfg, load, model.embed_tokens, model.lm_head)
    return model


class MtpDrafter:
    """Drafts with the model's MTP head: per sequence, its argmax chain of `num_drafts` tokens.

    The head's rows for every computed position are already in the sequence's state (the forward writes them), and
    `mtp.hidden` holds the hidden state of the last one, so drafting needs no hidden states from the caller: draft 1
    pairs that state with the token the coming step feeds, draft j + 1 pairs the head's own output g with draft j.
    The chain writes the head's K/V rows of the positions the coming verify step feeds (it rewrites them there
    with the target's hidden states); the blocks this takes beyond the sequence's length are released again."""

    method = "mtp"
    needs_hidden = False

    def __init__(self, model, state: ModelState):
        if model.mtp is None:
            raise ModelLoadError("--speculative mtp needs the model loaded with its MTP head (mtp.* weights)")
        self.model, self.head, self.state, self.ops = model, model.mtp, state, model.ops
        self.last_logits: list = []  # per chain step: fp32 [active rows, V] (tests read the head's logits here)

    def propose(self, inputs) -> list[list[int]]:
        if not inputs:
            return []
        ops, st, head = self.ops, self.state, self.head
        handles = [x.handle for x in inputs]
        wants = [max(int(x.num_drafts), 0) for x in inputs]
        drafts: list[list[int]] = [[] for _ in inputs]
        chain = []  # (rows of `active` at that step, backend ids [A])
        self.last_logits = []
        try:
            for i, h in enumerate(handles):
                if wants[i] and not st.blocks.can_allocate(st.blocks_needed(h, h.length + wants[i])):
                    wants[i] = 0  # no room for the chain's rows: this sequence takes a plain row
                if wants[i]:
                    st.reserve(h, h.length + wants[i])
            active = [i for i, k in enumerate(wants) if k > 0]
            if active:
                ids = ops.upload_index([inputs[i].tokens[-1] for i in active])  # [A]
                hidden = st.arrays[head.hidden_region][ops.upload_index([handles[i].slot for i in active])]  # [A, D]
            j = 0
            while active:
                hs = [handles[i] for i in active]
                # positions and K/V rows of the chain's step j; the token ids are embedded from `ids` directly
                batch = build_batch([h.length + j for h in hs], [h.blocks for h in hs], [h.slot for h in hs],
                                    [[0]] * len(hs), st.block_size).to_backend(ops.upload_index)
                g = head.step(ops, ids, hidden, batch, st)  # [A, D]
                logits = ops.logits(g, head.lm_head)  # fp32 [A, V]
                nxt = ops.sample(logits, *_greedy(len(active)))  # int64 [A]
                self.last_logits.append(logits)
                chain.append((active, nxt))
                j += 1
                keep = [r for r, i in enumerate(active) if wants[i] > j]
                if len(keep) < len(active):
                    sel = ops.upload_index(keep)
                    nxt, g = nxt[sel], g[sel]
                active = [active[r] for r in keep]
                ids, hidden = nxt, g
        finally:
            for h in handles:
                st.trim(h)
        for rows, ids_dev in chain:
            for i, tok in zip(rows, ops.to_host(ids_dev).tolist()):
                drafts[i].append(int(tok))
        return drafts


def _greedy(n: int) -> tuple:
    """ops.sample's per-row parameters for argmax rows."""
    return (np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
            np.zeros(n, np.uint64), np.zeros(n, np.int64))
