"""Attention prefill on Hopper tensor cores: the launch wrapper and the NVRTC builds of kernels/attention_sm90.cu
(attn_wgmma_kernel) and of the same file with kernels/attention_sm90_ws.cu appended (attn_ws_kernel, built from its
helpers; a module of its own, so the default kernel never depends on the newer one compiling).

wgmma exists only in the arch-specific target sm_90a, and CuPy's RawModule always compiles for the device's plain
architecture (sm_90), so this module drives NVRTC itself (the same common.cu prelude, one `-arch=sm_90a`) and loads
the cubin through `RawModule(path=...)`. Cubins are kept in CuPy's kernel cache folder (CUPY_CACHE_DIR), keyed by
the source, the options and the NVRTC version, so a process pays the compile once per machine like every other
kernel. `CudaOps.paged_attention` calls `prefill` when `kernels.tuning.attention_plan` picks the "wgmma" path.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import atexit
import functools
from pathlib import Path

import cupy
import numpy as np

from prefixrun.kernels import compile_pool, kernel_cache
from prefixrun.kernels.cuda_modules import include_options, kernel_source
from prefixrun.kernels.tuning import WGMMA_HEAD_DIMS as HEAD_DIMS
from prefixrun.kernels.tuning import WGMMA_ROWS_PER_BLOCK as ROWS_PER_BLOCK
from prefixrun.kernels.tuning import wgmma_tile_keys as keys_per_tile
from prefixrun.kernels.tuning import ws_persistent_blocks

SCHEDULES = ("serial", "overlap", "ws", "pingpong")  # kernels/tuning.py WGMMA_SCHEDULES


def threads(schedule: str) -> int:
    """Block size: two warpgroups (attn_wgmma_kernel), or a producer and two consumers (attn_ws_kernel)."""
    return 384 if schedule in ("ws", "pingpong") else 256


KV8_TYPES = ("signed char", "e4m3")  # 8-bit K/V storage types (kernels/common.cu), the serial schedule's


def shared_bytes(head_dim: int, schedule: str, kv: str | None = None) -> int:
    """Dynamic shared memory of one block (both kernels): the Q tile, two K and two V tiles, 1024 bytes of alignment
    slack; over 8-bit caches (`kv` one of KV8_TYPES) the Q tile, one K and one V tile, and the staged 8-bit K and V
    tiles with their fp32 scales (one per 32 values)."""
    bn = keys_per_tile(head_dim, schedule)
    if kv is not None:
        return (ROWS_PER_BLOCK + 2 * bn) * head_dim * 2 + 2 * bn * (head_dim + head_dim // 8) + 1024
    return (ROWS_PER_BLOCK + 4 * bn) * head_dim * 2 + 1024


def kernel_name(head_dim: int, schedule: str, kv: str | None = None) -> str:
    """The kernel of `schedule` at `head_dim` over bf16 caches, or (serial only) over 8-bit ones of type `kv`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"wgmma schedule must be one of {SCHEDULES}, not {schedule!r}")
    if kv is not None and (schedule != "serial" or kv not in KV8_TYPES):
        raise ValueError(f"8-bit caches ({kv}) take the serial schedule's kernel, not {schedule!r}")
    bn = keys_per_tile(head_dim, schedule)
    if schedule in ("ws", "pingpong"):
        return f"attn_ws_kernel<{head_dim}, {bn}, {str(schedule == 'pingpong').lower()}>"
    kv_arg = f", {kv}" if kv is not None else ""
    return f"attn_wgmma_kernel<{head_dim}, {bn}, {str(schedule == 'overlap').lower()}{kv_arg}>"


def _module_of(schedule: str, kv: str | None = None) -> str:
    """"base" (attn_wgmma_kernel over bf16), "q8" (over 8-bit caches: only runs with them build it) or "ws"."""
    return "ws" if schedule in ("ws", "pingpong") else "q8" if kv is not None else "base"


MODULES = ("base", "q8", "ws")


