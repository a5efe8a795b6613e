"""CUDA backend: the same ops as kernels/reference.py (`NumpyOps`) on CuPy arrays.

Storage is bf16 (`ml_dtypes.bfloat16`, CUDA's `__nv_bfloat16`) or fp32; every kernel accumulates in fp32.
Custom kernels live in kernels/*.cu and are compiled once per process and device by NVRTC (CuPy RawModule, the
device's own architecture, C++17); GEMMs go through cuBLAS via the ctypes binding in kernels/cublas.py, so a whole
decode step can be captured into a CUDA graph (`CudaOps.capture`).

No op synchronises with the host except host->device copies (`upload_index`, `sample`'s packed parameters,
`copy_rows` given more than 8 host pairs — up to 8 travel as kernel arguments). Varlen kernels take device
cu_seqlens and size their grids from host-known shapes (T tokens, B sequences), each block finding its
sequence on the device, so no per-layer device->host read of lengths is needed.

Wrappers accept strided views where the engine makes them (column slices of a fused projection, heads split out of
a row): the last dimension must be contiguous, anything else is copied to a contiguous array first.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import threading
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels import attention_sm90
from prefixrun.kernels.cublas import get_cublas
from prefixrun.kernels.host_memory import start_device_to_host
from prefixrun.kernels.step_io import StepCopies
from prefixrun.kernels.upload import upload_ahead, upload_bytes, upload_bytes_many
from prefixrun.kernels.reference import _storage_dtype
from prefixrun.kernels.sampling import pack_sampling_params
from prefixrun.kernels.tuning import ATTN_WARPS, GDN_COLS, GDN_DECODE_BLOCKS, GDN_KEY_DIMS, GDN_TC_DIMS, \
    GDN_TC_PREP_KERNELS, GDN_TC_WARPS, NORM_CHUNKS, CudaTuning, attention_plan, attn_tile_keys, delta_rule_launch, \
    elementwise_launch, elementwise_vector, gdn_tc_prep_launch, gdn_tc_smem_bytes, norm_launch

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
_TYPE_NAMES = {F32: "float", BF16: "bf16"}
_THREADS = 256
_SAMPLE_THREADS = 1024  # SAMPLE_THREADS in kernels/sampling.cu
_LOG2E = 1.4426950408889634

# ---- kernel sources and the template instantiations each file exports --------------------------------------------
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
                  f"sigmoid_kernel<{ti}>", f"rotary_kernel<{ti}>", f"delta_gates_kernel<{ti}>",
                  f"sigmoid_mul_kernel<{ti}>"]
        names += [f"add_rms_norm_kernel<{ti}, {c}>" for c in NORM_CHUNKS]
        names += [f"qk_norm_rotary_kernel<{ti}, {nm}>" for nm in ("true", "false")]
    names += [f"copy_rows{v}_kernel<{u}>" for v in ("", "_few") for u in ("uint4", "unsigned int", "unsigned char")]
    return names


_CONV_K = range(2, 9)
# chunked delta rule: sizes fixed in kernels/delta_rule.cu (GDN_C, GDN_DMAX, GDN_CB and the shared-memory layouts)
_GDN_CHUNK, _GDN_SCAN_COLS = 64, 32
_GDN_PREP_SMEM = (2 * 128 * (64 + 4) + 64 * (64 + 1)) * 4
_GDN_SCAN_SMEM = (128 * 32 + 64 * (128 + 4) + 64 * 32 + 64 * (64 + 1)) * 4
_MMA_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 192, 256)



_NAMES = {
    "elementwise": _elementwise_names(),
    "conv": [f"conv_{k}_kernel<{t}, {ts}, {kk}>" for k in ("fwd", "state") for t in _T for ts in _T for kk in _CONV_K],
    "delta_rule": [f"gdn_cols_kernel<{t}, {d}, {GDN_COLS}>" for t in _T for d in GDN_KEY_DIMS]
    + [f"gdn_decode_kernel<{t}, {d}, {w}, {c // 4}>" for t in _T for d in GDN_KEY_DIMS for w, c in GDN_DECODE_BLOCKS]
    + [f"gdn_chunk_{p}_kernel<{t}>" for p in ("prep", "scan") for t in _T],
    "delta_tc": [k.format(d=d) for k in GDN_TC_PREP_KERNELS.values() for d in GDN_TC_DIMS]
    + [f"gdn_tc_scan_kernel<{d}, {w}>" for d in GDN_TC_DIMS for w in GDN_TC_WARPS],
    "attention": [f"attn_mma_kernel<{d}, {bn}, {nw}>" for d in _MMA_HEAD_DIMS for bn in attn_tile_keys(d) for nw in ATTN_WARPS]
    + [f"attn_scalar_kernel<{t}, {tc}>" for t in _T for tc in _T] + ["attn_combine_kernel"],
    "sampling": ["sample_kernel", "feed_tokens_kernel"],
    "spec_rows": [f"conv_snapshot_kernel<{t}, {ts}>" for t in _T for ts in _T]
    + [f"gdn_rows_kernel<{t}>" for t in _T],
    "moe": ["moe_route_kernel", "moe_count_kernel", "moe_offsets_kernel", "moe_scatter_kernel",
            "moe_gemm_mma_kernel<bf16>"] + [f"moe_gemm_simt_kernel<{t}>" for t in _T]
    + [f"moe_combine_kernel<{t}, {s}>" for t in _T for s in ("true", "false")],
}

_MODULES: dict[tuple[int, str], cupy.RawModule] = {}
_FUNCTIONS: dict[tuple[int, str, str], object] = {}
_COMPILE_LOCK = threading.Lock()


def _include_options() -> tuple[str, ...]:
    """-I for a CUDA include directory holding cuda_bf16.h (CuPy's CUDA path, the nvidia wheels, the toolkit)."""
    import os

    candidates = []
    try:
        p = cupy.cuda.get_cuda_path()
        if p:
            candidates.append(Path(p) / "include")
    except Exception:
        pass
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            candidates += [Path(root) / s / "include" for s in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_bf16.h").is_file():
            return (f"-I{c}",)
    return ()


def kernel_source(file: str) -> str:
    """The text NVRTC compiles for kernels/<file>.cu: common.cu, then the file."""
    return (_KERNEL_DIR / "common.cu").read_text() + "\n" + (_KERNEL_DIR / f"{file}.cu").read_text()


def _kernel(file: str, name: str):
    """The compiled kernel `name` of kernels/<file>.cu on the current device (compiled once per process)."""
    dev = cupy.cuda.Device().id
    key = (dev, file, name)
    fn = _FUNCTIONS.get(key)
    if fn is not None:
        return fn
    with _COMPILE_LOCK:
        mod = _MODULES.get((dev, file))
        if mod is None:
            mod = cupy.RawModule(code=kernel_source(file), options=("-std=c++17",) + _include_options(),
                                 name_expressions=_NAMES[file])
            _MODULES[(dev, file)] = mod
        fn = _FUNCTIONS[key] = mod.get_function(name)
    return fn


def compile_all():
    """Compile every kernel file now (otherwise each compiles on first use)."""
    for file, names in _NAMES.items():
        _kernel(file, names[0])


# What `CudaOps.prepare_kernels` loads ahead (kernels/cuda_warmup.py), in the order a first prefill step needs them.
# Not the multi-row (speculative) or MoE files: a decode step's capture waits for the loader thread, and where
# CuPy compiles them (the very first run; every process with CuPy < 14.2, whose cache skipped modules with
# name_expressions) that would hold up every run's decode for a file most runs never use.
# A module's first use in a fresh process costs its load from CuPy's disk cache and a lazy load of each function:
# host time in the first steps, while the GPU idles.
PREPARED_FILES = ("elementwise", "conv", "delta_rule", "delta_tc", "attention", "sampling")
_PREPARERS: list[threading.Thread] = []  # every prepare_kernels thread started (a capture waits for them)


def _grid(n: int, threads: int = _THREADS) -> int:
    return max(1, min(-(-n // threads), 1 << 16))


def _vectors_ok(d: int, itemsize: int, *arrays) -> bool:
    """Whether rows of d elements move as the kernels' 16-byte vectors of the input type (elementwise_vector): d a
    multiple of the vector, and every (array, itemsize, row strides in elements...) at a base and strides aligned
    to its unit (a vector's elements of its type, at most 16 bytes). Otherwise the kernels go element by element
    (the same arithmetic in the same order)."""
    v = elementwise_vector(itemsize)
    if d % v:
        return False
    for a, item, *strides in arrays:
        unit = min(16, v * item)
        if a.data.ptr % unit or any((st * item) % unit for st in strides):
            return False
    return True


def _norm_blocks(launch, rows: int) -> int:
    return max(1, min(-(-rows // launch.rows_per_block), 1 << 16))


def _i32(v) -> np.int32:
    return np.int32(v)


def _i64(v) -> np.int64:
    return np.int64(v)


# ---- array views -------------------------------------------------------------------------------------------------
def _last_contiguous(x):
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        return cupy.ascontiguousarray(x)
    return x


def _rows(x):
    """x [..., D] as rows of D contiguous elements: (x, rows, D, n1, s0, s1); row r starts at
    (r // n1) * s0 + (r % n1) * s1 elements (leading dims collapsed to at most two)."""
    x = _last_contiguous(x)
    item = x.itemsize
    merged: list[list[int]] = []
    for size, stride in zip(x.shape[:-1], x.strides[:-1]):
        if size == 1:
            continue
        stride //= item
        if merged and merged[-1][1] == size * stride:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        x = cupy.ascontiguousarray(x)
        return _rows(x)
    d = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if not merged:
        return x, rows, d, 1, d, 0
    if len(merged) == 1:
        return x, rows, d, 1, merged[0][1], 0
    return x, rows, d, merged[1][0], merged[0][1], merged[1][1]


def _heads(x):
    """x [T, H, D] with a contiguous last dim: (x, token stride, head stride) in elements."""
    if x.ndim != 3:
        raise ValueError(f"expected [tokens, heads, dim], got shape {x.shape}")
    x = _last_contiguous(x)
    return x, x.strides[0] // x.itemsize, x.strides[1] // x.itemsize


def _rows2(x):
    """x [T, N] with contiguous rows: (x, row stride in elements)."""
    if x.ndim != 2:
        raise ValueError(f"expected a 2-d array, got shape {x.shape}")
    x = _last_contiguous(x)
    return x, (x.strides[0] // x.itemsize if x.shape[0] > 1 else x.shape[1])


def _index(a):
    """Device int32 contiguous index array (uploads host lists/arrays)."""
    if isinstance(a, cupy.ndarray):
        return cupy.ascontiguousarray(a if a.dtype == np.int32 else a.astype(np.int32))
    return cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))


def _cast(x, dtype, copy=False):
    """Device dtype conversion (fp32 <-> bf16 by our kernel, round to nearest even); a copy if `copy`."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x.copy() if copy else x
    if x.dtype in _TYPE_NAMES and dtype in _TYPE_NAMES:
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, dtype)
        n = x.size
        if n:
            _kernel("elementwise", f"cast_kernel<{_tname(x.dtype)}, {_tname(dtype)}>")(
                (_grid(n),), (_THREADS,), (x, _i64(n), out))
        return out
    return x.astype(dtype)


def _f32(a):
    a = a if isinstance(a, cupy.ndarray) else cupy.asarray(np.asarray(a, np.float32))
    return cupy.ascontiguousarray(_cast(a, F32))


def _tname(dtype) -> str:
    try:
        return _TYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"CUDA kernels take float32 or bfloat16 arrays, not {np.dtype(dtype)}") from None


def _moe():
    """kernels/moe_cuda.py (imported on first use: it builds on this module)."""
    from prefixrun.kernels import moe_cuda

    return moe_cuda


class CudaGraph:
    """A captured sequence of launches; `replay()` reruns it on the current stream and returns the outputs the
    captured function returned (the same arrays every time: replay overwrites them).

    Replays alternate between two executable instances of the one captured graph: a launch of an instance whose
    previous launch is still running holds the host until that launch ends (seen on the H200: ~0.8 ms of device
    idle in every pipelined decode step, the host inside cudaGraphLaunch), so back-to-back steps take turns. Both
    instances have the same nodes and buffers and run in stream order, so results are the same. The second is
    made from the captured cudaGraph_t with the first (no new capture; instantiating it at its first replay left
    the device idle for ~5 ms); where CuPy keeps no cudaGraph_t, replays stay on the one instance."""

    def __init__(self, graph, outputs, pool):
        self.graph = graph
        self.outputs = outputs
        self._pool = pool  # the graph's private memory: alive (and never handed out again) as long as the graph
        self._second = self._instantiate_again()  # the other cudaGraphExec_t (int), 0 when none can be made
        self._turn = 0

    def replay(self):
        stream = cupy.cuda.get_current_stream()
        if self._turn and self._second:
            cupy.cuda.runtime.graphLaunch(self._second, stream.ptr)
        else:
            self.graph.launch(stream)
        self._turn ^= 1
        return self.outputs

    def _instantiate_again(self) -> int:
        captured = getattr(self.graph, "graph", 0)
        if not captured:
            return 0
        try:
            return cupy.cuda.runtime.graphInstantiate(captured)
        except Exception:  # an older CuPy without the runtime call: one instance
            return 0

    def __del__(self):
        if getattr(self, "_second", 0):
            try:
                cupy.cuda.runtime.graphExecDestroy(self._second)
            except Exception:
                pass

    __call__ = replay


class CudaOps:
    """The CUDA backend. Activations in `act_dtype` (bf16 or fp32), recurrent states and gates in fp32."""

    display_name = "cuda"
    device_kind = "cuda"  # where arrays live, as torch names devices (for handing work to other libraries)
    can_capture_graphs = True
    # 64-row blocks: fewer table entries per sequence and whole MMA key tiles (measured faster than 16 on an H200)
    default_block_size = 64

    def __init__(self, dtype: str = "bfloat16", tuning: CudaTuning | None = None):
        if dtype == "bfloat16":
            self.act_dtype = ml_dtypes.bfloat16
        elif dtype == "float32":
            self.act_dtype = np.float32
        else:
            raise ValueError(f"the CUDA backend computes in bfloat16 or float32, not {dtype!r}")
        self.dtype_name = dtype
        self._act = np.dtype(self.act_dtype)
        self._blas = get_cublas()
        self._copy_tables: dict[tuple, tuple] = {}
        self._smem_set: set = set()
        # which kernel runs for which shapes: kernels/tuning.py (fixed for this object's life; see `retuned`)
        self.tuning = tuning or CudaTuning()
        self.auto_speculation = self.tuning.speculative_auto  # the Ops query (kernels/ops.py)
        self._sm_count = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._device_id = cupy.cuda.Device().id  # for calls from other threads (upload_ahead)
        self._preparing: threading.Thread | None = None  # prepare_kernels' loader
        self._wgmma = attention_sm90.available()  # sm_90a kernels (attention prefill) run here
        self._copies = None  # a decode step's small copies through pinned buffers (kernels/step_io.py)

    def retuned(self, **changes) -> "CudaOps":
        """This backend with other kernel variants (tests and benches comparing them): a new ops object sharing
        the cuBLAS handle and caches, its tuning `dataclasses.replace(self.tuning, **changes)`."""
        other = copy.copy(self)
        other.tuning = dataclasses.replace(self.tuning, **changes)
        other.auto_speculation = other.tuning.speculative_auto
        return other

    # ---- queries ------------------------------------------------------------------------------------------------
    def free_memory(self) -> int | None:
        """Bytes the device can still hand out: free device memory plus what CuPy's pool holds unused."""
        free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def storage_dtype(self, kind: str) -> np.dtype:
        """The array dtype of a state region declared `kind` ("float32", or "act" for the storage dtype)."""
        return _storage_dtype(kind, self.act_dtype)

    def release_cached_memory(self):
        """Give CuPy's cached, unused device blocks back to the driver (before another library allocates)."""
        cupy.get_default_memory_pool().free_all_blocks()

    def prepare_kernels(self, plan=None):
        """Load every kernel module's functions and warm cuBLAS up for the plan's GEMMs (kernels/cuda_warmup.py) on a
        background thread while the caller uploads the weights. `plan`: None, or a function returning the model's
        kernels/warmup.py KernelPlan, called on that thread. `_kernel`'s lock makes a step that needs a module still
        loading wait for it, never load it twice; a stream capture waits for the thread (`_PREPARERS`)."""
        if self._preparing is None:
            from prefixrun.kernels import cuda_warmup

            self._preparing = threading.Thread(target=cuda_warmup.prepare, daemon=True, name="prefixrun-kernels",
                                               args=(cupy.cuda.Device().id, self._act, plan, PREPARED_FILES))
            self._preparing.start()
            _PREPARERS[:] = [t for t in _PREPARERS if t.is_alive()] + [self._preparing]

    # ---- memory -------------------------------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        return cupy.zeros(shape, dtype=dtype or self.act_dtype)

    def upload(self, host_array, dtype=None):
        """Host array -> device array (a copy, converted to `dtype` or the activation dtype). fp32 and bf16 move
        as stored, through pinned staging when large (kernels/upload.py), and convert on the device."""
        dt = np.dtype(dtype or self.act_dtype)
        if isinstance(host_array, cupy.ndarray):
            return self._cast(host_array, dt, copy=True)
        return self.upload_rows([host_array], dtype)

    def upload_rows(self, host_parts, dtype=None):
        """Host arrays [n_i, ...] -> one device array [sum n_i, ...], their concatenation along axis 0, each part
        copied straight into its rows (no host-side concatenation or conversion copy of fp32/bf16 parts)."""
        dt = np.dtype(dtype or self.act_dtype)
        parts = [np.asarray(p) for p in host_parts]
        if not parts or any(p.ndim == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
            if len(parts) == 1 and parts[0].ndim == 0:  # a scalar: nothing to stage
                return cupy.asarray(np.asarray(parts[0], dt))
            raise ValueError(f"upload_rows: parts {[p.shape for p in parts]} do not stack along axis 0")
        src = parts[0].dtype
        if src not in _TYPE_NAMES or any(p.dtype != src for p in parts):
            src = dt  # other dtypes (or a mix) convert on the host, as NumPy converts them
        out = cupy.empty((sum(p.shape[0] for p in parts),) + parts[0].shape[1:], src)
        row = 0
        for p in parts:
            upload_bytes(out[row:row + p.shape[0]], np.ascontiguousarray(p, dtype=src))
            row += p.shape[0]
        return out if src == dt else _cast(out, dt)

    def upload_index(self, host_array):
        return _index(host_array)

    def write_index(self, dst, host_array):
        """Overwrite an existing device index buffer in place with host data: one copy on the current stream,
        through a pinned buffer (kernels/step_io.py), so the host does not wait for the queued work."""
        self._step_copies().write(dst, np.ascontiguousarray(host_array, dtype=np.int32).reshape(dst.shape))

    def to_host_later(self, array):
        """The copy down queued now, after the work queued so far; the function waits for it alone."""
        return self._step_copies().fetch_later(array)

    def _step_copies(self):
        if self._copies is None:
            self._copies = StepCopies()
        return self._copies

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, cupy.ndarray):
            if array.dtype == BF16:
                return cupy.asnumpy(cupy.ascontiguousarray(array).view(np.uint16)).view(BF16)
            return cupy.asnumpy(array)
        return np.asarray(array)

    def upload_into(self, pairs):
        """All pairs in one staged transfer (kernels/upload.py): packed into the pinned staging buffers, one DMA per
        destination piece, no device temporary and no kernel."""
        checked = []
        for dst, source in pairs:
            source = source if isinstance(source, cupy.ndarray) else np.asarray(source)  # device: upload_ahead's
            if tuple(dst.shape) != tuple(source.shape) or dst.dtype.itemsize != source.dtype.itemsize \
                    or not dst.flags.c_contiguous or not source.flags.c_contiguous:
                raise ValueError(f"upload_into: {source.dtype} {source.shape} into device {dst.dtype} "
                                 f"{tuple(dst.shape)} (C-contiguous: {dst.flags.c_contiguous})")
            checked.append((dst, source))
        upload_bytes_many(checked)

    def upload_ahead(self, arrays):
        """Through the pinned staging buffers into one device buffer of the uploader's stream (kernels/upload.py),
        on the calling thread; None where the device has no room."""
        with cupy.cuda.Device(self._device_id):  # the calling thread's current device may be another
            return upload_ahead(arrays)

    def start_host_copy(self, arrays):
        """Device copies into one snapshot now; its device -> host copy when the function is called
        (kernels/host_memory.py)."""
        return start_device_to_host(arrays)

    def synchronize(self):
        cupy.cuda.get_current_stream().synchronize()

    def _cast(self, x, dtype, copy=False):
        return _cast(x, dtype, copy)

    # ---- dense math ---------------------------------------------------------------------------------------------
    def embed(self, table, ids):
        """table [V, D], ids [T] -> [T, D]"""
        table = cupy.ascontiguousarray(table)
        ids = _index(ids)
        t, d = ids.shape[0], table.shape[1]
        out = cupy.empty((t, d), self._act)
        if t:
            _kernel("elementwise", f"embed_kernel<{_tname(table.dtype)}, {_tname(self._act)}>")(
                (_grid(t * d),), (_THREADS,), (table, ids, _i64(t), _i32(d), out))
        return out

    def _gemm(self, x, weight, out_dtype):
        k = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k) if x.ndim != 2 else x
        if x2.dtype != weight.dtype:
            x2 = self._cast(x2, weight.dtype)
        item = x2.itemsize
        if x2.shape[0] > 1 and (x2.strides[1] != item or x2.strides[0] < k * item or x2.strides[0] % item):
            x2 = cupy.ascontiguousarray(x2)
        elif x2.shape[0] <= 1 and k > 1 and x2.strides[1] != item:
            x2 = cupy.ascontiguousarray(x2)
        weight = cupy.ascontiguousarray(weight)
        out = cupy.empty((x2.shape[0], weight.shape[0]), out_dtype)
        self._blas.gemm_nt(x2, weight, out, pedantic=weight.dtype == F32)
        return out.reshape(lead + (weight.shape[0],))

    def linear(self, x, weight):
        """x [T, in] @ weight[out, in].T -> [T, out] (cuBLAS, fp32 accumulate)"""
        return self._gemm(x, weight, self._act)

    def logits(self, x, lm_head):
        """x [N, D] @ lm_head[V, D].T -> fp32 [N, V]"""
        return self._gemm(x, lm_head, F32)

    def _row_norm(self, mode: int, x, weight, eps, gate=None, out_dtype=None):
        x, rows, d, n1, s0, s1 = _rows(x)
        out_dtype = np.dtype(out_dtype or self._act)
        out = cupy.empty(x.shape, out_dtype)
        if rows == 0 or d == 0:
            return out
        w = _f32(weight) if weight is not None else cupy.empty(1, F32)
        ti = _tname(x.dtype)
        if gate is not None:
            gate, grows, gd, gn1, gs0, gs1 = _rows(gate)
            if grows != rows or gd != d:
                raise ValueError(f"gate shape {gate.shape} does not match x {x.shape}")
            tg = _tname(gate.dtype)
        else:
            gate, gn1, gs0, gs1, tg = x, n1, s0, s1, ti
        launch = norm_launch(d, x.itemsize)
        vec = _vectors_ok(d, x.itemsize, (x, x.itemsize, s0, s1), (gate, gate.itemsize, gs0, gs1), (w, 4))
        name = f"row_norm_kernel<{ti}, {tg}, {_tname(out_dtype)}, {mode}, {launch.chunks}>"
        _kernel("elementwise", name)((_norm_blocks(launch, rows),), (launch.threads,), (
            x, _i64(rows), _i32(d), _i64(n1), _i64(s0), _i64(s1), gate, _i64(gn1), _i64(gs0), _i64(gs1), w,
            np.float32(eps), out, _i32(launch.lanes), _i32(vec)))
        return out

    def rms_norm(self, x, weight, eps):
        """x [..., D] * rsqrt(mean(x^2) + eps) * weight [D]"""
        return self._row_norm(0, x, weight, eps)

    def gated_rms_norm(self, x, gate, weight, eps):
        """RMSNorm(x [..., D]) * weight [D] * silu(gate [..., D])"""
        return self._row_norm(2, x, weight, eps, gate=gate)

    def add_rms_norm(self, x, h, weight, eps):
        """(s = x + h, RMSNorm(s) * weight) for x, h [..., D] in one launch (kernels/elementwise.cu); the same
        numbers as `add` then `rms_norm`. Both outputs in the storage dtype."""
        if x.shape != h.shape:
            raise ValueError(f"add_rms_norm: x {x.shape} and h {h.shape} differ")
        x = cupy.ascontiguousarray(x if x.dtype == self._act else self._cast(x, self._act))
        h = cupy.ascontiguousarray(h if h.dtype == self._act else self._cast(h, self._act))
        s, out = cupy.empty(x.shape, self._act), cupy.empty(x.shape, self._act)
        d = x.shape[-1] if x.ndim else 1
        rows = x.size // d if d else 0
        if rows == 0:
            return s, out
        launch = norm_launch(d, x.itemsize)  # as _row_norm's, so the sums run in the same order
        w = _f32(weight)
        vec = _vectors_ok(d, x.itemsize, (x, x.itemsize, d), (h, h.itemsize, d), (w, 4))
        _kernel("elementwise", f"add_rms_norm_kernel<{_tname(self._act)}, {launch.chunks}>")(
            (_norm_blocks(launch, rows),), (launch.threads,), (x, h, _i64(rows), _i32(d), w, np.float32(eps), s, out,
                                                              _i32(launch.lanes), _i32(vec)))
        return s, out

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, positions, inv_freq):
        """Per-head RMSNorm (weights None: none) and rotate-half rotary of q [T, Hq, Dh] and k [T, Hk, Dh] in one
        launch (one warp per head row) -> new contiguous arrays in the storage dtype."""
        if (q_weight is None) != (k_weight is None):
            raise ValueError("qk_norm_rotary: give both q and k norm weights, or neither")
        if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"qk_norm_rotary: q {q.shape} and k {k.shape} must be [tokens, heads, dim] alike")
        half = int(inv_freq.shape[0])
        if 2 * half > q.shape[2]:
            raise ValueError(f"qk_norm_rotary: {half} frequencies rotate more than head dim {q.shape[2]}")
        q = q if q.dtype == self._act else self._cast(q, self._act)
        k = k if k.dtype == self._act else self._cast(k, self._act)
        q, qst, qsh = _heads(q)
        k, kst, ksh = _heads(k)
        t, hq, d = q.shape
        hk = k.shape[1]
        qo, ko = cupy.empty((t, hq, d), self._act), cupy.empty((t, hk, d), self._act)
        rows = t * (hq + hk)
        if rows == 0 or d == 0:
            return qo, ko
        norm = q_weight is not None
        qw = _f32(q_weight) if norm else cupy.empty(1, F32)
        kw = _f32(k_weight) if norm else qw
        blocks = max(1, min(-(-rows // (_THREADS // 32)), 1 << 16))
        _kernel("elementwise", f"qk_norm_rotary_kernel<{_tname(self._act)}, {'true' if norm else 'false'}>")(
            (blocks,), (_THREADS,), (q, _i64(qst), _i64(qsh), _i32(hq), k, _i64(kst), _i64(ksh), _i32(hk), _i64(t),
                                     _i32(d), qw, kw, np.float32(eps), _index(positions), _f32(inv_freq), _i32(half),
                                     qo, ko))
        return qo, ko

    def sigmoid_mul(self, x, gate):
        """x * sigmoid(gate) for x, gate [..., D] of one shape (strided rows allowed) in one launch."""
        if x.shape != gate.shape:
            raise ValueError(f"sigmoid_mul: x {x.shape} and gate {gate.shape} differ")
        x = x if x.dtype == self._act else self._cast(x, self._act)
        gate = gate if gate.dtype == self._act else self._cast(gate, self._act)
        x, rows, d, xn1, xs0, xs1 = _rows(x)
        gate, _, _, gn1, gs0, gs1 = _rows(gate)
        out = cupy.empty(x.shape, self._act)
        if rows and d:
            vec = _vectors_ok(d, x.itemsize, (x, x.itemsize, xs0, xs1), (gate, gate.itemsize, gs0, gs1))
            launch = elementwise_launch(d // elementwise_vector(x.itemsize) if vec else d, rows)
            _kernel("elementwise", f"sigmoid_mul_kernel<{_tname(self._act)}>")(
                launch.grid, (launch.threads,), (x, _i64(xn1), _i64(xs0), _i64(xs1), gate, _i64(gn1), _i64(gs0),
                                                 _i64(gs1), _i64(rows), _i32(d), out, _i32(launch.tx), _i32(vec)))
        return out

    def l2_normalize(self, x, eps=1e-6):
        """x [..., D] * rsqrt(sum(x^2) + eps); keeps x's dtype"""
        return self._row_norm(1, x, None, eps, out_dtype=x.dtype)

    def silu_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]"""
        return self._glu("silu_mul_kernel", gate_up)

    def gelu_tanh_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I]"""
        return self._glu("gelu_tanh_mul_kernel", gate_up)

    def gelu_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> gelu(gate) * up [T, I], exact (erf) GELU"""
        return self._glu("gelu_mul_kernel", gate_up)

    def scale(self, x, factor):
        """x * factor in the storage dtype (factor already rounded to it by the caller)"""
        return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)

    def softcap(self, x, cap):
        """cap * tanh(x / cap) on fp32 logits"""
        return (cupy.tanh(x / np.float32(cap)) * np.float32(cap)).astype(x.dtype)

    def _glu(self, kernel_name, gate_up):
        x, rows, d, n1, s0, _ = _rows(gate_up)
        if n1 != 1:
            x = cupy.ascontiguousarray(x)
            s0 = d
        inner = d // 2
        out = cupy.empty(x.shape[:-1] + (inner,), x.dtype)
        if rows and inner:
            vec = _vectors_ok(inner, x.itemsize, (x, x.itemsize, s0))  # the up half, inner elements on, aligned too
            launch = elementwise_launch(inner // elementwise_vector(x.itemsize) if vec else inner, rows)
            _kernel("elementwise", f"{kernel_name}<{_tname(x.dtype)}>")(
                launch.grid, (launch.threads,), (x, _i64(rows), _i64(inner), _i64(s0), out, _i32(launch.tx),
                                                 _i32(vec)))
        return out

    def add(self, a, b):
        """a + b with b broadcast over a's leading dims; the result has a's dtype (b may be an fp32 bias)."""
        if a.shape != b.shape:
            b_shape = tuple(b.shape)
            while b_shape and b_shape[0] == 1:
                b_shape = b_shape[1:]
            if len(b_shape) > a.ndim or tuple(a.shape[a.ndim - len(b_shape):]) != b_shape:
                return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)  # general broadcast
        a = cupy.ascontiguousarray(a)
        b = cupy.ascontiguousarray(b)
        out = cupy.empty(a.shape, a.dtype)
        n = a.size
        if n:
            _kernel("elementwise", f"add_kernel<{_tname(a.dtype)}, {_tname(b.dtype)}>")(
                (_grid(n),), (_THREADS,), (a, b, _i64(n), _i64(max(b.size, 1)), out))
        return out

    def sigmoid(self, x):
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, x.dtype)
        if x.size:
            _kernel("elementwise", f"sigmoid_kernel<{_tname(x.dtype)}>")(
                (_grid(x.size),), (_THREADS,), (x, _i64(x.size), out))
        return out

    def rotary(self, x, positions, inv_freq):
        """Rotate-half on the first 2*len(inv_freq) dims of each head of x [T, H, Dh], in place; returns x."""
        if x.ndim != 3:
            raise ValueError(f"rotary expects [tokens, heads, dim], got {x.shape}")
        target = x
        if x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
            x = cupy.ascontiguousarray(x)
        t, h, _ = x.shape
        half = int(inv_freq.shape[0])
        if t and h and half:
            _kernel("elementwise", f"rotary_kernel<{_tname(x.dtype)}>")(
                (_grid(t * h * half),), (_THREADS,), (
                    x, _i64(t), _i32(h), _i64(x.strides[0] // x.itemsize), _i64(x.strides[1] // x.itemsize),
                    _index(positions), _f32(inv_freq), _i32(half)))
        if x is not target:
            target[...] = x
        return target

    def delta_gates(self, a, b, a_log, dt_bias):
        """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); fp32 [T, Hv] each."""
        a, sa = _rows2(a)
        b, sb = _rows2(b)
        if b.dtype != a.dtype:
            b, sb = _rows2(self._cast(b, a.dtype))
        t, h = a.shape
        g = cupy.empty((t, h), F32)
        beta = cupy.empty((t, h), F32)
        if t and h:
            _kernel("elementwise", f"delta_gates_kernel<{_tname(a.dtype)}>")(
                (_grid(t * h),), (_THREADS,), (a, _i64(sa), b, _i64(sb), _i64(t), _i32(h), _f32(a_log),
                                               _f32(dt_bias), g, beta))
        return g, beta

    # ---- sequence mixing ----------------------------------------------------------------------------------------
    def causal_conv1d(self, x, weight, conv_state, slots, cu_seqlens):
        """Depthwise causal conv + SiLU per sequence from its conv history; updates conv_state[slots] in place.
        x [T, C], weight [C, K], conv_state [num_slots, C, K-1], slots [B], cu_seqlens [B+1] -> y [T, C]."""
        x, sx = _rows2(x)
        t, c = x.shape
        k = int(weight.shape[1])
        if k not in _CONV_K:
            raise ValueError(f"conv kernel width {k} not supported (2..8)")
        if not conv_state.flags.c_contiguous or conv_state.shape[1:] != (c, k - 1):
            raise ValueError(f"conv_state must be a contiguous [slots, {c}, {k - 1}] pool, got {conv_state.shape}")
        out = cupy.empty((t, c), x.dtype)
        slots, cu = _index(slots), _index(cu_seqlens)
        nseq = slots.shape[0]
        if t == 0 or nseq == 0 or c == 0:
            return out
        w = _f32(weight)
        types = f"{_tname(x.dtype)}, {_tname(conv_state.dtype)}, {k}"
        cblocks = -(-c // 128)
        _kernel("conv", f"conv_fwd_kernel<{types}>")(
            (cblocks, -(-t // 32) + nseq), (128,), (x, _i64(sx), w, conv_state, slots, cu, _i32(nseq), _i32(c), out))
        _kernel("conv", f"conv_state_kernel<{types}>")(
            (cblocks, nseq), (128,), (x, _i64(sx), conv_state, slots, cu, _i32(c)))
        return out

    def gated_delta_rule(self, q, k, v, g, beta, state, slots, cu_seqlens, chunk_size=64):
        """Gated delta rule per sequence from its fp32 recurrent state (updated in place).

        q, k [T, Hk, Dk] (L2-normalised, q unscaled; H % Hk == 0: value head h reads key head h // (H / Hk)),
        v [T, H, Dv], g, beta [T, H], state [slots, H, Dk, Dv]. Steps token by token in one launch (decode-like
        steps in gdn_decode_kernel, which moves the state once per call at near copy speed), except a
        prefill: bf16 with 16-byte aligned rows takes the tensor-core chunked form (kernels/delta_tc.cu), otherwise
        a prefill of a few long sequences the fp32 chunked form (64-token chunks, two launches each; see
        kernels/tuning.py). `chunk_size` is the reference's, accepted for signature compatibility.
        Returns o [T, H, Dv] in v's dtype."""
        dt = v.dtype
        q = q if q.dtype == dt else self._cast(q, dt)
        k = k if k.dtype == dt else self._cast(k, dt)
        q, qst, qsh = _heads(q)
        k, kst, ksh = _heads(k)
        v, vst, vsh = _heads(v)
        t, hk, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        if k.shape != q.shape or v.shape[0] != t or hk < 1 or h % hk:
            raise ValueError(f"q {q.shape} / k {k.shape} do not fit v {v.shape} (value heads in groups of key heads)")
        krep = h // hk
        if dk > 128 or dv < 1:
            raise ValueError(f"gated_delta_rule supports key head dims up to 128, got {dk}")
        if state.dtype != F32 or not state.flags.c_contiguous or state.shape[1:] != (h, dk, dv):
            raise ValueError(f"state must be a contiguous fp32 [slots, {h}, {dk}, {dv}] pool, got "
                             f"{state.dtype} {state.shape}")
        g = cupy.ascontiguousarray(_f32(g)).reshape(t, h)
        beta = cupy.ascontiguousarray(_f32(beta)).reshape(t, h)
        out = cupy.empty((t, h, dv), dt)
        slots, cu = _index(slots), _index(cu_seqlens)
        nseq = slots.shape[0]
        if t == 0 or nseq == 0:
            return out
        aligned = dt == BF16 and all(x.data.ptr % 16 == 0 and s % 8 == 0 for x, s in
                                     ((q, qst), (q, qsh), (k, kst), (k, ksh), (v, vst), (v, vsh)))
        launch = delta_rule_launch(self.tuning, self._sm_count, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv,
                                   tensor_cores=aligned)
        if launch.tensor_cores:
            self._gdn_tc(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
            return out
        if launch.chunked:
            self._gdn_chunked(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
            return out
        args = (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), v, _i64(vst), _i64(vsh), g, beta, state, slots, cu,
                _i32(h), _i32(krep), _i32(dk), _i32(dv), np.float32(1.0 / math.sqrt(dk)))
        _kernel("delta_rule", launch.kernel.format(t=_tname(dt)))(launch.grid, (launch.threads,), args + (out,))
        return out

    def _gdn_chunked(self, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out):
        """The chunked form (kernels/delta_rule.cu): a parallel pass over all 64-token chunks writes W, U0, Aqk and
        the cumulative gates to fp32 scratch, then a scan over each sequence's chunks applies the state."""
        t, _, dk = q.shape
        h, dv, nseq = v.shape[1], v.shape[2], slots.shape[0]
        c = _GDN_CHUNK
        w = cupy.empty((t, h, dk), F32)
        u = cupy.empty((t, h, dv), F32)
        aqk = cupy.empty((t, h, c), F32)
        gc = cupy.empty((t, h), F32)
        scale = np.float32(1.0 / math.sqrt(dk))
        tn = _tname(out.dtype)
        prep = self._dynamic_smem(_kernel("delta_rule", f"gdn_chunk_prep_kernel<{tn}>"), _GDN_PREP_SMEM)
        prep((-(-t // c) + nseq, h), (256,),
             (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), v, _i64(vst), _i64(vsh), g, beta, cu, _i32(nseq),
              _i32(h), _i32(krep), _i32(dk), _i32(dv), scale, w, u, aqk, gc), shared_mem=_GDN_PREP_SMEM)
        scan = self._dynamic_smem(_kernel("delta_rule", f"gdn_chunk_scan_kernel<{tn}>"), _GDN_SCAN_SMEM)
        scan((-(-dv // _GDN_SCAN_COLS), h, nseq), (256,),
             (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), w, u, aqk, gc, state, slots, cu, _i32(h), _i32(krep),
              _i32(dk), _i32(dv), scale, out), shared_mem=_GDN_SCAN_SMEM)

    def _gdn_tc(self, launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out):
        """The tensor-core chunked form (kernels/delta_tc.cu): a parallel pass over all 64-token chunks writes W, U0,
        Aqk (bf16) and the cumulative gates (fp32) to scratch, then a scan over each sequence's chunks applies the
        state, kept in registers. Scratch: T x H x (Dk + Dv + 64) bf16 + T x H fp32."""
        w, u, aqk, gc = self._gdn_tc_prep(launch.dim, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, cu,
                                          slots.shape[0], krep)
        h, dk, dv = v.shape[1], q.shape[2], v.shape[2]
        nbytes = gdn_tc_smem_bytes(launch.dim, launch.warps)
        scan = self._dynamic_smem(_kernel("delta_tc", launch.kernel), nbytes)
        scan(launch.grid, (32 * launch.warps,),
             (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), w, u, aqk, gc, state, slots, cu, _i32(h), _i32(krep),
              _i32(dk), _i32(dv), np.float32(1.0 / math.sqrt(dk)), out), shared_mem=nbytes)

    def _gdn_tc_prep(self, dim, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, cu, nseq, krep):
        """The prep pass (the tuning's gdn_tc_prep variant, <dim>) over every chunk of `nseq` sequences:
        (W [T, H, Dk], U0 [T, H, Dv], Aqk [T, H, 64], gc [T, H])."""
        t, _, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        w = cupy.empty((t, h, dk), BF16)
        u = cupy.empty((t, h, dv), BF16)
        aqk = cupy.empty((t, h, 64), BF16)
        gc = cupy.empty((t, h), F32)
        launch = gdn_tc_prep_launch(self.tuning, dim, tokens=t, seqs=nseq, heads=h)
        prep = self._dynamic_smem(_kernel("delta_tc", launch.kernel), launch.smem)
        prep(launch.grid, (launch.threads,),
             (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), v, _i64(vst), _i64(vsh), g, beta, cu, _i32(nseq),
              _i32(h), _i32(krep), _i32(dk), _i32(dv), np.float32(1.0 / math.sqrt(dk)), w, u, aqk, gc),
             shared_mem=launch.smem)
        return w, u, aqk, gc

    def _dynamic_smem(self, kern, nbytes: int):
        """Allow `kern` more than the default 48 KiB of dynamic shared memory (set once per kernel and size)."""
        if nbytes > 48 * 1024 and (id(kern), nbytes) not in self._smem_set:
            kern.max_dynamic_shared_size_bytes = nbytes
            self._smem_set.add((id(kern), nbytes))
        return kern

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        """Store new K/V rows [T, Hkv, D] at flat positions slot_mapping [T] (block * block_size + offset)."""
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("K/V caches must be contiguous pools")
        if v.dtype != k.dtype:
            v = self._cast(v, k.dtype)
        k, kst, ksh = _heads(k)
        v, vst, vsh = _heads(v)
        t, h, d = k.shape
        if k_cache.shape[2:] != (h, d) or v_cache.shape[2:] != (h, d) or v.shape != k.shape:
            raise ValueError(f"K/V rows {k.shape}/{v.shape} do not fit caches {k_cache.shape}/{v_cache.shape}")
        if t == 0:
            return
        _kernel("elementwise", f"write_kv_kernel<{_tname(k.dtype)}, {_tname(k_cache.dtype)}>")(
            (_grid(t * h * d),), (_THREADS,), (k, _i64(kst), _i64(ksh), v, _i64(vst), _i64(vsh), _i64(t), _i32(h),
                                               _i32(d), _index(slot_mapping), k_cache, v_cache))

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, scale,
                        sliding_window=None, shared=None):
        """Causal attention of each sequence's new queries over its paged K/V (new rows already written).

        q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]; context_lens [B];
        cu_seqlens [B+1]. A query at position p sees keys in (p - W, p] with W = sliding_window. -> [T, Hq, D].
        `shared` (decode, engine.batch.SharedPrefixes): each group's shared prefix is read once for all its members
        (cascade: a pass per group over the shared keys, a pass per sequence over the rest, then a merge)."""
        q, qst, qsh = _heads(q)
        t, hq, d = q.shape
        nb, bs, hkv, dc = k_cache.shape
        if dc != d or v_cache.shape != k_cache.shape or hq % hkv:
            raise ValueError(f"q {q.shape} does not fit caches {k_cache.shape}/{v_cache.shape}")
        if d > 256:
            raise ValueError(f"head_dim up to 256 supported, got {d}")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("K/V caches must be contiguous pools")
        window = 0
        if sliding_window is not None:
            window = int(sliding_window)
            if window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        out = cupy.empty((t, hq, d), q.dtype)
        tables, ctx, cu = _index(block_tables), _index(context_lens), _index(cu_seqlens)
        nseq = ctx.shape[0]
        if t == 0 or nseq == 0:
            return out
        use_mma = (q.dtype == BF16 and k_cache.dtype == BF16 and d in _MMA_HEAD_DIMS and q.data.ptr % 16 == 0
                   and qst % 8 == 0 and qsh % 8 == 0)
        plan = attention_plan(self.tuning, self._sm_count, tokens=t, seqs=nseq, q_heads=hq, kv_heads=hkv, head_dim=d,
                              table_width=tables.shape[1], block_size=bs, window=window, tensor_cores=use_mma,
                              shared=shared is not None, wgmma=self._wgmma)
        if plan.path == "wgmma":
            attention_sm90.prefill(q=q, qst=qst, qsh=qsh, k_cache=k_cache, v_cache=v_cache, tables=tables, ctx=ctx,
                                   cu=cu, nseq=nseq, tokens=t, hq=hq, hkv=hkv, d=d, bs=bs,
                                   scale_log2=scale * _LOG2E, window=window, out=out, schedule=plan.schedule,
                                   sm_count=self._sm_count)
            return out
        if plan.path == "scalar":  # fp32 (exactness) path: plain attention; a shared prefix gives the same answer
            kern = _kernel("attention", f"attn_scalar_kernel<{_tname(q.dtype)}, {_tname(k_cache.dtype)}>")
            kern((t, -(-hq // 4)), (128,), (q, _i64(qst), _i64(qsh), k_cache, v_cache, tables,
                                            _i32(tables.shape[1]), ctx, cu, _i32(nseq), _i32(hq), _i32(hkv),
                                            _i32(d), _i32(bs), np.float32(scale), _i32(window), out))
            return out
        mma = dict(q=q, qst=qst, qsh=qsh, k_cache=k_cache, v_cache=v_cache, bs=bs, hq=hq, hkv=hkv, d=d,
                   scale=scale, window=window, out=out)
        splits = plan.splits
        if plan.path == "cascade":  # partial results: one slot per shared-key range, one for each row's own keys
            part_o = cupy.empty((splits + 1, t * hq, d), F32)
            part_ml = cupy.empty((splits + 1, t * hq, 2), F32)
            self._attn_pass(**mma, tables=_index(shared.tables), ctx=_index(shared.lens), cu=_index(shared.cu),
                            nseq=shared.lens.shape[0], tokens=t, nw=plan.warps, bn=plan.keys, splits=splits, mode=1,
                            slot_base=0, part=(part_o, part_ml), row_tok=_index(shared.order), kv_from=ctx)
            self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, nw=plan.own_warps, bn=plan.keys,
                            mode=2, slot_base=splits, part=(part_o, part_ml), row_tok=cu, kv_from=_index(shared.start))
            self._attn_merge(part_o, part_ml, splits + 1, t * hq, d, out)
            return out
        if plan.path == "split":
            part = (cupy.empty((splits, t * hq, d), F32), cupy.empty((splits, t * hq, 2), F32))
            self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, nw=plan.warps, bn=plan.keys,
                            splits=splits, part=part)
            self._attn_merge(*part, splits, t * hq, d, out)
            return out
        self._attn_pass(**mma, tables=tables, ctx=ctx, cu=cu, nseq=nseq, tokens=t, nw=plan.warps, bn=plan.keys)
        return out

    def _attn_pass(self, *, q, qst, qsh, k_cache, v_cache, bs, hq, hkv, d, scale, window, out, tables, ctx, cu, nseq,
                   tokens, nw, bn, splits=1, mode=0, slot_base=0, part=None, row_tok=None, kv_from=None):
        """One launch of attn_mma_kernel (see kernels/attention.cu for the modes). Without `part` it writes `out`;
        with it, partials into slots slot_base + split of part = ([slots, T * Hq, D], [slots, T * Hq, 2])."""
        if part is not None and splits == 1 and mode == 0:
            raise ValueError("a plain pass with one split writes `out`, not partials")
        kern = _kernel("attention", f"attn_mma_kernel<{d}, {bn}, {nw}>")
        smem = (16 * nw + 2 * bn) * (d + 8) * 2
        self._dynamic_smem(kern, smem)
        rep = hq // hkv
        part_o, part_ml = part if part is not None else (out, out)
        grid = ((-(-tokens * rep // (16 * nw)) + nseq) * splits, hkv)
        kern(grid, (32 * nw,), (q, _i64(qst), _i64(qsh), k_cache, v_cache, tables, _i32(tables.shape[1]), ctx, cu,
                                _i32(nseq), _i32(hq), _i32(hkv), _i32(bs), np.float32(scale * _LOG2E), _i32(window),
                                out, _i32(splits), part_o, part_ml, _i32(mode), _i32(slot_base), _i64(tokens),
                                row_tok if row_tok is not None else cu, kv_from if kv_from is not None else cu),
             shared_mem=smem)

    @staticmethod
    def _attn_merge(part_o, part_ml, slots, rows, d, out):
        _kernel("attention", "attn_combine_kernel")((rows,), (128,), (part_o, part_ml, _i32(slots), _i64(rows), _i32(d),
                                                                      out))

    def ring_attention(self, q, k, v, k_ring, v_ring, slots, cu_seqlens, context_lens, scale, max_context):
        """Sliding-window attention over per-sequence K/V rings (see NumpyOps.ring_attention for the contract).

        A ring pool [num_slots, W, Hkv, D] is laid out exactly like a paged pool with block size W, and a
        sequence's position p lives at row p % W of its slot, so attention runs on the paged kernel with a block
        table that repeats the slot. Decode (one new token per sequence) writes the token first — the row it
        overwrites, position p - W, is outside the window. Prefill must not overwrite rows its earlier queries
        still see, so it gathers ring + new rows into a temporary cache (one block per sequence), attends there,
        and then writes the kept new rows into the ring."""
        w = k_ring.shape[1]
        t, nseq = q.shape[0], slots.shape[0]
        if t == 0:
            return cupy.empty(q.shape, q.dtype)
        if t == nseq:  # decode: write, then attend with the slot repeated as every block (no host sync)
            slots_d = _index(slots).astype(cupy.int32)
            ctx_d = _index(context_lens).astype(cupy.int32)
            self.write_kv(k_ring, v_ring, k, v, slots_d * w + (ctx_d - 1) % w)
            nblk = -(-int(max_context) // w)
            tables = cupy.ascontiguousarray(cupy.broadcast_to(slots_d[:, None], (nseq, nblk)))
            return self.paged_attention(q, k_ring, v_ring, tables, context_lens, cu_seqlens, scale,
                                        sliding_window=w)
        slots_h, ctx_h, cu_h = (cupy.asnumpy(a).astype(np.int64) for a in (slots, context_lens, cu_seqlens))
        start_h = ctx_h - (cu_h[1:] - cu_h[:-1])
        first_h = np.maximum(0, start_h - w + 1)  # earliest position a new query can see
        local_len = ctx_h - first_h
        width = int(local_len.max())
        hkv, d = k.shape[1], k.shape[2]
        tmp_k = cupy.zeros((nseq, width, hkv, d), k_ring.dtype)
        tmp_v = cupy.zeros((nseq, width, hkv, d), v_ring.dtype)
        # host-built gather maps: (sequence, local row) <- ring row or new row
        ring_dst, ring_src, new_dst, new_src = [], [], [], []
        for b in range(nseq):
            prev = np.arange(first_h[b], start_h[b])
            ring_dst.append(b * width + (prev - first_h[b]))
            ring_src.append(slots_h[b] * w + prev % w)
            new = np.arange(start_h[b], ctx_h[b])
            new_dst.append(b * width + (new - first_h[b]))
            new_src.append(cu_h[b] + new - start_h[b])
        flat = lambda a: a.reshape((-1,) + a.shape[-2:])
        ring_dst, ring_src = np.concatenate(ring_dst), np.concatenate(ring_src)
        new_dst, new_src = self.upload_index(np.concatenate(new_dst)), self.upload_index(np.concatenate(new_src))
        if ring_dst.size:
            rd, rs = self.upload_index(ring_dst), self.upload_index(ring_src)
            flat(tmp_k)[rd] = flat(k_ring)[rs]
            flat(tmp_v)[rd] = flat(v_ring)[rs]
        flat(tmp_k)[new_dst] = k[new_src].astype(k_ring.dtype)
        flat(tmp_v)[new_dst] = v[new_src].astype(v_ring.dtype)
        tables = self.upload_index(np.arange(nseq)[:, None])
        out = self.paged_attention(q, tmp_k, tmp_v, tables, self.upload_index(local_len), cu_seqlens, scale,
                                   sliding_window=w)
        keep_src, keep_at = [], []
        for b in range(nseq):
            kept = np.arange(max(start_h[b], ctx_h[b] - w), ctx_h[b])
            keep_src.append(cu_h[b] + kept - start_h[b])
            keep_at.append(slots_h[b] * w + kept % w)
        keep_src = self.upload_index(np.concatenate(keep_src))
        self.write_kv(k_ring, v_ring, k[keep_src], v[keep_src], self.upload_index(np.concatenate(keep_at)))
        return out

    # ---- speculative (multi-row) steps: kernels/spec_rows.cu ----------------------------------------------------
    def causal_conv1d_rows(self, x, weight, conv_state, slots, cu_seqlens, snapshots, snapshot_rows):
        """`causal_conv1d`, and the conv history after every token t with snapshot_rows[t] >= 0 in
        snapshots[snapshot_rows[t]] ([R, C, K-1], conv_state's dtype). The snapshots are taken first, from the
        old histories the conv then rewrites."""
        xr, sx = _rows2(x)
        t, c = xr.shape
        km1 = int(weight.shape[1]) - 1
        if snapshots.dtype != conv_state.dtype or not snapshots.flags.c_contiguous \
                or snapshots.shape[1:] != (c, km1):
            raise ValueError(f"snapshots must be a contiguous [rows, {c}, {km1}] {conv_state.dtype} pool, got "
                             f"{snapshots.dtype} {snapshots.shape}")
        slots_i, cu, rows = _index(slots), _index(cu_seqlens), _index(snapshot_rows)
        nseq = slots_i.shape[0]
        if t and c and nseq and km1 > 0:
            _kernel("spec_rows", f"conv_snapshot_kernel<{_tname(xr.dtype)}, {_tname(conv_state.dtype)}>")(
                (-(-c // 128), t), (128,), (xr, _i64(sx), conv_state, snapshots, slots_i, cu, rows, _i32(nseq),
                                            _i32(c), _i32(km1)))
        return self.causal_conv1d(x, weight, conv_state, slots, cu_seqlens)

    def gated_delta_rule_rows(self, q, k, v, g, beta, state, slots, cu_seqlens, snapshots, snapshot_rows):
        """`gated_delta_rule` token by token, and the fp32 state after every token t with snapshot_rows[t] >= 0
        in snapshots[snapshot_rows[t]] ([R, H, Dk, Dv]). One launch; a block per (sequence, head, 32 columns)."""
        dt = v.dtype
        q = q if q.dtype == dt else self._cast(q, dt)
        k = k if k.dtype == dt else self._cast(k, dt)
        q, qst, qsh = _heads(q)
        k, kst, ksh = _heads(k)
        v, vst, vsh = _heads(v)
        t, hk, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        if k.shape != q.shape or v.shape[0] != t or hk < 1 or h % hk:
            raise ValueError(f"q {q.shape} / k {k.shape} do not fit v {v.shape} (value heads in groups of key heads)")
        if dk > 128:
            raise ValueError(f"gated_delta_rule_rows supports key head dims up to 128, got {dk}")
        for name, a in (("state", state), ("snapshots", snapshots)):
            if a.dtype != F32 or not a.flags.c_contiguous or a.shape[1:] != (h, dk, dv):
                raise ValueError(f"{name} must be a contiguous fp32 [rows, {h}, {dk}, {dv}] pool, got "
                                 f"{a.dtype} {a.shape}")
        g = cupy.ascontiguousarray(_f32(g)).reshape(t, h)
        beta = cupy.ascontiguousarray(_f32(beta)).reshape(t, h)
        out = cupy.empty((t, h, dv), dt)
        slots_i, cu, rows = _index(slots), _index(cu_seqlens), _index(snapshot_rows)
        nseq = slots_i.shape[0]
        if t and nseq:
            _kernel("spec_rows", f"gdn_rows_kernel<{_tname(dt)}>")(
                (-(-dv // 32), h, nseq), (128,),
                (q, _i64(qst), _i64(qsh), k, _i64(kst), _i64(ksh), v, _i64(vst), _i64(vsh), g, beta, state,
                 snapshots, slots_i, cu, rows, _i32(h), _i32(h // hk), _i32(dk), _i32(dv),
                 np.float32(1.0 / math.sqrt(dk)), out))
        return out

    # ---- sparse MoE: kernels/moe_cuda.py (contracts: kernels/moe_reference.py) ----------------------------------
    def moe_route(self, router_logits, top_k, normalize):
        return _moe().route(router_logits, top_k, normalize)

    def moe_permute(self, experts, num_experts):
        return _moe().permute(experts, num_experts)

    def moe_grouped_linear(self, x, weight, offsets, token_of_row=None):
        return _moe().grouped_linear(x, weight, offsets, token_of_row)

    def moe_combine(self, y, position, weights, shared=None, shared_gate=None):
        return _moe().combine(y, position, weights, shared, shared_gate, out_dtype=self._act)

    # ---- state copies -------------------------------------------------------------------------------------------
    def copy_rows(self, arrays, src, dst):
        """For each pool array: array[dst[i]] = array[src[i]] — all arrays and pairs in one launch.
        dst rows must not also be source rows (checked when the indices are host lists)."""
        arrays = list(arrays)
        if not arrays:
            return
        host = not isinstance(src, cupy.ndarray) and not isinstance(dst, cupy.ndarray)
        if host:
            src_h = np.asarray(src, np.int64).reshape(-1)
            dst_h = np.asarray(dst, np.int64).reshape(-1)
            if src_h.shape != dst_h.shape:
                raise ValueError("copy_rows: src and dst differ in length")
            if src_h.size == 0:
                return
            # overlapping: gather first, then scatter (numpy semantics). A set, not np.intersect1d: that one's first
            # call imports numpy.ma (92 ms on the H200 machine, in the first fork of every run's first group)
            if not set(src_h.tolist()).isdisjoint(dst_h.tolist()):
                src_i, dst_i = cupy.asarray(src_h), cupy.asarray(dst_h)
                for a in arrays:
                    raw = a.view(np.uint8).reshape(a.shape[0], -1)  # raw bytes: any dtype
                    raw[dst_i] = raw[src_i].copy()
                return
            npairs = src_h.size
            few = (src_h.tolist(), dst_h.tolist()) if npairs <= 8 else None
            src_d = dst_d = None
            if few is None:
                src_d, dst_d = cupy.asarray(src_h), cupy.asarray(dst_h)
        else:
            src_d = cupy.ascontiguousarray(cupy.asarray(src).astype(np.int64).reshape(-1))
            dst_d = cupy.ascontiguousarray(cupy.asarray(dst).astype(np.int64).reshape(-1))
            if src_d.shape != dst_d.shape:
                raise ValueError("copy_rows: src and dst differ in length")
            if src_d.size == 0:
                return
            npairs, few = src_d.size, None
        table, utype, max_units = self._copy_table(arrays)
        if max_units == 0:
            return
        grid = (max(1, min(-(-max_units // _THREADS), 1024)), npairs, len(arrays))
        if few is not None:  # indices as kernel arguments: no host->device copy
            pad = [0] * (8 - npairs)
            _kernel("elementwise", f"copy_rows_few_kernel<{utype}>")(
                grid, (_THREADS,), (table[0], table[1]) + tuple(_i64(i) for i in list(few[0]) + pad)
                + tuple(_i64(i) for i in list(few[1]) + pad))
        else:
            _kernel("elementwise", f"copy_rows_kernel<{utype}>")(grid, (_THREADS,), (table[0], table[1], src_d, dst_d))

    def _copy_table(self, arrays):
        """Device table (base pointers, row sizes in copy units) for a list of pools, cached on the list's identity
        (the entry holds the arrays, so their ids stay theirs while it lives)."""
        key = tuple(map(id, arrays))
        entry = self._copy_tables.get(key)
        if entry is not None:
            return entry[1:]
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError("copy_rows needs contiguous pool arrays")
        row_bytes = [a.nbytes // a.shape[0] if a.shape[0] else 0 for a in arrays]
        ptrs = [a.data.ptr for a in arrays]
        unit = 16
        for rb, p in zip(row_bytes, ptrs):
            while unit > 1 and (rb % unit or p % unit):
                unit = 4 if unit == 16 else 1
        table = (cupy.asarray(np.array(ptrs, np.uint64)), cupy.asarray(np.array(row_bytes, np.int64) // unit))
        if len(self._copy_tables) >= 64:
            self._copy_tables.clear()
        utype = {16: "uint4", 4: "unsigned int", 1: "unsigned char"}[unit]
        entry = self._copy_tables[key] = (tuple(arrays), table, utype, max(row_bytes) // unit)
        return entry[1:]

    # ---- sampling -----------------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, counters):
        """Next token per row of logits [B, V] (NumpyOps.sample's contract: kernels/sampling.py semantics, the
        same uniforms), computed on the device for the whole batch: one parameter upload, one kernel, no host
        sync. Returns a device int64 [B] (ops.to_host for the ids)."""
        params = cupy.asarray(pack_sampling_params(temperature, top_k, top_p, min_p, seeds, counters))
        out = cupy.empty(params.shape[1], np.int64)
        self.sample_into(logits, params, out)
        return out

    def feed_tokens(self, token_ids, source, previous):
        """token_ids[i] = previous[source[i]] where source[i] >= 0, in place, one launch, no host sync (a decode
        step's inputs fed with the previous step's sampled ids while those are still on the device)."""
        if token_ids.dtype != np.int32 or source.dtype != np.int32 or previous.dtype != np.int64 \
                or token_ids.shape != source.shape or token_ids.ndim != 1:
            raise ValueError(f"feed_tokens: int32 token_ids and source of one shape [T] and int64 previous "
                             f"expected, got {token_ids.dtype} {token_ids.shape}, {source.dtype} {source.shape}, "
                             f"{previous.dtype}")
        if token_ids.size:
            n = token_ids.size
            _kernel("sampling", "feed_tokens_kernel")((_grid(n),), (_THREADS,),
                                                      (token_ids, cupy.ascontiguousarray(source), previous, _i32(n)))

    def sample_into(self, logits, params, out):
        """`sample` with the parameters already packed on the device (uint32 [8, B], pack_sampling_params; int32
        holding the same bits, as an index buffer written by write_index, is read the same) into
        a preallocated out int64 [B]: no allocation for fp32 logits, no copy, so it can be captured in a graph
        whose replays rewrite `params` in place."""
        logits = logits if logits.dtype == F32 else self._cast(logits, F32)
        logits = _last_contiguous(logits)
        b, v = logits.shape
        if params.shape != (8, b) or params.dtype not in (np.uint32, np.int32) or out.shape != (b,) \
                or out.dtype != np.int64:
            raise ValueError(f"sample_into: params uint32/int32 [8, {b}] and out int64 [{b}] expected, got "
                             f"{params.dtype} {params.shape} and {out.dtype} {out.shape}")
        if b == 0:
            return out
        _kernel("sampling", "sample_kernel")((b,), (_SAMPLE_THREADS,), (logits, _i32(b), _i32(v),
                                                                         _i64(logits.strides[0] // 4),
                                                                         cupy.ascontiguousarray(params), out))
        return out

    # ---- CUDA graphs --------------------------------------------------------------------------------------------
    def capture(self, fn, *args, warmup: int = 1) -> CudaGraph:
        """Capture fn(*args)'s launches (custom kernels and cuBLAS GEMMs) into a CUDA graph.

        fn runs `warmup` times eagerly first (compiles kernels, binds cuBLAS), then once under capture on a
        non-default stream with a private memory pool, so the buffers the graph writes are never handed to anyone
        else. fn must not synchronise or copy host memory (no upload/to_host/sample inside). Replay reads the same
        input buffers fn read at capture time: update them in place between replays."""
        for loader in _PREPARERS:  # no module load on another thread while a stream captures
            loader.join()
        for _ in range(warmup):
            fn(*args)
        if warmup:
            self.synchronize()
        # without a warm-up nothing needs the device drained: the capture records launches, it runs none, so
        # the work still queued (a prefill's tail) computes while the host captures
        pool = cupy.cuda.MemoryPool()
        stream = cupy.cuda.Stream(non_blocking=True)
        with cupy.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                outputs = fn(*args)
            finally:
                graph = stream.end_capture()
        stream.synchronize()
        return CudaGraph(graph, outputs, pool)
