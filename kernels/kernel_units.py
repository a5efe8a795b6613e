"""The CUDA kernels' modules as declarations: the template instantiations each kernels/<file>.cu exports, the text
NVRTC compiles for it, and the compile units a file is split into.

A file with many instantiations compiles as several NVRTC programs ("units"), each the file's whole text with a
share of its instantiations: a fresh machine compiles the units side by side (kernels/compile_pool.py), so no one
file's compile is the whole wait. A kernel's code does not depend on which other instantiations share its program
(each template instantiation is generated on its own; the file's non-template kernels are in every unit), so a
split changes no kernel's bits. No CuPy here: the split is checked on the CPU (tests/test_kernel_units.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from prefixrun.kernels.fp8_launch import FP8W_GEMV_TILES, FP8W_STREAM_KERNELS, FP8W_STREAM_TMA_KERNELS
from prefixrun.kernels.kda_tuning import KDA_TC_WARPS
from prefixrun.kernels.row_launch import NORM_CHUNKS
from prefixrun.kernels.tuning import ATTN_WARPS, GDN_COLS, GDN_DECODE_BLOCKS, GDN_KEY_DIMS, GDN_TC_DIMS, \
    GDN_TC_PREP_KERNELS, GDN_TC_WARPS, KDA_STAGED_TOKENS, MOE_GEMM_ROWS, MOE_GEMM_STAGES, SSD_TC_BLOCKS, \
    SSD_TC_STATES, attn_tile_keys

_KERNEL_DIR = Path(__file__).parent
_T = ("float", "bf16")


def _elementwise_names() -> list[str]:
    names = []
    for ti in _T:
        for to in _T:
            for c in NORM_CHUNKS:
                names += [f"row_norm_kernel<{ti}, {ti}, {to}, 0, {c}>", f"row_norm_kernel<{ti}, {ti}, {to}, 1, {c}>"]
                names += [f"row_norm_kernel<{ti}, {tg}, {to}, 2, {c}>" for tg in _T]
            names += [f"embed_kernel<{ti}, {to}>", f"write_kv_kernel<{ti}, {to}>", f"add_kernel<{ti}, {to}>",
                      f"cast_kernel<{ti}, {to}>"]
        names += [f"silu_mul_kernel<{ti}>", f"gelu_tanh_mul_kernel<{ti}>", f"gelu_mul_kernel<{ti}>",
                  f"clamped_swiglu_kernel<{ti}>",
                  f"sigmoid_kernel<{ti}>", f"scale_kernel<{ti}>", f"rotary_kernel<{ti}>", f"delta_gates_kernel<{ti}>",
                  f"sigmoid_mul_kernel<{ti}>", f"mul_kernel<{ti}>", f"mxfp4_kernel<{ti}>"]
        names += [f"add_rms_norm_kernel<{ti}, {c}>" for c in NORM_CHUNKS]
        names += [f"qk_norm_rotary_kernel<{ti}, {nm}>" for nm in ("true", "false")]
    names += [f"copy_rows{v}_kernel<{u}>" for v in ("", "_few") for u in ("uint4", "unsigned int", "unsigned char")]
    return names


CONV_WIDTHS = range(2, 9)  # the causal convolution's kernel widths K (kernels/conv.cu)
MMA_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 192, 256)  # head dims of attn_mma_kernel (kernels/attention.cu)
KV8_TYPES = ("signed char", "e4m3")  # the 8-bit K/V storage types of kernels/common.cu
# head dims of attn_mma_kernel over 8-bit caches (the common ones: the module compiles in about half the time of all
# eight); other head dims read 8-bit caches through the scalar kernel
KV8_MMA_HEAD_DIMS = (64, 128, 256)
_SOURCE_OF = {"attention_q8": "attention"}  # modules compiled from another module's file
_TENSOR_CORE_FILES = ("delta_tc", "ssd_tc", "kda_tc")  # files compiled after kernels/tc_mma.cu (mma.sync helpers)
# files compiled after others whose device functions and kernels they use
_BUILT_ON = {"kda_tc": ("delta_tc",), "fp8_stream": ("fp8",), "fp8_stream_tma": ("fp8", "fp8_stream")}


KERNEL_NAMES = {
    "elementwise": _elementwise_names(),
    "conv": [f"conv_{k}_kernel<{t}, {ts}, {kk}>" for k in ("fwd", "state", "seq") for t in _T for ts in _T
             for kk in CONV_WIDTHS],
    "delta_rule": [f"gdn_cols_kernel<{t}, {d}, {GDN_COLS}>" for t in _T for d in GDN_KEY_DIMS]
    + [f"gdn_decode_kernel<{t}, {d}, {w}, {c // 4}>" for t in _T for d in GDN_KEY_DIMS for w, c in GDN_DECODE_BLOCKS]

    + [f"gdn_chunk_{p}_kernel<{t}, {pc}>" for p in ("prep", "scan") for t in _T for pc in ("false", "true")],
    "kda": [f"kda_steps_kernel<{t}, {d}, {w}, {c // 4}, {KDA_STAGED_TOKENS}>" for t in _T for d in GDN_KEY_DIMS
            for w, c in GDN_DECODE_BLOCKS[:1]],
    "delta_tc": [k.format(d=d) for k in GDN_TC_PREP_KERNELS.values() for d in GDN_TC_DIMS]
    + [f"gdn_tc_scan_kernel<{d}, {w}>" for d in GDN_TC_DIMS for w in GDN_TC_WARPS],
    # Kimi's KDA on tensor cores: its prep pass and delta_tc's scan in its per-channel form (kernels/kda_tuning.py)
    "kda_tc": [f"kda_tc_prep_kernel<{d}>" for d in GDN_TC_DIMS]
    + [f"gdn_tc_scan_kernel<{d}, {KDA_TC_WARPS}, true>" for d in GDN_TC_DIMS],
    "attention": [f"attn_mma_kernel<{d}, {bn}, {nw}>" for d in MMA_HEAD_DIMS for bn in attn_tile_keys(d)
                  for nw in ATTN_WARPS]
    + [f"attn_scalar_kernel<{t}, {tc}>" for t in _T for tc in _T] + ["attn_combine_kernel"],
    # 8-bit K/V (--kv-cache-dtype fp8 / int8): kernels/attention.cu's instantiations for 8-bit caches, a module of
    # their own so that runs without them never compile them
    "attention_q8": [f"attn_mma_kernel<{d}, {bn}, {nw}, {kv}>" for d in KV8_MMA_HEAD_DIMS
                     for bn in attn_tile_keys(d) for nw in ATTN_WARPS for kv in KV8_TYPES]
    + [f"attn_scalar_kernel<{t}, {kv}>" for t in _T for kv in KV8_TYPES]
    + [f"write_kv_q8_kernel<{t}, {kv}>" for t in _T for kv in KV8_TYPES] + ["attn_combine_kernel"],
    "sampling": ["sample_kernel", "feed_tokens_kernel", "token_bitmask_kernel"],
    "logits": ["process_logits_kernel", "token_logprobs_kernel"],
    "spec_rows": [f"conv_snapshot_kernel<{t}, {ts}>" for t in _T for ts in _T]
    + [f"gdn_rows_kernel<{t}, {pc}>" for t in _T for pc in ("false", "true")],
    "fp8": [f"fp8_dequant_kernel<{t}>" for t in _T]
    + [f"fp8_quant_groups_kernel<{t}, {v}>" for t in _T for v in ("false", "true")]
    + ["fp8w_gemm_kernel", "fp8w_finish_kernel"] + [f"fp8w_gemv_kernel<{nt}>" for nt in FP8W_GEMV_TILES],
    # the streamed weight-only GEMM (decode rows): kernels/fp8.cu's helpers in front of it
    "fp8_stream": list(FP8W_STREAM_KERNELS),
    "fp8_stream_tma": list(FP8W_STREAM_TMA_KERNELS),  # its form with the weight's bytes in bulk copies
    "mamba": [f"ssd_{k}_kernel<{t}>" for k in ("scan", "decode", "chunk_state", "chunk_out") for t in _T]
    + ["ssd_chunk_carry_kernel"] + [f"relu2_kernel<{t}>" for t in _T]
    + [f"gated_group_norm_kernel<{t}, {tg}>" for t in _T for tg in _T],
    "ssd_tc": [f"ssd_tc_kernel<{n}, {b}>" for n in SSD_TC_STATES for b in SSD_TC_BLOCKS],
    "moe": ["moe_route_kernel", "moe_route_sigmoid_kernel", "moe_count_kernel", "moe_offsets_kernel", "moe_scatter_kernel",
            "moe_permute_small_kernel"]
    # EPI: none, SwiGLU, ReLU^2 (moe_grouped_linear's activations)
    + [f"moe_gemm_mma_kernel<bf16, {n}, {epi}, {bm}>" for n in MOE_GEMM_STAGES for epi in (0, 1, 2)
       for bm in MOE_GEMM_ROWS]
    + [f"moe_gemm_simt_kernel<{t}>" for t in _T]
    + [f"moe_combine_kernel<{t}, {s}>" for t in _T for s in (0, 1, 2)]
    + [f"moe_bias_kernel<{t}>" for t in _T],
}


@functools.lru_cache(maxsize=None)
def kernel_source(file: str) -> str:
    """The text NVRTC compiles for the module `file`: common.cu, tc_mma.cu for the tensor-core files, the files it
    is built on, then kernels/<file>.cu (or the file it shares)."""
    source = _SOURCE_OF.get(file, file)
    parts = ["common"] + (["tc_mma"] if source in _TENSOR_CORE_FILES else []) + [*_BUILT_ON.get(source, ()), source]
    return "\n".join((_KERNEL_DIR / f"{part}.cu").read_text() for part in parts)


# What `CudaOps.prepare_kernels` loads ahead (kernels/cuda_warmup.py), in the order a first prefill step needs them.
# Not the multi-row (speculative) or MoE files: a decode step's capture waits for the loader thread, and where
# CuPy compiles them (the very first run; every process with CuPy < 14.2, whose cache skipped modules with
# name_expressions) that would hold up every run's decode for a file most runs never use.
# A module's first use in a fresh process costs its load from CuPy's disk cache and a lazy load of each function:
# host time in the first steps, while the GPU idles.
PREPARED_FILES = ("elementwise", "conv", "delta_rule", "delta_tc", "attention", "sampling")


# How many units each file compiles as (absent: one). The tensor-core and attention files hold the costliest
# instantiations (an mma kernel's unrolled tiles); the element-wise ones are many but small.
UNITS_PER_FILE = {"elementwise": 4, "conv": 2, "delta_rule": 4, "kda": 2, "delta_tc": 5, "kda_tc": 2, "attention": 8,
                  "attention_q8": 6, "fp8": 2, "fp8_stream": 8, "fp8_stream_tma": 8, "mamba": 2, "ssd_tc": 4,
                  "moe": 6}


@dataclass(frozen=True)
class ModuleUnit:
    """One NVRTC program: kernels/<file>.cu's text with `names`, the instantiations it exports (unit `index` of the
    file's units); `key` names it in the module table and the compile reports."""
    file: str
    index: int
    names: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.file if self.index == 0 else f"{self.file}.{self.index}"


def _split(file: str) -> tuple[ModuleUnit, ...]:
    """The file's instantiations dealt round-robin over its units (neighbours in KERNEL_NAMES differ in one
    template argument, e.g. the head dim, so each unit gets a like mix of cheap and costly ones)."""
    names = KERNEL_NAMES[file]
    count = max(1, min(UNITS_PER_FILE.get(file, 1), len(names)))
    return tuple(ModuleUnit(file, i, tuple(names[i::count])) for i in range(count))


UNITS: dict[str, tuple[ModuleUnit, ...]] = {file: _split(file) for file in KERNEL_NAMES}
_UNIT_OF = {(unit.file, name): unit for units in UNITS.values() for unit in units for name in unit.names}


def unit_of(file: str, name: str) -> ModuleUnit:
    """The unit that exports `name` of `file` (a name no unit lists, e.g. an extern "C" kernel: the first unit,
    which holds every non-template kernel of the file, as each unit does)."""
    return _UNIT_OF.get((file, name)) or UNITS[file][0]


def units_of(files) -> list[ModuleUnit]:
    return [unit for file in files for unit in UNITS[file]]
