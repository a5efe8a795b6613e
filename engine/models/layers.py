"""Building blocks shared by the model families, written against kernel ops only.

Each token mixer declares its own state (`state_specs`) and reads/writes it through the step's ForwardBatch,
so the engine never switches on layer kinds. Shapes: T tokens in the step, D hidden size.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.load.config import SUPPORTED_ACTIVATIONS, DecoderConfig, HybridConfig
from prefixrun.engine.state.kv_dtype import scale_region, with_kv_dtype
from prefixrun.engine.state.pools import ForwardBatch, ModelState, RegionSpec
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.weights import CheckpointTensors


MXFP4_PARTS = ("_blocks", "_scales")


class WeightLoader:
    """Pulls named tensors from a checkpoint with expected shapes and uploads them to the backend.

    Models ask for tensors by the names transformers' in-memory model uses; `renames` maps a name prefix to the
    prefix the checkpoint stores it under (a composite saved as `language_model.model.*`, see engine.models)."""

    def __init__(self, tensors: CheckpointTensors, ops, renames: dict[str, str] | None = None):
        self.tensors = tensors
        self.ops = ops
        self.renames = dict(renames or {})

    def stored_name(self, name: str) -> str:
        for prefix, stored in self.renames.items():
            if name.startswith(prefix):
                return stored + name[len(prefix):]
        return name

    def has(self, name: str) -> bool:
        return self.stored_name(name) in self.tensors

    def host(self, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
        """The stored tensor on the host, checked against `shape`."""
        return self._numbers(name, self.tensors.get(self.stored_name(name), shape))

    def part(self, name: str, shape: tuple[int, ...] | None):
        """A weight as `ops.upload_rows` takes it: a host array, or an FP8 checkpoint's values and scales
        (engine/load/quantization.py), which the backend dequantises as it uploads them."""
        return self._numbers(name, self.tensors.stored(self.stored_name(name), shape))

    def _numbers(self, name: str, stored):
        """`stored`, refused when it holds integers or booleans: transformers would cast them into its floating
        parameters, a model of other numbers. MXFP4's packed blocks and exponents (`*_blocks`, `*_scales`) are
        bytes by design (engine/load/mxfp4.py checks them)."""
        if isinstance(stored, np.ndarray) and stored.dtype.kind in "biu" and not name.endswith(MXFP4_PARTS):
            raise ModelLoadError(f"{self.tensors.model_dir}: tensor {self.stored_name(name)!r} is stored as "
                                 f"{stored.dtype}; a weight must be floating point")
        return stored

    def conv_weight(self, name: str, channels: int, width: int, field: str):
        """A depthwise causal convolution's weight [channels, 1, width] as fp32 [channels, width], refused at load
        (naming the config field that sets `width`) when the backend's kernels do not run that width."""
        limit = self.ops.max_conv_width
        if limit is not None and width > limit:
            raise ModelLoadError(f"config.json: {field} gives a convolution {width} wide; the {self.ops.display_name} "
                                 f"kernels run widths up to {limit} (--device cpu runs any)")
        conv = self.host(name, (channels, 1, width))
        return self.ops.upload(conv.reshape(channels, width).astype(np.float32), np.float32)

    def matrix(self, name: str, shape: tuple[int, ...]):
        """A weight in the backend's storage dtype."""
        return self.ops.upload_rows([self.part(name, shape)])

    def vector(self, name: str, shape: tuple[int, ...], offset: float = 0.0):
        """A small fp32 parameter (norm weights, gates); `offset` folds a zero-centred norm's +1 in."""
        return self.ops.upload(self.host(name, shape).astype(np.float32) + np.float32(offset), np.float32)

    def stacked(self, names: list[str], shapes: list[tuple[int, ...]]):
        """Several [out_i, in] matrices concatenated along out, so one GEMM computes all of them: a projection's
        weight, only ever multiplied by `ops.linear` (ops.upload_linear: FP8 parts may stay FP8)."""
        return self.ops.upload_linear([self.part(n, s) for n, s in zip(names, shapes)])

    def projection(self, name: str, shape: tuple[int, ...]):
        """One [out, in] matrix that only `ops.linear` multiplies (ops.upload_linear, as `stacked`)."""
        return self.ops.upload_linear([self.part(name, shape)])

    def bias(self, names: list[str], sizes: list[int]):
        """The fp32 biases of one (stacked) projection, concatenated like its weights; added with ops.add."""
        return self.ops.upload(np.concatenate([self.host(n, (k,)).astype(np.float32) for n, k in zip(names, sizes)]),
                               np.float32)


