"""How the CUDA backend picks its kernels: one frozen tuning value, and the choices as pure functions of shapes.

No CuPy here, so the choices can be tested on a CPU (tests/test_kernel_tuning.py pins them for the shapes the
benchmarks run). `CudaOps` holds one `CudaTuning`, fixed at construction; tests and benches that compare
variants build another ops object with `CudaOps.retuned(...)` instead of flipping knobs on a shared one.

Each default is the variant that was fastest on the benchmarks' shapes (4b-like heads); the measurements, with
their dates, hardware and commands, are in docs/PERFORMANCE.md, "Kernel choices". Why each choice:
- delta rule, token-stepped: 4 value columns per thread (the other widths measured slower).
- delta rule, decode (kernels/delta_rule.cu gdn_decode_kernel: the state read and written once, in float4 rows) for
  steps of at most GDN_DECODE_MAX_MEAN tokens per sequence with Dv % 4 == 0, blocks of 8 warps x 64 value columns:
  a decode step is bound by the state's bytes, and this block moves them near the copy ceiling at every batch.
  Longer steps were not measured, so the token-stepped kernel keeps them.
- delta rule, chunked (64-token chunk steps, Dk, Dv <= 128) only when the token-stepped grid fills under half the
  SMs (a long shared prefix alone): the fp32 chunked kernels are bound by shared memory and lose from about four
  sequences on.
- delta rule, tensor cores (kernels/delta_tc.cu: bf16 mma, 64-token chunks, key/value dims <= 128 and 16-byte
  aligned rows): the bf16 prefill form whenever sequences average at least GDN_TC_MIN_MEAN tokens, scan blocks of
  4 warps (64 value columns; they beat 2 even where 2 give twice the blocks), the per-chunk prep pass
  gdn_tc_prep_v2_kernel held to 6 blocks per SM ("v2-6": 35 KB of shared memory against v1's 89 KB). The threshold
  is derived from the measured costs, not measured at: the token-stepped kernel costs ~11 us per token step at 64
  sequences, the tensor-core form ~0.3 ms per 64-token chunk round whether the chunk is full or not, so at 64
  sequences they break even near 26 tokens each; 32 leaves a margin.
- attention warps per block (16 query rows each): 8 above 128 head dims, else 4; decode 4 warps.
- decode split over key ranges (split-K) only when one block per (sequence, KV head) would leave SMs idle: unsplit,
  a decode batch of 64 already streams K/V near the copy ceiling.
- cascade: a decode step with shared-prefix groups reads each group's shared K/V once.
- attention prefill on Hopper (sm_90) with head dims 64/128/256: the wgmma kernels (kernels/attention_sm90.cu and
  attention_sm90_ws.cu) when the step averages at least 64 query rows (tokens x GQA ratio) per sequence; steps of a
  few rows per sequence (speculative verification, decode-like chunks) and other GPUs keep attn_mma_kernel, whose
  16-row warps waste less of a tile. "auto" is "wgmma-pingpong" at every head dim: a producer warpgroup gathers
  K/V into mbarrier-guarded stages and two consumer warpgroups take turns on the tensor cores, in persistent
  blocks (a wave over the device, each block taking query tiles in turn) with the mask decided per tile. It does
  the serial "wgmma" schedule's arithmetic in the same order on the same tiles, so its outputs are "wgmma"'s bit
  for bit, except where O holds subnormals (the rescale it skips for a row whose max held does not flush them).
  "wgmma-ws" (no turn-taking) is as fast within noise; "wgmma-overlap" loses everywhere and stays selectable only
  for measuring it.
- Mamba2 scan (ssd_form): bf16 steps averaging SSD_TC_MIN_MEAN tokens per sequence in the chunked form on tensor
  cores (kernels/ssd_tc.cu: 64-token chunks, a block per 64 state rows, head and sequence walking its chunks with
  the state in registers), in place of the fp32 chunks (two token-by-token passes per chunk, the chunk states through
  global memory): 7-47x the token-stepped kernel's speed at granite and nemotron prefill shapes (docs/PERFORMANCE.md;
  the fp32 chunks were not timed beside it). Decode steps in
  ssd_decode_kernel (a warp per 4 state rows, 16-byte loads): ssd_scan_kernel's warp per row moved a batch-64
  decode step's state at ~1.3 TB/s, its many short blocks waiting on memory.
- MoE grouped GEMM (moe_gemm_stages): decode steps (few rows per expert) keep 3 K steps of weights in flight: the
  double buffer streamed granite's experts at ~1.8 TB/s in a decode step (the 6-layer profile's GEMM time).
  With 16-row tiles (moe_gemm_rows; a quarter of the A tile, more blocks and weight bytes in flight per SM) and 4
  steps in flight, granite's decode-step experts take 84 + 44 us (gate_up + SwiGLU, down; ~2.3 TB/s) against 109 + 50
  us in 64-row tiles and 3 steps (docs/PERFORMANCE.md).
- row norms and row-wise elementwise ops: their launch geometry is kernels/row_launch.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.kernels.fp8_launch import FP8W_GEMV_TILES, FP8W_STREAM_TILES, FP8W_STREAM_UNIT_ROWS, FP8W_STREAM_WARPS

GDN_KEY_DIMS = (16, 32, 64, 128)  # token-stepped kernels are instantiated for these padded key dims
GDN_COLS = 4  # value columns per thread of gdn_cols_kernel (the only instantiation: see kernels/delta_rule.cu)
GDN_CHUNK_DMAX = 128  # the chunked kernels' largest key/value head dim (GDN_DMAX in kernels/delta_rule.cu)
# gdn_tc_* instantiations (each costs seconds of NVRTC time on first use): key and value dims are padded to one of
# GDN_TC_DIMS; the scan block has GDN_TC_WARPS warps of 16 value columns each
GDN_TC_DIMS = (128,)
GDN_TC_WARPS = (2, 4)
# gdn_tc_prep variants (kernels/delta_tc.cu): "v1" gdn_tc_prep_kernel (89 KB of shared memory a block, 2 blocks per
# SM), "v2" gdn_tc_prep_v2_kernel (35 KB: L and T share one fp32 array, T's bf16 operands built in registers)
# compiled for 5 blocks per SM (96 registers, no spills), "v2-6" the same code held to 80 registers for 6 (a 4-byte
# spill, by ptxas 13.0): which occupancy pays is for the device to say
GDN_TC_PREPS = ("v1", "v2", "v2-6")
GDN_TC_PREP_KERNELS = {"v1": "gdn_tc_prep_kernel<{d}>", "v2": "gdn_tc_prep_v2_kernel<{d}, 5>",
                       "v2-6": "gdn_tc_prep_v2_kernel<{d}, 6>"}
GDN_TC_MIN_MEAN = 32  # tokens per sequence (mean) from which "auto" takes the tensor-core form
# gdn_decode_kernel instantiations, (warps, value columns) per block; the first is the default (the module docstring)
GDN_DECODE_BLOCKS = ((8, 64), (8, 128))
# tokens whose inputs kernels/kda.cu stages at a time: it steps prefills too, where the token chain would otherwise
# wait on global memory every token (8: no register spills at key dim 128 within two blocks per SM; 16 spilled)
KDA_STAGED_TOKENS = 8
GDN_DECODE_MAX_MEAN = 8  # tokens per sequence (mean) up to which "auto" takes gdn_decode_kernel (measured to 8)
ATTN_WARPS = (1, 4, 8)  # attn_mma_kernel instantiations: warps per block
SSD_TC_STATES = (64, 128)  # ssd_tc_kernel<NP, MINB> instantiations (kernels/ssd_tc.cu): N padded to one NP
SSD_TC_BLOCKS = (2, 3)  # ... and MINB, the blocks per SM its registers are held to
SSD_TC_MIN_MEAN = 16  # tokens per sequence (mean) from which "auto" scans Mamba2 on tensor cores
SSD_CHUNK = 128  # kernels/mamba.cu SSD_CHUNK: the fp32 chunked scan's chunk
MOE_GEMM_STAGES = (2, 3, 4)  # moe_gemm_mma_kernel<bf16, STAGES, EPI> instantiations (kernels/moe.cu): cp.async buffers
MOE_DECODE_STAGES = 4  # ... the one moe_gemm_stages "auto" gives decode-like steps (with 16-row tiles)
MOE_GEMM_ROWS = (64, 16)  # moe_gemm_mma_kernel's BM instantiations: rows per tile (16: decode's few rows an expert)
SSD_DECODE_MAX_MEAN = 4  # tokens per sequence (mean) up to which ssd_decode "auto" takes ssd_decode_kernel


def attn_tile_keys(head_dim: int) -> tuple[int, ...]:
    """Keys per K/V tile that attn_mma_kernel is instantiated with for `head_dim` (shared memory bounds 256)."""
    return (32, 64) if head_dim > 128 else (64,)


def attn_mma_smem_bytes(head_dim: int, keys: int, warps: int, kv8: bool) -> int:
    """Dynamic shared memory of one attn_mma_kernel block: the Q tile (16 rows a warp) and a K tile of bf16 rows
    head_dim + 8 wide, then a V tile of them, or (8-bit caches) the staged 8-bit K and V tiles with their fp32
    scales (one per 32 values)."""
    row = (head_dim + 8) * 2
    if kv8:
        return (16 * warps + keys) * row + 2 * keys * (head_dim + head_dim // 8)
    return (16 * warps + 2 * keys) * row
ATTN_MAX_SPLITS = 32
# --deterministic's decode and verify attention: keys in fixed ranges of this many from position 0, a partial
# result each (a multiple of every attention tile width; a new value changes those rows' bits: bump the
# deterministic tag of kernels/numerics.py with it)
DETERMINISTIC_SEGMENT_KEYS = 512
ATTN_PREFILL_KERNELS = ("auto", "mma", "wgmma", "wgmma-overlap", "wgmma-ws", "wgmma-pingpong")
# attn_prefill_kernel -> the schedule of kernels/attention_sm90.cu (+ attention_sm90_ws.cu) that runs it: "serial"
# and "overlap" (attn_wgmma_kernel, 8 warps in step), "ws" and "pingpong" (attn_ws_kernel: a producer warpgroup of
# cp.async gathers and two consumer warpgroups, with or without turns on the tensor cores)
WGMMA_SCHEDULES = {"wgmma": "serial", "wgmma-overlap": "overlap", "wgmma-ws": "ws", "wgmma-pingpong": "pingpong"}
WGMMA_HEAD_DIMS = (64, 128, 256)  # attn_wgmma_kernel instantiations: whole 128-byte swizzle atoms per row
WGMMA_MIN_ROWS_PER_SEQ = 64
WGMMA_ROWS_PER_BLOCK = 128  # BM of attn_wgmma_kernel: two warpgroups of 64 query rows


def wgmma_keys_per_tile(head_dim: int) -> int:
    """BN of attn_wgmma_kernel for `head_dim`: 64 keys at 256 dims (O alone takes 128 registers per thread), else
    128 (fewer barriers and Q reads per key)."""
    return 64 if head_dim > 128 else 128


def ws_keys_per_tile(head_dim: int) -> int:
    """BN of attn_ws_kernel: 80 keys at 256 dims, the most for which its two K and two V stages fit beside the Q tile
    ((128 + 4 x 80) x 512 bytes + 1 KB of 227 KB; one m64n80 wgmma per 16 dims reads the Q slice once per 80 keys,
    and a tile's fixed costs, barriers and the O rescale, are spread over 80 keys: faster than 64 keys, see
    docs/PERFORMANCE.md, "Kernel choices"); else the block-synchronous kernel's BN."""
    return 80 if head_dim > 128 else wgmma_keys_per_tile(head_dim)