def _unit_of(head_dim: int, schedule: str, kv: str | None = None) -> str:
    """The NVRTC program that builds the kernel: its module's kernels at one head dim (e.g. "ws_128"), so the
    costly warp-specialised builds compile side by side (kernels/compile_pool.py) and a kernel's code is the same
    whichever others share its program."""
    return f"{_module_of(schedule, kv)}_{head_dim}"


_NAMES = {f"{m}_{d}": [kernel_name(d, s) for s in SCHEDULES if _module_of(s) == m] for m in ("base", "ws")
          for d in HEAD_DIMS}
_NAMES.update({f"q8_{d}": [kernel_name(d, "serial", kv) for kv in KV8_TYPES] for d in HEAD_DIMS})
_MODULES = compile_pool.OnceEach()  # (device, unit) -> its kernels by name
_FUNCTIONS: dict[tuple[int, str], object] = {}
_SMEM_SET: set[tuple[int, int]] = set()


def available() -> bool:
    """True on a compute capability 9.0 device (Hopper): the only target sm_90a code runs on."""
    try:
        return cupy.cuda.Device().compute_capability == "90"
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def _cache_dir() -> Path:
    return kernel_cache.cupy_cache_dir()


def unit_source(unit: str) -> str:
    """What NVRTC compiles for `unit` ("base_<d>" and "q8_<d>": attention_sm90.cu; "ws_<d>": with
    attention_sm90_ws.cu appended)."""
    source = kernel_source("attention_sm90")
    if unit.startswith("ws"):
        source += "\n" + (Path(__file__).parent / "attention_sm90_ws.cu").read_text()
    return source


OPTIONS = ("-std=c++17", "-arch=sm_90a", "-ftz=true")  # -ftz as CuPy compiles the rest


def compile_sm90a(source: str, names: list[str]) -> tuple[bytes, dict[str, str]]:
    """NVRTC's cubin of `source` for sm_90a with the instantiations `names`, and each one's lowered name."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "attention_sm90.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, OPTIONS + include_options())
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC could not compile kernels/attention_sm90.cu for sm_90a: {e}\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog), {name: nvrtc.getLoweredName(prog, name) for name in names}
    finally:
        nvrtc.destroyProgram(prog)


def _build(module: str) -> tuple[Path, dict[str, str]]:
    """The cubin file of the unit `module` (unit_source) and the lowered (mangled) name of each of its kernels
    (_NAMES[module]): from the cache folder, else compiled and kept there."""
    from cupy_backends.cuda.libs import nvrtc

    source, names = unit_source(module), _NAMES[module]
    options = OPTIONS + include_options()
    key = hashlib.sha256(json.dumps([source, options, names, nvrtc.getVersion()]).encode()).hexdigest()[:32]
    folder = _cache_dir()
    cubin, lowered_file = folder / f"prefixrun_sm90a_{key}.cubin", folder / f"prefixrun_sm90a_{key}.json"
    if cubin.is_file() and lowered_file.is_file():
        return cubin, json.loads(lowered_file.read_text())
    binary, lowered = compile_sm90a(source, names)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin, binary), (lowered_file, json.dumps(lowered).encode())):
            with tempfile.NamedTemporaryFile(dir=folder, delete=False) as tmp:  # atomic: concurrent processes
                tmp.write(data)
            os.replace(tmp.name, path)
    except OSError as exc:  # a folder that cannot be written: this process's copy only (one warning)
        kernel_cache.warn_unwritable(folder, exc.strerror or type(exc).__name__)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as tmp:
            tmp.write(binary)
        atexit.register(_unlink, tmp.name)
        return Path(tmp.name), lowered
    return cubin, lowered


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _function(head_dim: int, schedule: str, kv: str | None = None):
    dev = cupy.cuda.Device().id
    name = kernel_name(head_dim, schedule, kv)
    fn = _FUNCTIONS.get((dev, name))
    if fn is None:
        fn = _FUNCTIONS[(dev, name)] = load(_unit_of(head_dim, schedule, kv), dev)[name]
    smem = shared_bytes(head_dim, schedule, kv)
    if (id(fn), smem) not in _SMEM_SET:
        fn.max_dynamic_shared_size_bytes = smem
        _SMEM_SET.add((id(fn), smem))
    return fn


def load(unit: str, device: int) -> dict:
    """The kernels of `unit` (a module of MODULES at one head dim, e.g. "ws128") on `device` by name: built (or read
    from the cache folder) and loaded once per process, under that unit's own lock."""
    return _MODULES.get((device, unit), lambda: _load(unit, device))


