"""How the CUDA backend runs Kimi's KDA, the gated delta rule with a decay per key channel (g [T, H, Dk]): the
tensor-core chunked form for bf16 prefills (kernels/kda_tc.cu), the fp32 chunked form (kernels/delta_rule.cu,
PER_CHANNEL) or token steps (kernels/kda.cu), as pure functions of shapes and the one `CudaTuning` (no CuPy here:
tests/test_kernel_tuning.py pins them on the CPU).

- tensor cores (`kda_tc_launch`): the form of Gated DeltaNet's tensor-core prefill (kernels/delta_tc.cu: 64-token
  chunks, bf16 operands, the fp32 state in registers; its scan kernel with PER_CHANNEL), whose per-chunk pass has
  the decay inside the dot products. "auto" takes it where Gated DeltaNet's "auto" takes its own (sequences
  averaging GDN_TC_MIN_MEAN tokens, bf16 16-byte aligned rows, key and value dims <= 128 and multiples of 8).
- the fp32 chunked form and token steps: `kda_chunked` and `kda_step_launch` below.
"""
from __future__ import annotations

from prefixrun.kernels.tuning import GDN_CHUNK_DMAX, GDN_DECODE_BLOCKS, GDN_KEY_DIMS, GDN_TC_DIMS, GDN_TC_MIN_MEAN, \
    KDA_STAGED_TOKENS, CudaTuning, DeltaRuleLaunch, GdnPrepLaunch

KDA_TC_WARPS = 4  # warps of the tensor-core scan block (Gated DeltaNet's default: 64 value columns a block)


def kda_tc_launch(tuning: CudaTuning, *, tokens: int, seqs: int, heads: int, dk: int, dv: int,
                  aligned: bool) -> DeltaRuleLaunch | None:
    """The tensor-core chunked form's scan launch for a step of `tokens` tokens over `seqs` sequences, or None where
    the step takes another form. `aligned`: bf16 q/k/v with 16-byte aligned rows (the caller checks). Never under
    --deterministic (its KDA rows all step token by token, kda_chunked says why); "auto" from GDN_TC_MIN_MEAN tokens
    per sequence; True for any step with more tokens than sequences."""
    fits = max(dk, dv) <= GDN_TC_DIMS[-1] and dk % 8 == 0 and dv % 8 == 0 and dk > 0 and dv > 0
    if not (aligned and fits and tuning.kda_tensor_cores) or tuning.deterministic or tokens <= seqs:
        return None
    if tuning.kda_tensor_cores == "auto" and tokens < GDN_TC_MIN_MEAN * seqs:
        return None
    dim = next(d for d in GDN_TC_DIMS if d >= max(dk, dv))
    return DeltaRuleLaunch(chunked=True, kernel=f"gdn_tc_scan_kernel<{dim}, {KDA_TC_WARPS}, true>",
                           grid=(-(-dv // (16 * KDA_TC_WARPS)), heads, seqs), tensor_cores=True, dim=dim,
                           warps=KDA_TC_WARPS)


def kda_tc_prep_smem_bytes(dim: int) -> int:
    """Dynamic shared memory of kda_tc_prep_kernel<dim> (the layout at the top of kernels/kda_tc.cu kda_tc_prep_kernel): k [C][dim + 8] bf16;
    q, then L / T^T [C][C + 4] fp32, then v in one region; the cumulative gates [C][dim + 4] fp32."""
    c, ld, sld, gld = 64, dim + 8, 64 + 4, dim + 4
    return c * ld * 2 + max(c * ld * 2, c * sld * 4) + c * gld * 4


def kda_tc_prep_launch(dim: int, *, tokens: int, seqs: int, heads: int) -> GdnPrepLaunch:
    """The per-chunk pass: a block of 4 warps per (chunk slot, value head), ceil(tokens / 64) + seqs slots (as
    gdn_tc_prep_launch: every ragged last chunk without a host sync), which also index its exp(gc_last) scratch."""
    return GdnPrepLaunch(f"kda_tc_prep_kernel<{dim}>", (kda_tc_chunk_slots(tokens, seqs), heads, 1), 128,
                         kda_tc_prep_smem_bytes(dim))


def kda_tc_chunk_slots(tokens: int, seqs: int) -> int:
    """Chunk slots of a step (kernels/delta_tc.cu kda_chunk_slot gives each chunk one of them)."""
    return -(-tokens // 64) + seqs


def kda_chunked(tuning: CudaTuning, sm_count: int, *, tokens: int, seqs: int, heads: int, dk: int, dv: int,
                prefill: bool) -> bool:
    """Whether the delta rule with a decay per key channel (Kimi's KDA) takes the fp32 chunked form
    (kernels/delta_rule.cu, PER_CHANNEL) rather than token steps (kda_step_launch). "auto" (gdn_chunked) chooses as
    for one decay per head (_use_chunked, measured there): chunks only where the token-stepped blocks (64 value
    columns each) would fill under half the SMs, since the fp32 chunked kernels lose to token steps from a few
    sequences on; True: any step with more tokens than sequences. Deterministic: never, so that prefill, decode and
    verify rows all take kda_step_launch's kernel, whose arithmetic per token depends on neither the batch nor where
    a step starts (`prefill` is accepted for the contract's sake: one decay per head chunks deterministic
    prefills, as the contract allows, because its token steps would cost more)."""
    if not tokens or dk > GDN_CHUNK_DMAX or dv > GDN_CHUNK_DMAX or tuning.deterministic:
        return False
    if tokens <= seqs or not tuning.gdn_chunked:
        return False
    if tuning.gdn_chunked == "auto":
        return seqs * heads * -(-dv // GDN_DECODE_BLOCKS[0][1]) <= sm_count // 2
    return True


def kda_step_launch(*, heads: int, seqs: int, dk: int, dv: int) -> DeltaRuleLaunch:
    """The token-stepped kernel of a delta rule with a decay per key channel, for decode, verify rows and the
    prefills kda_chunked leaves to token steps alike: kernels/kda.cu kda_steps_kernel (gdn_decode_kernel's layout,
    inputs staged KDA_STAGED_TOKENS tokens at a time) in the decode kernel's default block whatever the batch (one
    instantiation per padded key dim, and a row's arithmetic independent of the batch), or gdn_rows_kernel ("rows")
    where Dv % 4 != 0."""
    if dv % 4:
        return DeltaRuleLaunch(chunked=False, kernel="rows", grid=(-(-dv // 32), heads, seqs))
    dkp = next(p for p in GDN_KEY_DIMS if p >= dk)
    warps, cols = GDN_DECODE_BLOCKS[0]
    return DeltaRuleLaunch(chunked=False, grid=(-(-dv // cols), heads, seqs), threads=32 * warps,
                           kernel=f"kda_steps_kernel<{{t}}, {dkp}, {warps}, {cols // 4}, {KDA_STAGED_TOKENS}>")
