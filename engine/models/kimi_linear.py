"""Kimi Linear: Kimi Delta Attention (KDA) layers and MLA layers, dense or DeepSeek-V3-style MoE MLPs
(engine/load/kimi_config.py has the settings).

Weights as transformers saves them: `model.layers.{i}.self_attn.*` and the MLP under `block_sparse_moe.` (experts
`experts.{e}.w1/w3/w2` = gate/up/down, `gate.weight`, `gate.e_score_correction_bias`, `shared_experts.*`; a dense
layer's gate/up/down_proj there too), KDA's convolutions split as `q_conv1d`, `k_conv1d`, `v_conv1d`; transformers'
in-memory names (`mlp.`, fused `experts.gate_up_proj` / `down_proj`, one `conv1d`) load as well.

MLA keeps expanded keys and values in the paged K/V regions (not the compressed latent): the paged attention op,
its prefix sharing by blocks, checkpoints and the disk cache then serve it unchanged, at the price of
2 H max(qk_head_dim, v_head_dim) values a token instead of kv_lora_rank + qk_rope_head_dim. Heads are padded to
that width with zeros, done in the weights at load: zero rows in q and v, zero columns in o_proj; zeros add nothing
to a score or an output. The shared key part k_rot (never rotated: Kimi Linear has no position embedding) is put
into every head by a 0/1 matrix, which is exact.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import LINEAR_ATTENTION
from prefixrun.engine.load.kimi_config import KimiLinearConfig
from prefixrun.engine.models.layers import CausalLM, DecoderLayer, GatedMLP, RMSNorm, WeightLoader
from prefixrun.engine.models.moe import expert_weights
from prefixrun.engine.state.kv_dtype import scale_region
from prefixrun.engine.state.pools import ForwardBatch, ModelState, RegionSpec

LATENT_NORM_EPS = 1e-6  # KimiLinearRMSNorm's default: q_a_layernorm and kv_a_layernorm are built without an eps


class KimiDeltaAttention:
    """q/k/v projections -> causal conv + SiLU each -> q/k L2 norm -> the delta rule with a decay per key channel
    g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj(x)) -> RMSNorm * sigmoid(g_b(g_a(x)))
    -> o_proj. State: the conv history of q, k, v and the recurrent state [H, Dk, Dk]."""

    def __init__(self, cfg: KimiLinearConfig, load: WeightLoader, prefix: str, layer: int):
        if not load.ops.per_channel_decay:
            raise ModelLoadError(f"{load.tensors.model_dir}: Kimi Delta Attention's per-channel decay is not in the "
                                 f"{load.ops.display_name} kernels (--device cpu runs it)")
        d, h, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        self.h, self.dk, self.hd, self.kernel = h, dk, h * dk, cfg.linear_conv_kernel
        names = ["q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj"]
        rows = [self.hd] * 3 + [dk, h, dk]
        self.in_proj = load.stacked([f"{prefix}{n}.weight" for n in names], [(r, d) for r in rows])
        self.conv_weight = _qkv_conv(load, prefix, self.hd, self.kernel)
        self.f_b = load.matrix(prefix + "f_b_proj.weight", (self.hd, dk))
        self.g_b = load.matrix(prefix + "g_b_proj.weight", (self.hd, dk))
        a_log = load.host(prefix + "A_log", None).astype(np.float32)
        if a_log.size != h:
            raise ModelLoadError(f"{load.tensors.model_dir}: {prefix}A_log has shape {a_log.shape}, expected {h} "
                                 f"values")
        self.a_log = load.ops.upload(np.repeat(a_log.reshape(h), dk), np.float32)  # [H Dk]: per key channel
        self.dt_bias = load.vector(prefix + "dt_bias", (self.hd,))
        self.norm_weight = load.vector(prefix + "o_norm.weight", (dk,))
        self.eps = cfg.rms_norm_eps
        self.o_proj = load.matrix(prefix + "o_proj.weight", (d, self.hd))
        self.conv_region = f"layers.{layer}.conv"
        self.recurrent_region = f"layers.{layer}.recurrent"

    def state_specs(self) -> list[RegionSpec]:
        # both rolled back to a row of a speculative step from the per-row snapshots the ops write
        return [RegionSpec(self.conv_region, False, (3 * self.hd, self.kernel - 1), "act", snapshot=True),
                RegionSpec(self.recurrent_region, False, (self.h, self.dk, self.dk), "float32", snapshot=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        t, h, dk, hd = x.shape[0], self.h, self.dk, self.hd
        proj = ops.linear(x, self.in_proj)  # [T, 3 HD + Dk + H + Dk]: q, k, v, f_a, b, g_a
        rows = batch.snapshot_rows  # a speculative step: every row's state also goes to its snapshot row
        conv, rec = state.arrays[self.conv_region], state.arrays[self.recurrent_region]
        if rows is None:
            mixed = ops.causal_conv1d(proj[:, :3 * hd], self.conv_weight, conv, batch.slots, batch.cu_seqlens)
        else:
            mixed = ops.causal_conv1d_rows(proj[:, :3 * hd], self.conv_weight, conv, batch.slots, batch.cu_seqlens,
                                           state.snapshots[self.conv_region], rows)
        qk = ops.l2_normalize(mixed[:, :2 * hd].reshape(t, 2 * h, dk))
        q, k, v = qk[:, :h], qk[:, h:], mixed[:, 2 * hd:].reshape(t, h, dk)
        f_a, b, g_a = proj[:, 3 * hd:3 * hd + dk], proj[:, 3 * hd + dk:3 * hd + dk + h], proj[:, 3 * hd + dk + h:]
        g, beta = ops.delta_gates(ops.linear(f_a, self.f_b), b, self.a_log, self.dt_bias)  # [T, HD], [T, H]
        g = g.reshape(t, h, dk)
        if rows is None:
            o = ops.gated_delta_rule(q, k, v, g, beta, rec, batch.slots, batch.cu_seqlens, prefill=batch.prefill)
        else:
            o = ops.gated_delta_rule_rows(q, k, v, g, beta, rec, batch.slots, batch.cu_seqlens,
                                          state.snapshots[self.recurrent_region], rows)
        gate = ops.linear(g_a, self.g_b)  # [T, HD]
        o = ops.sigmoid_mul(ops.rms_norm(o, self.norm_weight, self.eps), gate.reshape(t, h, dk))
        return ops.linear(o.reshape(t, hd), self.o_proj)  # [T, D]


def _qkv_conv(load: WeightLoader, prefix: str, channels: int, width: int):
    """The q, k and v convolutions as one [3 HD, K] fp32 weight (saved split, or as transformers' one conv1d)."""
    if load.has(prefix + "conv1d.weight"):
        return load.conv_weight(prefix + "conv1d.weight", 3 * channels, width, "linear_conv_kernel_dim")
    parts = [load.host(f"{prefix}{n}_conv1d.weight", (channels, 1, width)) for n in "qkv"]
    return load.ops.upload(np.concatenate(parts).reshape(3 * channels, width).astype(np.float32), np.float32)


class LatentAttention:
    """MLA without a position embedding: q = q_proj(x) (or q_b(norm(q_a(x)))); [c, k_rot] = kv_a(x), c normed;
    per head k = [W_uk c, k_rot], v = W_uv c; softmax(q k / sqrt(qk_head_dim)) v -> o_proj."""

    def __init__(self, cfg: KimiLinearConfig, load: WeightLoader, prefix: str, layer: int):
        d, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        nope, rot, dv, qd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
        self.h, self.r, self.rot = h, r, rot
        self.width = width = max(qd, dv)  # each head's K/V row
        self.scale = qd ** -0.5
        head_rows = lambda m, n: _pad_heads(m.reshape(h, n, -1), width)  # [H n, in] -> [H width, in]
        bias = lambda name, n: load.host(prefix + name + ".bias", (n,)) if cfg.attention_bias else np.zeros(n)
        self.q_lora = cfg.q_lora_rank
        if self.q_lora is None:
            q = head_rows(load.host(prefix + "q_proj.weight", (h * qd, d)), qd)
            first, first_bias = [q], [np.zeros(h * width)]
        else:
            first = [load.host(prefix + "q_a_proj.weight", (self.q_lora, d))]
            first_bias = [bias("q_a_proj", self.q_lora)]
            self.q_norm = RMSNorm(load, prefix + "q_a_layernorm.weight", self.q_lora, LATENT_NORM_EPS, False)
            self.q_b = load.ops.upload_rows([head_rows(load.host(prefix + "q_b_proj.weight", (h * qd, self.q_lora)),
                                                       qd)])
        # one GEMM for q (or q_a) and kv_a: [q rows + r + rot, D]
        self.in_proj = load.ops.upload_rows(first + [load.host(prefix + "kv_a_proj_with_mqa.weight", (r + rot, d))])
        self.in_bias = None
        if cfg.attention_bias:
            self.in_bias = load.ops.upload(np.concatenate(first_bias + [bias("kv_a_proj_with_mqa", r + rot)])
                                           .astype(np.float32), np.float32)
        self.kv_norm = RMSNorm(load, prefix + "kv_a_layernorm.weight", r, LATENT_NORM_EPS, False)
        kv_b = load.host(prefix + "kv_b_proj.weight", (h * (nope + dv), r)).reshape(h, nope + dv, r)
        self.kv_b = load.ops.upload_rows([_pad_heads(kv_b[:, :nope], width), _pad_heads(kv_b[:, nope:], width)])
        spread = np.zeros((h, width, rot), np.float32)
        spread[:, nope:qd] = np.eye(rot, dtype=np.float32)
        self.k_rot = load.ops.upload_rows([spread.reshape(h * width, rot)])  # k_rot into every head's rows
        o = load.host(prefix + "o_proj.weight", (d, h * dv)).reshape(d, h, dv)
        self.o_proj = load.ops.upload_rows([np.pad(o, ((0, 0), (0, 0), (0, width - dv))).reshape(d, h * width)])
        self.o_bias = load.bias([prefix + "o_proj.bias"], [d]) if cfg.attention_bias else None
        self.k_region, self.v_region = f"layers.{layer}.k", f"layers.{layer}.v"

    def state_specs(self) -> list[RegionSpec]:
        return [RegionSpec(self.k_region, True, (self.h, self.width), "act", kv=True),
                RegionSpec(self.v_region, True, (self.h, self.width), "act", kv=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        t, h, w, r = x.shape[0], self.h, self.width, self.r
        proj = ops.linear(x, self.in_proj)
        if self.in_bias is not None:
            proj = ops.add(proj, self.in_bias)
        q_end = h * w if self.q_lora is None else self.q_lora
        q = proj[:, :q_end] if self.q_lora is None else ops.linear(self.q_norm(ops, proj[:, :q_end]), self.q_b)
        kv = ops.linear(self.kv_norm(ops, proj[:, q_end:q_end + r]), self.kv_b)  # [T, 2 H w]: k without k_rot, v
        k = kv[:, :h * w]
        if self.rot:
            k = ops.add(k, ops.linear(proj[:, q_end + r:], self.k_rot))
        k, v = k.reshape(t, h, w), kv[:, h * w:].reshape(t, h, w)
        k_cache, v_cache = state.arrays[self.k_region], state.arrays[self.v_region]
        scales = {"k_scale": state.arrays.get(scale_region(self.k_region)),  # 8-bit K/V (engine/state/kv_dtype.py)
                  "v_scale": state.arrays.get(scale_region(self.v_region))}
        ops.write_kv(k_cache, v_cache, k, v, batch.kv_write_index, **scales)
        o = ops.paged_attention(q.reshape(t, h, w), k_cache, v_cache, batch.block_tables, batch.context_lens,
                                batch.cu_seqlens, self.scale, shared=batch.shared, prefill=batch.prefill, **scales)
        out = ops.linear(o.reshape(t, h * w), self.o_proj)
        return out if self.o_bias is None else ops.add(out, self.o_bias)


def _pad_heads(m: np.ndarray, width: int) -> np.ndarray:
    """[H, n, in] -> [H width, in], each head's n rows then zero rows."""
    return np.pad(m, ((0, 0), (0, width - m.shape[1]), (0, 0))).reshape(-1, m.shape[2])


class KimiMoe:
    """Sigmoid routing with a score-correction bias (ops.moe_route_sigmoid, times routed_scaling_factor), SwiGLU
    experts, plus the shared experts' SwiGLU on the same input."""

    def __init__(self, cfg: KimiLinearConfig, load: WeightLoader, prefix: str):
        moe, d = cfg.moe, cfg.hidden_size
        e, i, s = moe.num_experts, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.normalize, self.scale = e, moe.top_k, moe.norm_topk_prob, \
            cfg.routed_scaling_factor
        self.router = load.matrix(prefix + "gate.weight", (e, d))
        self.score_bias = load.vector(prefix + "gate.e_score_correction_bias", (e,))
        if load.has(prefix + "experts.gate_up_proj"):
            self.gate_up, self.down = expert_weights(load, prefix, e, d, i)
        else:
            part = lambda x, w, shape: load.part(f"{prefix}experts.{x}.{w}.weight", shape)
            self.gate_up = load.ops.upload_rows([part(x, w, (i, d)) for x in range(e) for w in ("w1", "w3")]) \
                .reshape(e, 2 * i, d)
            self.down = load.ops.upload_rows([part(x, "w2", (d, i)) for x in range(e)]).reshape(e, d, i)
        self.shared = _SharedExperts(cfg, load, prefix + "shared_experts.", s) if s else None

    def __call__(self, ops, x):
        weights, experts = ops.moe_route_sigmoid(ops.logits(x, self.router), self.score_bias, self.top_k,
                                                 self.normalize, self.scale)  # [T, k] each
        token_of_row, position, offsets = ops.moe_permute(experts, self.num_experts)
        y = ops.moe_grouped_linear(x, self.gate_up, offsets, token_of_row, activation="silu_mul")  # [T*k, I] sorted
        y = ops.moe_combine(ops.moe_grouped_linear(y, self.down, offsets), position, weights)
        return y if self.shared is None else ops.add(y, self.shared(ops, x))


class _SharedExperts(GatedMLP):
    def __init__(self, cfg: KimiLinearConfig, load: WeightLoader, prefix: str, size: int):
        d = cfg.hidden_size
        self.gate_up = load.stacked([prefix + "gate_proj.weight", prefix + "up_proj.weight"], [(size, d), (size, d)])
        self.down = load.matrix(prefix + "down_proj.weight", (d, size))
        self.gate_up_bias = self.down_bias = None
        self.act = lambda ops, h: ops.silu_mul(h)


def build(cfg: KimiLinearConfig, load: WeightLoader) -> CausalLM:
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        if kind == LINEAR_ATTENTION:
            mixer = KimiDeltaAttention(cfg, load, p + "self_attn.", i)
        else:
            mixer = LatentAttention(cfg, load, p + "self_attn.", i)
        saved = load.has(p + "block_sparse_moe.gate.weight") or load.has(p + "block_sparse_moe.gate_proj.weight")
        m = p + ("block_sparse_moe." if saved else "mlp.")
        mlp = KimiMoe(cfg, load, m) if cfg.moe is not None and cfg.moe.sparse_layers[i] else GatedMLP(cfg, load, m)
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        layers.append(DecoderLayer(mixer, mlp, norm("input_layernorm.weight"), norm("post_attention_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, layers, final)