class RMSNorm:
    def __init__(self, load: WeightLoader, name: str, dim: int, eps: float, zero_centered: bool,
                 leading_scale: tuple[int, float] | None = None):
        # Qwen3.5 / Gemma norms store w and compute x * (1 + w); the others store the scale itself.
        w = load.host(name, (dim,)).astype(np.float32) + np.float32(1.0 if zero_centered else 0.0)
        if leading_scale is not None:
            # (n, s): the first n outputs also scaled by s (folds yarn's rotary attention factor into q/k norms)
            n, s = leading_scale
            w[:n] *= np.float32(s)
        self.weight = load.ops.upload(w, np.float32)
        self.eps = eps

    def __call__(self, ops, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, ops, x, h, h_scale=1.0):
        """(x + h * h_scale, its norm) in one op; h None: nothing to add, (x, norm(x))."""
        if h is None:
            return x, ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, h, self.weight, self.eps, h_scale)


# hidden_act (transformers' ACT2FN names) -> the GLU op: act(gate) * up on a stacked [T, 2I] gate_up
ACTIVATIONS = {
    "silu": lambda ops, h: ops.silu_mul(h),
    "swish": lambda ops, h: ops.silu_mul(h),
    "gelu": lambda ops, h: ops.gelu_mul(h),  # exact: x * Phi(x) with erf
    "gelu_python": lambda ops, h: ops.gelu_mul(h),
    "gelu_pytorch_tanh": lambda ops, h: ops.gelu_tanh_mul(h),  # the tanh approximation ...
    "gelu_python_tanh": lambda ops, h: ops.gelu_tanh_mul(h),
    "gelu_new": lambda ops, h: ops.gelu_tanh_mul(h),  # ... which gelu_new and gelu_fast compute too
    "gelu_fast": lambda ops, h: ops.gelu_tanh_mul(h),
}
assert set(ACTIVATIONS) == set(SUPPORTED_ACTIVATIONS)


class GatedMLP:
    """down(act(gate(x)) * up(x)) with optional biases (Llama mlp_bias); gate and up are one stacked GEMM.
    `names`: the gate, up and down projections' names (LFM2 calls them w1, w3, w2)."""

    def __init__(self, cfg: DecoderConfig, load: WeightLoader, prefix: str,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        d, i = cfg.hidden_size, cfg.intermediate_size
        down = prefix + names[2] + "."
        names = [prefix + names[0] + ".", prefix + names[1] + "."]
        self.gate_up = load.stacked([n + "weight" for n in names], [(i, d), (i, d)])
        self.down = load.projection(down + "weight", (d, i))
        self.gate_up_bias = self.down_bias = None
        if cfg.mlp_bias:
            self.gate_up_bias = load.bias([n + "bias" for n in names], [i, i])
            self.down_bias = load.bias([down + "bias"], [d])
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, ops, x):
        h = ops.linear(x, self.gate_up)  # [T, 2I]
        if self.gate_up_bias is not None:
            h = ops.add(h, self.gate_up_bias)
        out = ops.linear(self.act(ops, h), self.down)  # [T, D]
        return out if self.down_bias is None else ops.add(out, self.down_bias)