def _load(unit: str, device: int) -> dict:
    with cupy.cuda.Device(device), compile_pool.compile_slot, \
            kernel_cache.compile_lock([unit_source(unit), *_NAMES[unit], *OPTIONS]):
        cubin, lowered = _build(unit)
        module = cupy.RawModule(path=str(cubin))
        return {n: module.get_function(lowered[n]) for n in _NAMES[unit]}


def units(modules=("ws",)) -> list[str]:
    """The units of `modules` (of MODULES) at every head dim; the default: what `compile_module` builds."""
    return [f"{m}_{d}" for m in modules for d in HEAD_DIMS]


def unit_names(unit: str) -> list[str]:
    return list(_NAMES[unit])


def jobs(device: int, modules=("ws",)) -> list[compile_pool.Job]:
    """Pool jobs (kernels/compile_pool.py) building `modules` (of MODULES) at every head dim on `device`; the
    default: what `compile_module` builds."""
    return [compile_pool.Job(f"attention_sm90.{u}", functools.partial(load, u, device), 60.0) for u in units(modules)]


def compile_module():
    """Build (or load from the cache folder) the kernels the default takes now: "auto" runs the warp-specialised
    kernel at every head dim (kernels/tuning.py); the block-synchronous ones build on first use when chosen."""
    for d in HEAD_DIMS:
        _function(d, "ws")


def prefill(*, q, qst, qsh, k_cache, v_cache, tables, ctx, cu, nseq, tokens, hq, hkv, d, bs, scale_log2, window,
            out, sm_count, schedule="serial", blocks=None, sinks=None, kv=None, k_scale=None, v_scale=None):
    """One launch of the sm_90a prefill kernel: causal attention of `tokens` new queries (q [T, Hq, D] with element
    strides qst, qsh; 16-byte aligned rows) over paged bf16 caches, written to out [T, Hq, D] (bf16, contiguous).
    `sinks` (contiguous fp32 [Hq] on the device, or None): attention sinks, a logit per query head in each row's
    softmax denominator. 8-bit caches: `kv` their type (KV8_TYPES) and k_scale / v_scale their fp32 scales (one per
    32 values, contiguous, 16-byte aligned), on the serial schedule.
    `schedule` (SCHEDULES): "serial" S, softmax, P V per tile; "overlap" a tile's softmax while the previous tile's
    P V runs; "ws" / "pingpong" the warp-specialised kernel (kernels/attention_sm90_ws.cu), persistent: `blocks`
    per KV head (None: kernels/tuning.py ws_persistent_blocks for `sm_count` SMs; the tile count: one tile per
    block)."""
    if d not in HEAD_DIMS:
        raise ValueError(f"the sm_90a attention kernel takes head dims {HEAD_DIMS}, not {d}")
    rep = hq // hkv
    query_tiles = -(-tokens * rep // ROWS_PER_BLOCK) + nseq  # an upper bound: the kernel finds the real ones
    grid = (query_tiles, hkv)
    if schedule in ("ws", "pingpong"):
        if blocks is None:
            blocks = ws_persistent_blocks(query_tiles, hkv, sm_count)
        grid = (max(1, min(int(blocks), query_tiles)), hkv)
    null = np.uint64(0)
    args = (q, np.int64(qst), np.int64(qsh), k_cache, v_cache, tables, np.int32(tables.shape[1]), ctx, cu,
            np.int32(nseq), np.int32(hq), np.int32(hkv), np.int32(bs), np.float32(scale_log2), np.int32(window), out,
            sinks if sinks is not None else null)
    if _module_of(schedule, kv) != "ws":  # attn_wgmma_kernel's scale pointers (unread over bf16 caches)
        args += (k_scale if kv is not None else null, v_scale if kv is not None else null)
    _function(d, schedule, kv)(grid, (threads(schedule),), args, shared_mem=shared_bytes(d, schedule, kv))