def wgmma_tile_keys(head_dim: int, schedule: str) -> int:
    """BN, the keys of one K/V tile, of the sm_90a kernel that runs `schedule` (WGMMA_SCHEDULES' values)."""
    return ws_keys_per_tile(head_dim) if schedule in ("ws", "pingpong") else wgmma_keys_per_tile(head_dim)


def ws_persistent_blocks(query_tiles: int, kv_heads: int, sm_count: int) -> int:
    """Blocks per KV head of the warp-specialised kernel: at most one wave over the device (a block per SM: its
    shared memory), each block taking query tiles x, x + blocks, ... of its head; never more blocks than tiles.
    Rounded down: a block past the wave would start only when another ends, and then run its share alone (16 KV
    heads on 132 SMs: 8 blocks each, not 9)."""
    return max(1, min(query_tiles, sm_count // kv_heads))


@dataclass(frozen=True)
class CudaTuning:
    """Kernel variants of the CUDA backend. "auto" lets the shapes decide (see the module docstring)."""

    gdn_chunked: bool | str = "auto"  # prefill in 64-token chunks: True, False or "auto"
    # bf16 prefill in the tensor-core chunked form: True, False or "auto" (checked against the reference on the
    # device by tests/test_cuda_kernels.py; "delta_tc" is in kernels/cuda_modules.py's PREPARED_FILES so its module
    # loads while the weights upload)
    gdn_tensor_cores: bool | str = "auto"
    gdn_tc_warps: int | None = None  # warps per tensor-core scan block; None: 4 (the faster on every measured shape)
    # the tensor-core form's per-chunk pass (GDN_TC_PREPS); "v2-6" the fastest (docs/PERFORMANCE.md, "Kernel
    # choices"). v2 and v2-6 equal v1 to 6e-6 (W, U0) and bit for bit (Aqk, gc): the same outputs up to fp32
    # summation order in the solve.
    gdn_tc_prep: str = "v2-6"
    # Kimi's KDA (a decay per key channel) prefill in the tensor-core chunked form (kernels/kda_tc.cu): True, False or
    # "auto" (kernels/kda_tuning.py kda_tc_launch; checked against the reference on the device by
    # tests/test_cuda_kimi.py, docs/PERFORMANCE.md has its figures)
    kda_tensor_cores: bool | str = "auto"
    # token-stepped steps of a few tokens per sequence (decode) in gdn_decode_kernel: True, False or "auto"
    gdn_decode: bool | str = "auto"
    gdn_decode_block: tuple[int, int] | None = None  # (warps, value columns) per gdn_decode_kernel block
    # Mamba2's bf16 scan in the chunked form on tensor cores (kernels/ssd_tc.cu): True, False or "auto" (see ssd_form)
    ssd_tensor_cores: bool | str = "auto"
    ssd_tc_blocks: int = 2  # SSD_TC_BLOCKS: blocks per SM of ssd_tc_kernel (2 never spills; 3 spills a few bytes)
    # decode steps in ssd_decode_kernel (16-byte state rows, B and C read once per 4 rows): True, False or "auto"
    # (steps of at most SSD_DECODE_MAX_MEAN tokens per sequence)
    ssd_decode: bool | str = "auto"
    # cp.async buffers of the MoE grouped GEMM (MOE_GEMM_STAGES; the same bits at each), or "auto": MOE_DECODE_STAGES
    # for steps whose experts average at most one 64-row tile (decode: bound by the weight bytes in flight), else 2
    moe_gemm_stages: int | str = "auto"
    # rows per tile of the MoE grouped GEMM (MOE_GEMM_ROWS; the same bits at each), or "auto": 16 for steps whose
    # experts average at most 16 rows, else 64
    moe_gemm_rows: int | str = "auto"
    attn_prefill_warps: int | None = None  # None: 8 above 128 head dims, else 4
    attn_decode_warps: int | None = 4
    attn_keys_per_tile: tuple[tuple[int, int], ...] = ()  # (head_dim, keys per K/V tile) overrides; default 64
    attn_split_decode: bool | str = "auto"
    attn_cascade: bool = True
    # --deterministic's decode steps: read the fixed key ranges wholly inside a shared prefix once per group (the
    # same bits either way), in blocks of attn_det_group_warps warps (16 rows each; no bit moves): at batch 64 over
    # 2,048 shared keys 128 us a layer where every row reading its own ranges took 203 us (docs/PERFORMANCE.md);
    # 4 warps fill more blocks than 8 where groups are small
    attn_det_cascade: bool = True
    attn_det_group_warps: int | None = 4
    # the prefill kernel on sm_90 (see the module docstring); a new default changes prefill numerics: bump
    # kernels/numerics.py NUMERICS_VERSION with it
    attn_prefill_kernel: str = "auto"
    # --speculative auto drafts on this backend. Its choices follow acceptance counts only (never timing), so bf16
    # greedy tokens, where a verify step rounds differently from a plain step, are the same from run to run; its
    # plain steps keep the decode pipeline (bench/device_spec.sh measures them against off).
    speculative_auto: bool = True
    # --deterministic: every kernel choice a function of what one row computes, never of the batch: GEMMs with one
    # cuBLASLt algorithm per weight shape (kernels/cublaslt.py), attention with keys tiled from position 0 (prefill
    # rows in one pass, of the sm_90a kernel where it runs at all; decode and verify rows in attn_mma_kernel over
    # fixed key ranges from position 0 merged in order), the delta
    # rule chunked on every prefill row and token by token in one kernel (gdn_decode_kernel, snapshots and all) on
    # every decode and verify row
    deterministic: bool = False
    # deterministic GEMMs: buckets of row counts may take another cuBLASLt algorithm than the reference one where
    # it gives the same bits (kernels/cublaslt.py PinnedGemm); False: the reference algorithm for every M
    gemm_pairing: bool = True
    # FP8 projections (kernels/cuda_fp8.py) of at most this many rows run a weight-only kernel (bf16 rows times the
    # fp8 weights, fp32 sums: half the weight bytes of bf16, no activation quantisation) instead of cuBLASLt's
    # block-scaled FP8 GEMM on quantised rows; 0: cuBLASLt for every row count. 8: on the 4b-like shapes the gemv
    # kernel is the faster up to 8 rows, cuBLASLt from 16 (docs/PERFORMANCE.md, "FP8 decode")
    fp8_weight_only_rows: int = 8
    # ... of which at most this many rows (<= 64) take fp8w_gemv_kernel (the weight bytes read straight into the
    # tensor cores' operand), more fp8w_gemm_kernel (64 x 64 tiles dequantised in shared memory)
    fp8_gemv_rows: int = 64
    # ... above those, up to this many rows (<= 128) fp8w_stream_kernel (kernels/fp8_stream.cu; its variants below;
    # 0: never), as bench/kbench_fp8_stream.py measures it (docs/PERFORMANCE.md, "FP8 decode")
    fp8_stream_rows: int = 0
    fp8_stream_unit_rows: int = 128
    fp8_stream_warps: int = 8
    fp8_stream_tma: bool = False

    def __post_init__(self):
        if self.attn_prefill_kernel not in ATTN_PREFILL_KERNELS:
            raise ValueError(f"attn_prefill_kernel must be one of {ATTN_PREFILL_KERNELS}")
        if self.gdn_tc_warps not in (None,) + GDN_TC_WARPS:
            raise ValueError(f"gdn_tc_warps must be None or one of {GDN_TC_WARPS}")
        if self.gdn_tc_prep not in GDN_TC_PREPS:
            raise ValueError(f"gdn_tc_prep must be one of {GDN_TC_PREPS}")
        if self.moe_gemm_stages not in MOE_GEMM_STAGES + ("auto",):
            raise ValueError(f"moe_gemm_stages must be one of {MOE_GEMM_STAGES} or 'auto'")
        if self.moe_gemm_rows not in MOE_GEMM_ROWS + ("auto",):
            raise ValueError(f"moe_gemm_rows must be one of {MOE_GEMM_ROWS} or 'auto'")
        if self.ssd_tc_blocks not in SSD_TC_BLOCKS:
            raise ValueError(f"ssd_tc_blocks must be one of {SSD_TC_BLOCKS}")
        if self.gdn_decode_block not in (None,) + GDN_DECODE_BLOCKS:
            raise ValueError(f"gdn_decode_block must be None or one of {GDN_DECODE_BLOCKS}")
        for name in ("gdn_chunked", "gdn_tensor_cores", "gdn_decode", "attn_split_decode", "ssd_tensor_cores",
                     "ssd_decode", "kda_tensor_cores"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be True, False or 'auto'")
        if not isinstance(self.fp8_weight_only_rows, int) or self.fp8_weight_only_rows < 0:
            raise ValueError("fp8_weight_only_rows must be a non-negative int")
        if not isinstance(self.fp8_gemv_rows, int) or not 0 <= self.fp8_gemv_rows <= 8 * FP8W_GEMV_TILES[-1]:
            raise ValueError(f"fp8_gemv_rows must be an int from 0 to {8 * FP8W_GEMV_TILES[-1]}")
        if not isinstance(self.fp8_stream_rows, int) or not 0 <= self.fp8_stream_rows <= 8 * FP8W_STREAM_TILES[-1]:
            raise ValueError(f"fp8_stream_rows must be an int from 0 to {8 * FP8W_STREAM_TILES[-1]}")
        if self.fp8_stream_unit_rows not in FP8W_STREAM_UNIT_ROWS:
            raise ValueError(f"fp8_stream_unit_rows must be one of {FP8W_STREAM_UNIT_ROWS}")
        if self.fp8_stream_warps not in FP8W_STREAM_WARPS or self.fp8_stream_tma not in (True, False):
            raise ValueError(f"fp8_stream_warps must be one of {FP8W_STREAM_WARPS}, fp8_stream_tma a bool")
        for name in ("attn_prefill_warps", "attn_decode_warps", "attn_det_group_warps"):
            if getattr(self, name) not in (None,) + ATTN_WARPS:
                raise ValueError(f"{name} must be None or one of {ATTN_WARPS}")
        for d, bn in self.attn_keys_per_tile:
            if bn not in attn_tile_keys(d):
                raise ValueError(f"no attention tile of {bn} keys for head dim {d}")

    def keys_per_tile(self, head_dim: int) -> int:
        return dict(self.attn_keys_per_tile).get(head_dim, 64)


@dataclass(frozen=True)
class DeltaRuleLaunch:
    """How gated_delta_rule runs: the chunked form (two kernels, launched by their own wrapper), or one
    token-stepped kernel (`kernel` with its template arguments but the storage type left as {t}) on `grid`.
    `tensor_cores` (with chunked): the bf16 tensor-core chunked form, `kernel` its scan kernel on `grid` (the
    wrapper runs the prep pass of gdn_tc_prep_launch first), `dim` the padded key/value dim, `warps` the scan block's.
    `threads`: the token-stepped kernel's block size."""

    chunked: bool
    kernel: str = ""
    grid: tuple[int, int, int] = (0, 0, 0)
    tensor_cores: bool = False
    dim: int = 0
    warps: int = 0
    threads: int = 128


def delta_rule_launch(tuning: CudaTuning, sm_count: int, *, tokens: int, seqs: int, heads: int, dk: int,
                      dv: int, tensor_cores: bool = False, prefill: bool = False) -> DeltaRuleLaunch:
    """The delta-rule kernel for a step of `tokens` new tokens over `seqs` sequences, `heads` value heads.
    `tensor_cores`: bf16 q/k/v with 16-byte aligned rows (dims and strides multiples of 8; the caller checks).
    `prefill`: the step is a prefill step (only a deterministic tuning asks)."""
    if tuning.deterministic:
        return _deterministic_delta_rule(tuning, tokens=tokens, seqs=seqs, heads=heads, dk=dk, dv=dv,
                                         tensor_cores=tensor_cores, prefill=prefill)
    if tensor_cores and _use_tensor_cores(tuning, tokens, seqs, dk, dv):
        dim = next(d for d in GDN_TC_DIMS if d >= max(dk, dv))
        warps = tuning.gdn_tc_warps or 4
        return DeltaRuleLaunch(chunked=True, kernel=f"gdn_tc_scan_kernel<{dim}, {warps}>",
                               grid=(-(-dv // (16 * warps)), heads, seqs), tensor_cores=True, dim=dim,
                               warps=warps)
    if _use_chunked(tuning, sm_count, tokens, seqs, heads, dk, dv):
        return DeltaRuleLaunch(chunked=True)
    dkp = next(p for p in GDN_KEY_DIMS if p >= dk)
    if _use_decode(tuning, tokens, seqs, dv):
        warps, cols = tuning.gdn_decode_block or GDN_DECODE_BLOCKS[0]
        return DeltaRuleLaunch(chunked=False, kernel=f"gdn_decode_kernel<{{t}}, {dkp}, {warps}, {cols // 4}>",
                               grid=(-(-dv // cols), heads, seqs), threads=32 * warps)
    rows_per_thread = min(64 // GDN_COLS, dkp)
    cols = 128 // (dkp // rows_per_thread) * GDN_COLS  # value columns per 128-thread block
    return DeltaRuleLaunch(chunked=False, kernel=f"gdn_cols_kernel<{{t}}, {dkp}, {GDN_COLS}>",
                           grid=(-(-dv // cols), heads, seqs))


def _deterministic_delta_rule(tuning: CudaTuning, *, tokens: int, seqs: int, heads: int, dk: int, dv: int,
                              tensor_cores: bool, prefill: bool) -> DeltaRuleLaunch:
    """The deterministic choice: a prefill step in the chunked form for every sequence, however few tokens it has
    (the tensor-core form where the inputs allow it, else the fp32 one), so a token's output depends only on its
    chunk, which the engine anchors at multiples of 64 positions; every other step (decode, verify: with the
    snapshots the verify step needs) token by token in gdn_decode_kernel of one block shape, whose per-token
    arithmetic is the same at any row count, or where Dv % 4 != 0 in gdn_rows_kernel (`kernel` "rows")."""
    if prefill and tokens and max(dk, dv) <= GDN_TC_DIMS[-1] and tensor_cores and tuning.gdn_tensor_cores \
            and dk % 8 == 0 and dv % 8 == 0:
        dim = next(d for d in GDN_TC_DIMS if d >= max(dk, dv))
        warps = tuning.gdn_tc_warps or 4
        return DeltaRuleLaunch(chunked=True, kernel=f"gdn_tc_scan_kernel<{dim}, {warps}>",
                               grid=(-(-dv // (16 * warps)), heads, seqs), tensor_cores=True, dim=dim, warps=warps)
    if prefill and dk <= GDN_CHUNK_DMAX and dv <= GDN_CHUNK_DMAX:
        return DeltaRuleLaunch(chunked=True)
    if dv % 4 == 0:  # the decode kernel's float4 rows; its block fixed, whatever the batch
        dkp = next(p for p in GDN_KEY_DIMS if p >= dk)
        warps, cols = tuning.gdn_decode_block or GDN_DECODE_BLOCKS[0]
        return DeltaRuleLaunch(chunked=False, kernel=f"gdn_decode_kernel<{{t}}, {dkp}, {warps}, {cols // 4}>",
                               grid=(-(-dv // cols), heads, seqs), threads=32 * warps)
    return DeltaRuleLaunch(chunked=False, kernel="rows", grid=(-(-dv // 32), heads, seqs))


def gdn_tc_smem_bytes(dim: int, warps: int = 0) -> int:
    """Dynamic shared memory of gdn_tc_prep_kernel<dim> (warps == 0) or gdn_tc_scan_kernel<dim, warps>, bytes
    (the layouts at the top of each kernel in kernels/delta_tc.cu; C = 64 tokens, rows padded by 8 bf16)."""
    c, ld, ald = 64, dim + 8, 64 + 8
    if warps == 0:  # k, q/v [C][ld] bf16; L, T [C][C + 1] fp32; Aw, Au [C][ald] bf16
        return 2 * c * ld * 2 + 2 * c * (c + 1) * 4 + 2 * c * ald * 2
    uld = 16 * warps + 8  # W, k, q [C][ld]; Aqk [C][ald]; U0, O [C][uld]
    return (3 * c * ld + c * ald + 2 * c * uld) * 2


def gdn_tc_prep_smem_bytes(dim: int, variant: str) -> int:
    """Dynamic shared memory of the prep kernel `variant` (GDN_TC_PREPS) for padded dim `dim`, bytes (the layout at
    the top of each kernel in kernels/delta_tc.cu)."""
    if variant == "v1":
        return gdn_tc_smem_bytes(dim)
    c, ld, sld = 64, dim + 8, 64 + 4  # k [C][ld] bf16; then q / v [C][ld] bf16 or L and T^T [C][sld] fp32, in turn
    return c * ld * 2 + max(c * ld * 2, c * sld * 4)


@dataclass(frozen=True)
class GdnPrepLaunch:
    """The tensor-core form's per-chunk pass: `kernel` on `grid` (x: chunk slots, y: value heads) of `threads`
    threads and `smem` bytes of dynamic shared memory."""

    kernel: str
    grid: tuple[int, int, int]
    threads: int
    smem: int


def gdn_tc_prep_launch(tuning: CudaTuning, dim: int, *, tokens: int, seqs: int, heads: int) -> GdnPrepLaunch:
    """The prep pass over `tokens` tokens of `seqs` sequences: a block per (64-token chunk, value head). The grid
    has ceil(tokens / 64) + seqs chunk slots, enough for every sequence's ragged last chunk without a host sync
    (the blocks past the last chunk return at once)."""
    kernel = GDN_TC_PREP_KERNELS[tuning.gdn_tc_prep].format(d=dim)
    smem = gdn_tc_prep_smem_bytes(dim, tuning.gdn_tc_prep)
    return GdnPrepLaunch(kernel, (-(-tokens // 64) + seqs, heads, 1), 128, smem)


def _use_tensor_cores(tuning: CudaTuning, tokens: int, seqs: int, dk: int, dv: int) -> bool:
    if tokens <= seqs or max(dk, dv) > GDN_TC_DIMS[-1] or dk % 8 or dv % 8 or not tuning.gdn_tensor_cores:
        return False
    return tuning.gdn_tensor_cores is True or tokens >= GDN_TC_MIN_MEAN * seqs


def _use_decode(tuning: CudaTuning, tokens: int, seqs: int, dv: int) -> bool:
    if dv % 4 or not tuning.gdn_decode:  # the decode kernel moves the state in float4 rows
        return False
    return tuning.gdn_decode is True or tokens <= GDN_DECODE_MAX_MEAN * seqs


def _use_chunked(tuning: CudaTuning, sm_count: int, tokens: int, seqs: int, heads: int, dk: int, dv: int) -> bool:
    if tokens <= seqs or dk > GDN_CHUNK_DMAX or dv > GDN_CHUNK_DMAX or not tuning.gdn_chunked:
        return False
    if tuning.gdn_chunked == "auto":  # token-stepped blocks (64 value columns each) fill under half the SMs
        return seqs * heads * -(-dv // 64) <= sm_count // 2
    return True


def ssd_form(tuning: CudaTuning, *, tokens: int, seqs: int, head_dim: int, state_size: int,
             tensor_cores: bool) -> str:
    """How ssd_scan runs a step of `tokens` new tokens over `seqs` sequences. "tensor_cores": kernels/ssd_tc.cu
    (`tensor_cores`: bf16 inputs with 16-byte aligned rows, the caller checks; head dims a multiple of 16, states up
    to 128 columns in whole 16-byte pieces) once sequences average SSD_TC_MIN_MEAN tokens (an estimate: a chunk's
    block does the work of its 64 tokens in a few matrix products, where kernels/mamba.cu steps token by token).
    "chunked": kernels/mamba.cu's fp32 chunks, for long prefills the tensor cores cannot take. "decode":
    ssd_decode_kernel (tuning.ssd_decode; states up to 128 columns, a multiple of 4). "stepped": token by token
    (ssd_scan_kernel: decode steps, and every step of a deterministic tuning: one kernel whatever the batch)."""
    if tuning.deterministic or seqs == 0:
        return "stepped"
    fits = tensor_cores and head_dim % 16 == 0 and state_size % 8 == 0 and state_size <= max(SSD_TC_STATES)
    if fits and (tuning.ssd_tensor_cores is True
                 or (tuning.ssd_tensor_cores == "auto" and tokens >= SSD_TC_MIN_MEAN * seqs)):
        return "tensor_cores"
    if tokens >= 2 * SSD_CHUNK * seqs:
        return "chunked"
    decode = tuning.ssd_decode is True or (tuning.ssd_decode == "auto" and tokens <= SSD_DECODE_MAX_MEAN * seqs)
    return "decode" if decode and state_size <= 128 and state_size % 4 == 0 else "stepped"


def moe_gemm_stages(tuning: CudaTuning, *, rows: int, experts: int) -> int:
    """The cp.async depth of moe_gemm_mma_kernel for `rows` expert-sorted rows over `experts` experts."""
    if tuning.moe_gemm_stages != "auto":
        return tuning.moe_gemm_stages
    return MOE_DECODE_STAGES if rows <= 64 * experts else 2


def moe_gemm_rows(tuning: CudaTuning, *, rows: int, experts: int) -> int:
    """moe_gemm_mma_kernel's rows per tile (BM) for `rows` expert-sorted rows over `experts` experts."""
    if tuning.moe_gemm_rows != "auto":
        return tuning.moe_gemm_rows
    return 16 if rows <= 16 * experts else 64


def ssd_tc_launch(state_size: int) -> tuple[int, int]:
    """(NP, dynamic shared bytes) of the ssd_tc_kernel that runs state size N (columns past N stay zero; the
    layout at the top of kernels/ssd_tc.cu: x, M, staged outputs [64][72] and B, C [64][NP + 8], bf16)."""
    cols = min(n for n in SSD_TC_STATES if n >= state_size)
    return cols, (3 * 64 * 72 + 2 * 64 * (cols + 8)) * 2


@dataclass(frozen=True)
class AttentionPlan:
    """How paged_attention runs a step.

    path: "scalar" (the fp32 / unaligned path), "wgmma" (prefill on sm_90 tensor cores, kernels/attention_sm90.cu),
    "plain" (one mma.sync tensor-core pass), "split" (decode split over key
    ranges, one warp per split, then a merge) or "cascade" (a pass per shared-prefix group over its shared keys with
    `warps`, a pass per sequence over its own keys with `own_warps`, then a merge). `splits` key ranges, `keys` per
    K/V tile; `schedule`: the wgmma kernel's schedule (WGMMA_SCHEDULES). --deterministic's decode and verify rows:
    "segments" (`splits` fixed key ranges of `segment_tiles` tiles from position 0, a partial each, merged in their
    order) or "segments-cascade" (the same partials, those of ranges wholly inside a decode step's shared prefix
    computed once per group with `warps`, the rest per sequence with `own_warps`)."""

    path: str
    warps: int = 0
    keys: int = 0
    splits: int = 1
    own_warps: int = 0
    schedule: str = ""
    segment_tiles: int = 0


def attention_plan(tuning: CudaTuning, sm_count: int, *, tokens: int, seqs: int, q_heads: int, kv_heads: int,
                   head_dim: int, table_width: int, block_size: int, window: int, tensor_cores: bool,
                   shared: bool, wgmma: bool = False, prefill: bool = False, kv8: bool = False) -> AttentionPlan:
    """The attention path for `tokens` queries of `seqs` sequences over tables `table_width` blocks wide.
    Split counts derive from the table width, not the contexts, so a captured decode graph stays valid.
    `tensor_cores`: bf16 inputs with a supported head dim and 16-byte aligned rows (the caller checks);
    `wgmma`: the device runs sm_90a code; `prefill`: a prefill step (only a deterministic tuning asks); `kv8`: the
    caches are 8-bit (the sm_90a prefill takes them on its serial schedule alone)."""
    if not tensor_cores:
        return AttentionPlan("scalar")
    d = head_dim
    if tuning.deterministic:  # a function of the step's kind and of each row alone (CudaTuning.deterministic)
        return _deterministic_attention(tuning, tokens=tokens, seqs=seqs, d=d, table_keys=table_width * block_size,
                                        window=window, shared=shared, prefill=prefill, wgmma=wgmma, kv8=kv8)
    decode = tokens == seqs
    choice = tuning.attn_prefill_kernel
    if choice == "auto":
        choice = "wgmma-pingpong"  # measured at every head dim it takes: the module docstring
    if (choice != "mma" and wgmma and not decode and d in WGMMA_HEAD_DIMS
            and tokens * (q_heads // kv_heads) >= WGMMA_MIN_ROWS_PER_SEQ * seqs):
        schedule = "serial" if kv8 else WGMMA_SCHEDULES[choice]
        return AttentionPlan("wgmma", warps=12 if schedule in ("ws", "pingpong") else 8,
                             keys=wgmma_tile_keys(d, schedule), schedule=schedule)
    wide = 8 if d > 128 else 4
    table_keys = table_width * block_size
    if shared and decode and window == 0 and tuning.attn_cascade:
        # shared keys: a group's rows are many (members x query heads), so prefill-sized tiles, and split over
        # key ranges so a long prefix spreads over the GPU
        bn = tuning.keys_per_tile(d)
        splits = min(ATTN_MAX_SPLITS, max(1, -(-table_keys // bn) // 4))
        return AttentionPlan("cascade", warps=tuning.attn_prefill_warps or wide, keys=bn, splits=splits,
                             own_warps=tuning.attn_decode_warps or 4)
    split = tuning.attn_split_decode
    if split == "auto":
        split = seqs * kv_heads < sm_count
    bn = 32 if d > 128 else 64
    splits = min(ATTN_MAX_SPLITS, max(1, -(-table_keys // bn) // 8))
    if split and decode and q_heads // kv_heads <= 16 and splits > 1:
        return AttentionPlan("split", warps=1, keys=bn, splits=splits)
    warps = (tuning.attn_prefill_warps if tokens > seqs else tuning.attn_decode_warps) or wide
    return AttentionPlan("plain", warps=warps, keys=tuning.keys_per_tile(d))


def _deterministic_attention(tuning: CudaTuning, *, tokens: int, seqs: int, d: int, table_keys: int, window: int,
                             shared: bool, prefill: bool, wgmma: bool, kv8: bool) -> AttentionPlan:
    """Prefill rows without a window: on sm_90a (WGMMA_HEAD_DIMS) the sm_90a kernel at any rows per sequence (keys
    tiled from position 0, each row's arithmetic its own; by default the rows per sequence choose it), elsewhere
    (and windowed layers: rings align rows to its tile) one attn_mma_kernel pass. Decode and verify rows without a
    window: partials over DETERMINISTIC_SEGMENT_KEYS-key ranges fixed from position 0, merged in range order;
    with attn_det_cascade, on a decode step with shared prefixes, the ranges wholly inside a group's prefix read
    once for the group: the same arithmetic per row, so the same bits whatever the group."""
    wide = 8 if d > 128 else 4
    keys = tuning.keys_per_tile(d)
    warps = (tuning.attn_prefill_warps if tokens > seqs else tuning.attn_decode_warps) or wide
    choice = "wgmma-pingpong" if tuning.attn_prefill_kernel == "auto" else tuning.attn_prefill_kernel
    if prefill and window == 0 and wgmma and d in WGMMA_HEAD_DIMS and choice != "mma":
        schedule = "serial" if kv8 else WGMMA_SCHEDULES[choice]
        return AttentionPlan("wgmma", warps=12 if schedule in ("ws", "pingpong") else 8,
                             keys=wgmma_tile_keys(d, schedule), schedule=schedule)
    if prefill or window > 0:
        return AttentionPlan("plain", warps=warps, keys=keys)
    ranges = max(1, -(-table_keys // DETERMINISTIC_SEGMENT_KEYS))
    tiles = DETERMINISTIC_SEGMENT_KEYS // keys
    if shared and tokens == seqs and tuning.attn_det_cascade:
        group_warps = tuning.attn_det_group_warps or tuning.attn_prefill_warps or wide
        return AttentionPlan("segments-cascade", warps=group_warps, keys=keys, splits=ranges,
                             own_warps=tuning.attn_decode_warps or 4, segment_tiles=tiles)
    return AttentionPlan("segments", warps=warps, keys=keys, splits=ranges, segment_tiles=tiles)