class Attention:
    """Full (or sliding-window) attention over paged K/V, with optional per-head q/k RMSNorm, partial rotary
    and Qwen3.5's sigmoid output gate (q_proj then yields [query, gate] interleaved per head). `names`: the
    output projection's and the q/k norms' names (LFM2 calls them out_proj, q_layernorm, k_layernorm). `sinks`:
    gpt-oss's learned per-head logit (`sinks` [Hq]) in every softmax's denominator."""

    def __init__(self, cfg: DecoderConfig, load: WeightLoader, prefix: str, layer: int, *, qk_norm: bool,
                 output_gate: bool, zero_centered_norm: bool, rope=None, scale: float | None = None,
                 names: tuple[str, str, str] = ("o_proj", "q_norm", "k_norm"), sinks: bool = False):
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hq, self.hkv, self.hd = hq, hkv, hd
        self.output_gate = output_gate
        o_name, q_norm, k_norm = (prefix + n + "." for n in names)
        q_rows = hq * hd * (2 if output_gate else 1)
        names = [prefix + n for n in ("q_proj.", "k_proj.", "v_proj.")]
        rows = [q_rows, hkv * hd, hkv * hd]
        self.qkv = load.stacked([n + "weight" for n in names], [(r, d) for r in rows])
        self.o_proj = load.projection(o_name + "weight", (d, hq * hd))
        self.qkv_bias = self.o_bias = None
        if cfg.attention_bias:
            self.qkv_bias = load.bias([n + "bias" for n in names], rows)
            self.o_bias = load.bias([o_name + "bias"], [d])
        rope = rope or cfg.rope
        self.scale = scale if scale is not None else hd ** -0.5
        # yarn: transformers scales cos and sin, so the rotated dims of q and k, by the attention factor a
        rotated_scale = None
        if rope.attention_factor != 1.0:
            if qk_norm:
                rotated_scale = (rope.rotary_dim, rope.attention_factor)  # folded into the q/k norm weights
            elif rope.rotary_dim == hd:
                self.scale *= rope.attention_factor ** 2  # every dim rotates: q.k scales by a^2
            else:
                raise ModelLoadError(f"config.json: a yarn attention factor with partial rotary needs q/k norms "
                                     f"({cfg.architecture} has none)")
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(load, q_norm + "weight", hd, cfg.rms_norm_eps, zero_centered_norm, rotated_scale)
            self.k_norm = RMSNorm(load, k_norm + "weight", hd, cfg.rms_norm_eps, zero_centered_norm, rotated_scale)
        self.inv_freq = load.ops.upload(np.array(rope.inverse_frequencies(), np.float32), np.float32)
        self.sinks = load.vector(prefix + "sinks", (hq,)) if sinks else None  # fp32 [Hq]
        self.k_region = f"layers.{layer}.k"
        self.v_region = f"layers.{layer}.v"

    def state_specs(self) -> list[RegionSpec]:
        return [RegionSpec(self.k_region, True, (self.hkv, self.hd), "act", kv=True),
                RegionSpec(self.v_region, True, (self.hkv, self.hd), "act", kv=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        t = x.shape[0]
        qkv = ops.linear(x, self.qkv)  # [T, q_rows + 2 * Hkv * hd]
        if self.qkv_bias is not None:
            qkv = ops.add(qkv, self.qkv_bias)
        q_rows = self.hq * self.hd * (2 if self.output_gate else 1)
        kv_rows = self.hkv * self.hd
        if self.output_gate:
            qg = qkv[:, :q_rows].reshape(t, self.hq, 2 * self.hd)
            q, gate = qg[:, :, :self.hd], qg[:, :, self.hd:]  # [T, Hq, hd] each
        else:
            q, gate = qkv[:, :q_rows].reshape(t, self.hq, self.hd), None
        k = qkv[:, q_rows:q_rows + kv_rows].reshape(t, self.hkv, self.hd)
        v = qkv[:, q_rows + kv_rows:].reshape(t, self.hkv, self.hd)
        qw, kw, eps = (None, None, 0.0) if self.q_norm is None else \
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # q [T, Hq, hd], k [T, Hkv, hd]: normed (where the model norms them) and rotated, one op for both
        q, k = ops.qk_norm_rotary(q, k, qw, kw, eps, batch.positions, self.inv_freq)
        o = self.attend(ops, q, k, v, batch, state)  # [T, Hq, hd]
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        out = ops.linear(o.reshape(t, self.hq * self.hd), self.o_proj)  # [T, D]
        return out if self.o_bias is None else ops.add(out, self.o_bias)

    def attend(self, ops, q, k, v, batch: ForwardBatch, state: ModelState):
        """Store the new K/V rows in the shared paged cache, then attend over the whole prefix. [T, Hq, hd]"""
        k_cache, v_cache = state.arrays[self.k_region], state.arrays[self.v_region]
        scales = self.kv_scales(state)
        ops.write_kv(k_cache, v_cache, k, v, batch.kv_write_index, **scales)
        return ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.cu_seqlens,
                                   self.scale, shared=batch.shared, sinks=self.sinks, prefill=batch.prefill, **scales)

    def kv_scales(self, state: ModelState) -> dict:
        """The scales of 8-bit K/V regions (engine/state/kv_dtype.py), as the attention ops take them; None
        where the K/V rows are stored unquantised."""
        return {"k_scale": state.arrays.get(scale_region(self.k_region)),
                "v_scale": state.arrays.get(scale_region(self.v_region))}


class SlidingWindowAttention(Attention):
    """Attention over the last `window` positions only. Its K/V state is a ring of `window` rows per sequence
    (memory independent of prompt length), copied whole on fork like a recurrent state."""

    def __init__(self, cfg: DecoderConfig, *args, window: int, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.window = window
        self.max_context = cfg.max_position_embeddings

    def state_specs(self) -> list[RegionSpec]:
        shape = (self.window, self.hkv, self.hd)
        return [RegionSpec(self.k_region, False, shape, "act", ring=True, kv=True),
                RegionSpec(self.v_region, False, shape, "act", ring=True, kv=True)]

    def attend(self, ops, q, k, v, batch: ForwardBatch, state: ModelState):
        return ops.ring_attention(q, k, v, state.arrays[self.k_region], state.arrays[self.v_region], batch.slots,
                                  batch.cu_seqlens, batch.context_lens, self.scale, self.max_context,
                                  sinks=self.sinks, **self.kv_scales(state))


class GatedDeltaNet:
    """Qwen3.5 linear attention: in_proj_qkv -> causal depthwise conv + SiLU -> q/k L2 norm -> gated delta rule
    from the recurrent state -> gated RMSNorm with z -> out_proj. State: conv history and recurrent state."""

    def __init__(self, cfg: HybridConfig, load: WeightLoader, prefix: str, layer: int):
        d = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.linear_key_dim, cfg.linear_value_dim, cfg.conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        # one GEMM for qkv, z, b, a
        self.in_proj = load.stacked(
            [prefix + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")],
            [(self.conv_dim, d), (self.value_dim, d), (self.hv, d), (self.hv, d)])
        self.conv_weight = load.conv_weight(prefix + "conv1d.weight", self.conv_dim, self.kernel,
                                            "linear_conv_kernel_dim")
        self.a_log = load.vector(prefix + "A_log", (self.hv,))
        self.dt_bias = load.vector(prefix + "dt_bias", (self.hv,))
        self.norm_weight = load.vector(prefix + "norm.weight", (self.dv,))
        self.eps = cfg.rms_norm_eps
        self.out_proj = load.projection(prefix + "out_proj.weight", (d, self.value_dim))
        self.conv_region = f"layers.{layer}.conv"
        self.recurrent_region = f"layers.{layer}.recurrent"

    def state_specs(self) -> list[RegionSpec]:
        # both are rolled back to a row of a speculative step from the per-row snapshots the ops write
        return [RegionSpec(self.conv_region, False, (self.conv_dim, self.kernel - 1), "act", snapshot=True),
                RegionSpec(self.recurrent_region, False, (self.hv, self.dk, self.dv), "float32", snapshot=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        t = x.shape[0]
        proj = ops.linear(x, self.in_proj)  # [T, conv_dim + value_dim + 2 Hv]
        c, v_end = self.conv_dim, self.conv_dim + self.value_dim
        rows = batch.snapshot_rows  # a speculative step: every row's state also goes to its snapshot row
        if rows is None:
            mixed = ops.causal_conv1d(proj[:, :c], self.conv_weight, state.arrays[self.conv_region],
                                      batch.slots, batch.cu_seqlens)  # [T, conv_dim]
        else:
            mixed = ops.causal_conv1d_rows(proj[:, :c], self.conv_weight, state.arrays[self.conv_region],
                                           batch.slots, batch.cu_seqlens, state.snapshots[self.conv_region], rows)
        # q and k are adjacent in `mixed`: one normalisation over their 2 Hk heads
        qk = ops.l2_normalize(mixed[:, :2 * self.key_dim].reshape(t, 2 * self.hk, self.dk))
        z = proj[:, c:v_end].reshape(t, self.hv, self.dv)
        g, beta = ops.delta_gates(proj[:, v_end + self.hv:], proj[:, v_end:v_end + self.hv], self.a_log,
                                  self.dt_bias)  # [T, Hv] each
        q, k = qk[:, :self.hk], qk[:, self.hk:]
        v = mixed[:, 2 * self.key_dim:].reshape(t, self.hv, self.dv)
        # value heads share key heads in groups (repeat_interleave, as HF): the op reads key head h // (Hv / Hk)
        if rows is None:
            o = ops.gated_delta_rule(q, k, v, g, beta, state.arrays[self.recurrent_region], batch.slots,
                                     batch.cu_seqlens, prefill=batch.prefill)  # [T, Hv, Dv]
        else:
            o = ops.gated_delta_rule_rows(q, k, v, g, beta, state.arrays[self.recurrent_region], batch.slots,
                                          batch.cu_seqlens, state.snapshots[self.recurrent_region], rows)
        o = ops.gated_rms_norm(o, z, self.norm_weight, self.eps).reshape(t, self.value_dim)
        return ops.linear(o, self.out_proj)  # [T, D]


class DecoderLayer:
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)). Gemma adds sandwich norms on the
    mixer's and the MLP's outputs (`mixer_out_norm`, `mlp_out_norm`)."""

    def __init__(self, mixer, mlp, input_norm: RMSNorm, post_norm: RMSNorm, mixer_out_norm: RMSNorm | None = None,
                 mlp_out_norm: RMSNorm | None = None):
        self.mixer, self.mlp, self.input_norm, self.post_norm = mixer, mlp, input_norm, post_norm
        self.mixer_out_norm, self.mlp_out_norm = mixer_out_norm, mlp_out_norm

    def state_specs(self) -> list[RegionSpec]:
        return self.mixer.state_specs()

    def __call__(self, ops, x, batch, state):
        x, h = self.step(ops, x, None, batch, state)
        return ops.add(x, h)

    def step(self, ops, x, pending, batch, state):
        """The layer on the residual stream x + pending (pending None: x alone), each residual add fused into the
        norm that follows it -> (residual, this layer's last output h, not yet added: the next norm adds it)."""
        x, normed = self.input_norm.add_norm(ops, x, pending)
        h = self.mixer(ops, normed, batch, state)
        if self.mixer_out_norm is not None:
            h = self.mixer_out_norm(ops, h)
        x, normed = self.post_norm.add_norm(ops, x, h)
        h = self.mlp(ops, normed)
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(ops, h)
        return x, h


class CausalLM:
    """Embedding -> decoder layers -> final norm -> LM head; the families differ only in how they build layers."""

    def __init__(self, cfg: DecoderConfig, load: WeightLoader, layers: list, final_norm: RMSNorm, *,
                 embed_scale: float | None = None, logit_softcap: float | None = None):
        self.cfg = cfg
        self.embed_scale = embed_scale  # Gemma multiplies embeddings by sqrt(hidden), rounded to the storage dtype
        self.logit_softcap = logit_softcap
        self.ops = load.ops
        p = cfg.weight_prefix
        self.embed_tokens = load.matrix(p + "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        # As transformers loads: a stored lm_head is used even when tie_word_embeddings is set (it does not tie two
        # stored, different tensors); a missing one is the embedding only when tied (else it would be random).
        stored = load.has("lm_head.weight")
        if stored and cfg.tie_word_embeddings:  # a stored copy of the embedding is tied; no second upload
            stored = not _same_bytes(load.host("lm_head.weight", None), load.host(p + "embed_tokens.weight", None))
        if stored:
            self.lm_head = load.matrix("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            raise ModelLoadError(f"{load.tensors.model_dir}: tie_word_embeddings is false but the checkpoint has no "
                                 f"{load.stored_name('lm_head.weight')!r}")
        self.layers = layers
        self.final_norm = final_norm
        self.mtp = None  # the MTP head (engine/models/mtp.py), when loaded for --speculative mtp
        self.kv_cache_dtype = "auto"  # how attention K/V rows are stored (engine/state/kv_dtype.py; build_model)

    def state_specs(self) -> list[RegionSpec]:
        specs = [s for layer in self.layers for s in layer.state_specs()]
        specs += self.mtp.state_specs() if self.mtp is not None else []
        return with_kv_dtype(specs, self.kv_cache_dtype)

    def embed(self, token_ids):
        if self.embed_scale is None:
            return self.ops.embed(self.embed_tokens, token_ids)  # [T, D]
        return self.ops.embed(self.embed_tokens, token_ids, np.asarray(self.embed_scale, dtype=self.ops.act_dtype))

    def forward(self, batch: ForwardBatch, state: ModelState, all_logits: bool = False, with_hidden: bool = False):
        """Run the step; returns fp32 logits [B, V] of each sequence's last new token ([T, V] if all_logits).
        with_hidden: (logits, the final-normed hidden states [B or T, D] the logits were computed from)."""
        ops = self.ops
        x, h = self.embed(batch.token_ids), None  # the residual stream is x + h: each add runs in the next norm
        for layer in self.layers:
            x, h = layer.step(ops, x, h, batch, state)
        if self.mtp is not None:  # the head's state follows every step: it needs every row's final hidden state
            _, x = self.final_norm.add_norm(ops, x, h)  # [T, D]
            self.mtp.absorb(ops, x, batch, state)
            if not all_logits:
                x = ops.embed(x, batch.last_token_index)  # [B, D]: each sequence's last row (a prepared kernel)
        else:
            if not all_logits:  # [B, D]: each sequence's last row of both (not x[index]: a library kernel's first use)
                x = ops.embed(x, batch.last_token_index)
                h = ops.embed(h, batch.last_token_index) if h is not None else None
            _, x = self.final_norm.add_norm(ops, x, h)
        logits = ops.logits(x, self.lm_head)
        if self.logit_softcap is not None:
            logits = ops.softcap(logits, self.logit_softcap)
        return (logits, x) if with_hidden else logits


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
