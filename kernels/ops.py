"""The backend contract: everything the engine may call on an ops object, written down once.

Two backends implement it: `NumpyOps` (kernels/reference.py: fp32 on the host, the reference every other backend
is tested against) and `CudaOps` (kernels/cuda.py: CuPy, bf16 or fp32 storage, fp32 accumulation).
tests/test_backend_contract.py checks that both have every member below with the same parameters, and that no
code outside kernels/ asks which backend it holds: what differs between backends is a query here.

Conventions: arrays are the backend's own (numpy or cupy); T = new tokens in a step (all sequences
concatenated), B = sequences in the step, cu_seqlens [B+1] int32 offsets of each sequence's tokens in T.
Per-sequence state lives in pools indexed by slot (`slots` [B]); attention K/V in paged pools
[num_blocks, block_size, Hkv, D] indexed by block tables. Ops that update state do it in place. "act" is the
backend's storage dtype (`act_dtype`): fp32 on the CPU, bf16 (default) or fp32 on CUDA. The reference
implementation's docstrings are the full semantics of each op; this file states the shapes and what is promised.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray, as the backend makes them


@runtime_checkable
class Graph(Protocol):
    """A captured step: replay() reruns it and returns the outputs the captured function returned."""

    def replay(self) -> Any: ...


@runtime_checkable
class Ops(Protocol):
    # ---- queries: what the engine and the CLI may ask instead of "which backend is this" -----------------------
    display_name: str  # for reports ("cpu", "cuda")
    device_kind: str  # where arrays live, as torch names devices ("cpu", "cuda"): for handing work to other libraries
    dtype_name: str  # the storage dtype's name ("float32", "bfloat16")
    act_dtype: Any  # the storage dtype (a numpy dtype or ml_dtypes.bfloat16)
    can_capture_graphs: bool  # True: `capture` records launches and replays them without Python (worth using)
    default_block_size: int  # K/V rows per paged block that this backend runs best with
    auto_speculation: bool  # --speculative auto may draft here (the backend's multi-row steps have been checked)
    max_conv_width: int | None  # the widest causal convolution (kernel width) `causal_conv1d` runs; None: any
    max_ssm_state: int | None  # the largest Mamba2 state size (d_state) `ssd_scan` runs; None: any
    per_channel_decay: bool  # `gated_delta_rule(_rows)` take g [T, H, Dk] (a decay per key channel, Kimi's KDA)
    # batch-invariant kernels (--deterministic): a row's results depend on its own inputs and, for the sequence
    # mixers, on whether the step is a prefill step, never on the other rows, their number or how a step was cut
    deterministic: bool

    def free_memory(self) -> int | None:
        """Bytes of device memory still available for state pools; None when state lives in host memory that the
        backend does not manage (the caller then picks a fixed size)."""

    def device_identity(self) -> str:
        """What a measurement of this device's speed depends on besides the work (the device's model and memory,
        its driver and runtime versions, the array library's version): a measurement remembered under it is
        believed only where it is the same (engine/run/batch_memo.py)."""

    def storage_dtype(self, kind: str) -> np.dtype:
        """The dtype of a state region declared `kind`: "float32" -> float32, "act" -> the storage dtype."""

    def release_cached_memory(self) -> None:
        """Give cached, unused allocations back (before another library allocates on the same device)."""

    def prepare_kernels(self, plan=None) -> None:
        """Start making the backend's kernels ready (compile, load, pick GEMM kernels) in the background and return
        at once: the loader calls it before uploading the weights, so that a fresh process's first steps do not pay
        for it. `plan`: None, or a function (called in the background) returning the model's kernels/warmup.py
        KernelPlan: the GEMM shapes the forward will compute. Never changes a result and never fails: nothing to do
        where there are no kernels; a kernel that fails here fails again, with its error, when used."""

    def kernel_account(self) -> dict | None:
        """What `prepare_kernels`' background work did so far (seconds per part, errors), for the run's start-up
        report; None where there is nothing to prepare."""

    # ---- memory ------------------------------------------------------------------------------------------------
    def zeros(self, shape, dtype=None) -> Array:
        """A zeroed array of `shape` in `dtype` (default: act)."""

    def upload(self, host_array, dtype=None) -> Array:
        """Host (or backend) array -> a new backend array converted to `dtype` (default: act)."""

    def upload_rows(self, host_parts, dtype=None) -> Array:
        """Host arrays [n_i, ...] -> one new backend array [sum n_i, ...] (their concatenation along axis 0) in
        `dtype` (default: act), without a host-side concatenation where the backend can avoid it (weight loads).
        A part may be a kernels/fp8.py Fp8Matrix (2-D parts then): its rows are its exact dequantisation
        (`Fp8Matrix.dequantize`, then rounded to `dtype`), made where the backend computes. A part may also be a
        backend array `read_weights` handed out, which the caller gives up: a lone part already in `dtype` may
        come back as it is."""

    def upload_permuted(self, part, view_shape, axes) -> Array:
        """A weight stored in another layout, rearranged: `part` (a host array, or a backend array `read_weights`
        handed out or an upload made, which the caller gives up) viewed as `view_shape` (its elements in C order), its axes permuted
        as numpy.transpose(axes) does, as a new contiguous backend array in the activation dtype. Values are only
        moved and rounded to that dtype, as `upload` rounds them: the stored bytes may go to the device as they are
        and be rearranged there (gpt-oss's fused experts: transposed, gate and up de-interleaved)."""

    def upload_mxfp4(self, blocks, scales) -> Array:
        """MXFP4 values as stored (kernels/mxfp4.py: host blocks [..., G, 16] and scales [..., G], uint8, checked)
        -> a new backend array [..., G * 32] in the activation dtype, their exact dequantisation
        (`dequantize_mxfp4`, exact in fp32 and bf16 alike), made where the backend computes."""

    def upload_linear(self, host_parts) -> Any:
        """A projection's weight from `host_parts` as `upload_rows` takes them (stacked along axis 0, storage
        dtype), only ever passed to `linear` as its `weight` (never sliced, reshaped or read otherwise). A backend
        may keep FP8 parts as stored and multiply them on FP8 tensor cores (activations quantised per row per 128
        columns: `linear` then equals its product with the dequantised weight within FP8 rounding, and
        docs/PERFORMANCE.md states the error); the reference stores the exact dequantisation, as `upload_rows`."""

    def read_weights(self, spans) -> "WeightReads":
        """Start reading the checkpoint tensors `spans` (kernels/weight_reads.py TensorSpans, in the order the build
        will ask for them) into backend memory on threads of the backend's choosing; returns at once. The result's
        take(name) gives each one once as a backend array in its stored dtype (a part `upload_rows` takes; an FP8
        tensor as its bytes, uint8, which kernels/fp8.py Fp8Matrix takes as its values), or None for one it does
        not read (the caller reads that one itself); close() ends it."""

    def upload_index(self, host_array) -> Array:
        """Host integers -> a backend int32 array (contiguous)."""

    def write_index(self, dst, host_array) -> None:
        """Overwrite the int32 backend array `dst` in place with host data of the same size (graph inputs)."""

    def upload_into(self, pairs) -> None:
        """For each (dst, host_array) in `pairs`: copy host_array into dst, a C-contiguous backend array (or view of
        one) of the same shape and item size, in place, ordered before any later work on dst. One call for many
        small arrays (a restored state's regions): the backend may batch them into one transfer. A source may also
        be a slice along the first axis of an array `upload_ahead` returned (then a copy within the device)."""

    def upload_ahead(self, arrays) -> list | None:
        """Backend copies of the host arrays in the list `arrays` (same shapes, same item sizes), for `upload_into`
        to use later: a restored state's K/V rows moved to the device while the engine computes something else.
        May be called from a thread other than the engine's, runs beside the engine's queued work, and returns once
        the copies are complete. None where the device has no room for them (the caller keeps the host arrays).
        A backend that computes in host memory returns the arrays themselves."""

    def to_host(self, array) -> np.ndarray:
        """Backend array -> numpy array of the same dtype (bf16 as ml_dtypes.bfloat16)."""

    def to_host_later(self, array) -> Callable[[], np.ndarray]:
        """Queue a copy of the small backend array `array` (as it is once the work queued so far is done) to the
        host and return a function that waits for that copy alone and gives it as a new numpy array; call it once,
        before 8 later calls reuse its buffer. The host does not wait for the device here (a decode step's
        sampled ids, read one step late)."""

    def start_host_copy(self, arrays):
        """Capture the content of the list `arrays` now (later writes to them do not show) and return a function
        that gives them as a list of new numpy arrays (same shapes and dtypes). The function may block until the
        copies are done and may be called from another thread: the device -> host transfers need not hold up the
        work queued after this call."""

    def synchronize(self) -> None:
        """Wait until all queued work is done (timings)."""

    # ---- dense math --------------------------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0) -> Array:
        """table [V, D], ids [T] int -> act [T, D]: rows gathered (the model also picks each sequence's last row
        of an act [T, D] with it); scale != 1 (rounded to the storage dtype by the caller): the same numbers as
        `scale` on the gathered rows"""

    def linear(self, x, weight) -> Array:
        """x [T, in] @ weight[out, in].T -> act [T, out] (fp32 accumulation); weight: a storage-dtype matrix or an
        `upload_linear` weight"""

    def logits(self, x, lm_head) -> Array:
        """x [N, D] @ lm_head[V, D].T -> fp32 [N, V]"""

    def rms_norm(self, x, weight, eps) -> Array:
        """x [..., D] * rsqrt(mean(x^2) + eps) * weight [D] -> act [..., D]"""

    def gated_rms_norm(self, x, gate, weight, eps) -> Array:
        """RMSNorm(x [..., D]) * weight [D] * silu(gate [..., D]) -> act [..., D]"""

    def add_rms_norm(self, x, h, weight, eps, h_scale=1.0) -> tuple[Array, Array]:
        """x, h [T, D] -> (s = x + h * h_scale, rms_norm(s)), both act [T, D]: the residual add and the next norm
        in one pass; at h_scale 1 the same numbers as `add` then `rms_norm` (the norm reads s as stored). h_scale
        (a float the caller rounded to the storage dtype, as `scale` takes it) scales a branch before its add; the
        reference rounds the product as `scale` does, a backend may round the scaled sum once."""

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, positions, inv_freq) -> tuple[Array, Array]:
        """q [T, Hq, Dh], k [T, Hk, Dh] -> new act arrays: per-head `rms_norm` (weights [Dh]; both None: no norm)
        then `rotary` at positions [T], for both in one pass; the same numbers as those ops one after another."""

    def sigmoid_mul(self, x, gate) -> Array:
        """x * sigmoid(gate), both [..., D] of one shape (strided views allowed) -> act; the sigmoid is rounded to
        act before the product, as `x * sigmoid(gate)` rounds it."""

    def mul(self, a, b) -> Array:
        """a * b, both [..., D] of one shape (strided views allowed) -> act (LFM2's short-convolution gates)"""

    def silu_mul(self, gate_up) -> Array:
        """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]"""

    def clamped_swiglu(self, gate_up, alpha, limit) -> Array:
        """gate_up [T, 2I] (gate then up) -> (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) [T, I],
        g = min(gate, limit) (gpt-oss's experts)"""

    def gelu_tanh_mul(self, gate_up) -> Array:
        """gate_up [T, 2I] -> gelu_tanh(gate) * up [T, I]"""

    def gelu_mul(self, gate_up) -> Array:
        """gate_up [T, 2I] -> gelu(gate) * up [T, I], exact (erf) GELU"""

    def scale(self, x, factor) -> Array:
        """x * factor, in x's dtype"""

    def softcap(self, x, cap) -> Array:
        """cap * tanh(x / cap), in x's dtype"""

    def add(self, a, b) -> Array:
        """a + b, b broadcast over a's leading dims; a's dtype"""

    def rotary(self, x, positions, inv_freq) -> Array:
        """x [T, H, Dh] rotated in place (rotate-half, first 2 * len(inv_freq) dims) at positions [T]; returns x"""

    def l2_normalize(self, x, eps=1e-6) -> Array:
        """x [..., D] * rsqrt(sum(x^2) + eps), x's dtype"""

    def sigmoid(self, x) -> Array:
        """1 / (1 + exp(-x)), x's dtype"""

    def delta_gates(self, a, b, a_log, dt_bias) -> tuple[Array, Array]:
        """a [T, Ha], b [T, Hb] (Hb <= Ha; Kimi's KDA: Ha = H Dk, a decay per key channel) -> (g = -exp(a_log)
        * softplus(a + dt_bias) fp32 [T, Ha], beta = sigmoid(b) fp32 [T, Hb])"""

    # ---- sequence mixing ---------------------------------------------------------------------------------------
    def causal_conv1d(self, x, weight, conv_state, slots, cu_seqlens, silu: bool = True, bias=None) -> Array:
        """x [T, C], weight [C, K], conv_state [num_slots, C, K-1] (updated in place) -> silu(conv + bias) [T, C]
        (silu False: the convolution alone; bias: None, or fp32 [C] added before the activation)"""

    def gated_delta_rule(self, q, k, v, g, beta, state, slots, cu_seqlens, chunk_size=64, prefill=False) -> Array:
        """q, k [T, Hk, Dk], v [T, H, Dv], g, beta fp32 [T, H] (g [T, H, Dk] where `per_channel_decay`: each key
        channel decays by its own exp(g)), state fp32 [num_slots, H, Dk, Dv] (in place) -> o [T, H, Dv].
        `prefill`: a prefill step; a deterministic backend computes each of its sequences in chunks of `chunk_size`
        tokens from the sequence's first new token (the engine starts them on multiples of it), and every other step
        token by token, as `gated_delta_rule_rows` does (or, a decay per key channel, every step token by token)."""

    def causal_conv1d_rows(self, x, weight, conv_state, slots, cu_seqlens, snapshots, snapshot_rows,
                           silu: bool = True, bias=None) -> Array:
        """`causal_conv1d`, and the conv history after every token t with snapshot_rows[t] >= 0 written to
        snapshots[snapshot_rows[t]] (snapshots [R, C, K-1] in conv_state's dtype; snapshot_rows [T] int32, -1: none).
        Each token's output and the final state equal `causal_conv1d`'s (a speculative step's rows)."""

    def gated_delta_rule_rows(self, q, k, v, g, beta, state, slots, cu_seqlens, snapshots, snapshot_rows) -> Array:
        """`gated_delta_rule` stepped token by token (every row computed as a one-token decode step computes it),
        and the state after every token t with snapshot_rows[t] >= 0 written to snapshots[snapshot_rows[t]]
        (fp32 [R, H, Dk, Dv]; snapshot_rows [T] int32, -1: none) -> o [T, H, Dv]"""

    def ssd_scan(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens) -> Array:
        """The Mamba2 selective state-space scan (kernels/mamba_reference.py: full semantics). x [T, H, P], dt [T, H]
        (raw: softplus(dt + dt_bias) clamped to dt_limit = (low, high) is the step), b, c [T, G, N] (head h reads
        group h // (H / G)), a_log, dt_bias, d fp32 [H], state fp32 [num_slots, H, P, N] (in place); views with
        strided rows allowed -> y [T, H, P] act: per token S = exp(dt A) S + dt x b^T, y = S c + d x."""

    def ssd_scan_rows(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, snapshots,
                      snapshot_rows) -> Array:
        """`ssd_scan` stepped token by token (every row as a one-token decode step computes it), and the state after
        every token t with snapshot_rows[t] >= 0 written to snapshots[snapshot_rows[t]] (fp32 [R, H, P, N];
        snapshot_rows [T] int32, -1: none) -> y [T, H, P]"""

    def gated_group_rms_norm(self, x, gate, weight, eps, group_size) -> Array:
        """Mamba2's output norm: s = x * silu(gate) (x, gate [T, D], strided rows allowed), each group of
        `group_size` channels of s RMS-normalised, times weight fp32 [D] -> act [T, D]"""

    def relu2(self, x) -> Array:
        """relu(x)^2 of x [T, I] -> act [T, I] (Nemotron-H's MLP activation)"""

    # K/V caches hold rows in their own storage (--kv-cache-dtype; kernels/kv_storage.py: the exact format): act,
    # bf16, or 8 bits (int8, or fp8 e4m3 bytes as uint8) with fp32 scales [..., Hkv, D / 32] in k_scale / v_scale
    # (None for unquantised caches). Writes round or quantise; reads see exactly the stored values, in fp32.
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
        """k, v [T, Hkv, D] stored at flat rows slot_mapping [T] (block * block_size + offset) of the caches (and
        their scales)"""

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, scale,
                        sliding_window=None, shared=None, sinks=None, k_scale=None, v_scale=None,
                        prefill=False) -> Array:
        """q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D] via block_tables [B, W] and context_lens [B]
        (after the step), causal, optionally windowed; `shared` (engine.step.forward_batch.SharedPrefixes) lets a
        backend read a decode step's shared prefix once per group; `sinks` fp32 [Hq]: a learned logit per head in
        the softmax's denominator (gpt-oss); `prefill`: the step is a prefill step (a deterministic backend may
        compute prefill rows and decode / verify rows in different, each batch-invariant, ways) -> [T, Hq, D]"""

    def ring_attention(self, q, k, v, k_ring, v_ring, slots, cu_seqlens, context_lens, scale, max_context,
                       sinks=None, k_scale=None, v_scale=None) -> Array:
        """Sliding-window attention of q [T, Hq, D] over rings [num_slots, W, Hkv, D] (position p at row p % W)
        plus the new rows k, v [T, Hkv, D] (read as the rings store them), which are then written into the rings;
        `sinks` as paged_attention's -> [T, Hq, D]"""

    # ---- sparse MoE (kernels/moe_reference.py: full semantics) --------------------------------------------------
    # N = T * k (token, choice) slots, grouped by expert into rows; sizes depend only on T, k and E, never on the
    # routing, and no op syncs with the host, so a decode step with an MoE MLP stays capturable.
    def moe_route(self, router_logits, top_k, normalize) -> tuple[Array, Array]:
        """router_logits [T, E] fp32 (rows may be strided) -> (weights [T, k] fp32, experts [T, k] int32): softmax,
        the k largest in descending order, renormalised to sum 1 when `normalize`."""

    def moe_route_sigmoid(self, router_logits, bias, top_k, normalize, scale) -> tuple[Array, Array]:
        """router_logits [T, E] fp32, bias fp32 [E] -> (weights [T, k] fp32, experts [T, k] int32): sigmoid scores,
        the k largest of score + bias in descending order, weights = their scores (over their sum + 1e-20 when
        `normalize`) times `scale` (Nemotron-H's MoE router)."""

    def moe_permute(self, experts, num_experts) -> tuple[Array, Array, Array]:
        """experts [T, k] int32 -> (token_of_row [N], position [N] = row of slot t*k+j, offsets [E+1]) int32:
        expert e's rows are offsets[e]..offsets[e+1]; within an expert any order."""

    def moe_grouped_linear(self, x, weight, offsets, token_of_row=None, bias=None, activation=None) -> Array:
        """Every expert's projection in one call: out[r] = x_r @ weight[e].T (+ bias[e], fp32 [E, out]) for the rows
        r of expert e; weight [E, out, in]; x_r = x[token_of_row[r]] if given, else x[r]. -> act [N, out] (fp32
        accumulation). activation "silu_mul" or "relu2": the same numbers as that op on the result ([N, out / 2]
        for silu_mul: the gate rows of weight first, then the up rows), which a backend may apply in the same pass."""

    def moe_combine(self, y, position, weights, shared=None, shared_gate=None, scale=1.0) -> Array:
        """out[t] = (sum_j weights[t, j] * y[position[t*k + j]] + sigmoid(shared_gate[t]) * shared[t]) * scale ->
        act [T, D]; y [N, D], shared [T, D] (none: no shared term; no gate: shared[t] itself), shared_gate [T, 1]
        (may be a strided column); scale as `scale` takes it (the reference rounds nothing before it)."""

    # ---- state copies ------------------------------------------------------------------------------------------
    def copy_rows(self, arrays, src, dst) -> None:
        """For each pool array a: a[dst[i]] = a[src[i]] (slot/block copies of fork, save, restore)."""

    # ---- sampling ----------------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, counters) -> Array:
        """logits [B, V] and per-row host parameters [B] (seeds uint64, counters = index of the token drawn) ->
        backend int64 token ids [B] (kernels/sampling.py: the semantics; temperature 0: argmax). No host sync."""

    def feed_tokens(self, token_ids, source, previous) -> None:
        """token_ids int32 [T] (in place), source int32 [T], previous int64 [P] (a previous step's sampled ids):
        token_ids[i] = previous[source[i]] where source[i] >= 0, other rows unchanged. No host sync: a decode step
        is fed the tokens of the step before it while they are still on the device."""

    def apply_token_bitmask(self, logits, bitmask) -> None:
        """logits fp32 [B, V] (rows may be strided; in place), bitmask int32 [B, W] backend, W * 32 >= V: logits
        [b, v] = -inf where bit v % 32 of bitmask[b, v // 32] is clear (structured output's allowed tokens; bits
        past V are not read). No host sync."""

    def sample_into(self, logits, params, out) -> Array:
        """`sample` with its parameters packed in a backend uint32 [8, B] array (sampling.pack_sampling_params;
        or int32 with the same bits) into a preallocated int64 [B] `out`: allocates and syncs nothing, so a graph
        can capture it. Rows marked SKIP_DRAW (sampling.with_skipped_rows) are not drawn: their `out` entries keep
        what they held."""

    def process_logits(self, logits, edits) -> Array:
        """The logits-processing stage's edits (kernels/logits_edits.py: semantics, order and layout) applied in
        place to fp32 logits [B, V] (row-strided views allowed); returns logits. edits: a backend int32 array of
        `LogitsEdits.pack()` (upload_index). No host sync."""

    def token_logprobs(self, logits, rows, tokens, k) -> Array:
        """Log-probabilities (log_softmax of fp32 logits [N, V]) for the rows `rows` (backend int32 [R]): float32
        [R, 1 + 2k] = the logprob of tokens[rows[i]] (backend int64 [N]), the k largest logprobs in descending
        order (ties: the lower id first), their ids as floats (kernels/logits_edits.py `top_logprobs`). k <= 64.
        No host sync."""

    # ---- graphs ------------------------------------------------------------------------------------------------
    def capture(self, fn: Callable, *args, warmup: int = 1) -> Graph:
        """Run fn(*args) `warmup` times, then record it; the returned graph's replay() reruns it on the same
        input buffers (updated in place between replays) and returns the same output arrays."""
