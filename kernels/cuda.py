"""CUDA backend: the same ops as kernels/reference.py (`NumpyOps`) on CuPy arrays.

Storage is bf16 (`ml_dtypes.bfloat16`, CUDA's `__nv_bfloat16`) or fp32; every kernel accumulates in fp32.
Custom kernels live in kernels/*.cu and are compiled once per process and device by NVRTC (CuPy RawModule, the
device's own architecture, C++17); GEMMs go through cuBLAS via the ctypes binding in kernels/cublas.py, so a whole
decode step can be captured into a CUDA graph (`CudaOps.capture`).

No op synchronises with the host except host->device copies (`upload_index`, `sample`'s packed parameters,
`copy_rows` given more than 8 host pairs — up to 8 travel as kernel arguments). Varlen kernels take device
cu_seqlens and size their grids from host-known shapes (T tokens, B sequences), each block finding its
sequence on the device, so no per-layer device->host read of lengths is needed.

The ops come in families, one module each, which `CudaOps` composes: kernels/cuda_dense.py (norms, activations,
GEMMs), kernels/cuda_mixing.py (convolution, gated delta rule), kernels/cuda_attention.py, kernels/moe_cuda.py;
this module keeps memory, state copies, sampling and graph capture. Below them: kernels/cuda_modules.py (the
NVRTC modules), kernels/cuda_arrays.py (launch arithmetic, strided views), kernels/cuda_graph.py.
"""
from __future__ import annotations

import copy
import dataclasses
import threading

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels import attention_sm90, cuda_warmup, moe_cuda
from prefixrun.kernels.cublas import get_cublas
from prefixrun.kernels.cuda_arrays import BF16, F32, THREADS, TYPE_NAMES, blocks_for, cast, device_index, i32, i64, \
    last_contiguous, type_name
from prefixrun.kernels.cuda_attention import AttentionOps
from prefixrun.kernels.cuda_dense import DenseOps
from prefixrun.kernels.cuda_fp8 import dequantize_into, upload_projection
from prefixrun.kernels.fp8 import Fp8Matrix
from prefixrun.kernels.cuda_graph import CudaGraph
from prefixrun.kernels.cuda_mixing import SequenceMixingOps
from prefixrun.kernels.cuda_mamba import MAX_SSM_STATE, MambaOps
from prefixrun.kernels.cuda_modules import CONV_WIDTHS, PREPARED_FILES, kernel
from prefixrun.kernels.host_memory import start_device_to_host
from prefixrun.kernels.step_io import StepCopies
from prefixrun.kernels.upload import upload_ahead, upload_bytes, upload_bytes_many
from prefixrun.kernels.kv_storage import region_dtype
from prefixrun.kernels.sampling import pack_sampling_params
from prefixrun.kernels.tuning import CudaTuning, moe_gemm_rows, moe_gemm_stages

_SAMPLE_THREADS = 1024  # SAMPLE_THREADS in kernels/sampling.cu
_LOGITS_THREADS = 256  # LOGITS_THREADS in kernels/logits.cu
# moe_grouped_linear's activations as moe_gemm_mma_kernel's epilogues (EPI in kernels/moe.cu)
_MOE_EPILOGUES = {None: 0, "silu_mul": 1, "relu2": 2}
_PREPARERS: list[threading.Thread] = []  # every prepare_kernels thread started (a capture waits for them)


class CudaOps(DenseOps, SequenceMixingOps, AttentionOps, MambaOps):
    """The CUDA backend. Activations in `act_dtype` (bf16 or fp32), recurrent states and gates in fp32."""

    display_name = "cuda"
    device_kind = "cuda"  # where arrays live, as torch names devices (for handing work to other libraries)
    can_capture_graphs = True
    # 64-row blocks: fewer table entries per sequence and whole MMA key tiles (measured faster than 16)
    default_block_size = 64

    def __init__(self, dtype: str = "bfloat16", tuning: CudaTuning | None = None, deterministic: bool = False):
        if dtype == "bfloat16":
            self.act_dtype = ml_dtypes.bfloat16
        elif dtype == "float32":
            self.act_dtype = np.float32
        else:
            raise ValueError(f"the CUDA backend computes in bfloat16 or float32, not {dtype!r}")
        self.dtype_name = dtype
        self._act = np.dtype(self.act_dtype)
        self._copy_tables: dict[tuple, tuple] = {}
        self._smem_set: set = set()
        # which kernel runs for which shapes: kernels/tuning.py (fixed for this object's life; see `retuned`)
        self.tuning = tuning or CudaTuning()
        if deterministic:
            self.tuning = dataclasses.replace(self.tuning, deterministic=True)
        self.auto_speculation = self.tuning.speculative_auto  # the Ops query (kernels/ops.py)
        self.max_conv_width = max(CONV_WIDTHS)  # kernels/conv.cu is compiled for these widths
        self.max_ssm_state = MAX_SSM_STATE  # kernels/mamba.cu keeps a state row in one warp's registers
        self.per_channel_decay = True  # kernels/delta_rule.cu and spec_rows.cu take a decay per key channel too
        self.deterministic = self.tuning.deterministic  # the Ops query (kernels/ops.py)
        self._sm_count = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._device_id = cupy.cuda.Device().id  # for calls from other threads (upload_ahead)
        self._preparing: threading.Thread | None = None  # prepare_kernels' loader
        self._wgmma = attention_sm90.available()  # sm_90a kernels (attention prefill) run here
        self._copies = None  # a decode step's small copies through pinned buffers (kernels/step_io.py)

    @property
    def _blas(self):
        """The process's cuBLAS handle, created at the first GEMM if no thread made it before (an early bring-up,
        kernels/device_start.py, makes it while the weights load); kept on this object once fetched."""
        blas = self.__dict__.get("_blas_handle")
        if blas is None:
            blas = self.__dict__["_blas_handle"] = get_cublas()
        return blas

    def retuned(self, **changes) -> "CudaOps":
        """This backend with other kernel variants (tests and benches comparing them): a new ops object sharing
        the cuBLAS handle and caches, its tuning `dataclasses.replace(self.tuning, **changes)`."""
        other = copy.copy(self)
        other.tuning = dataclasses.replace(self.tuning, **changes)
        other.auto_speculation = other.tuning.speculative_auto
        other.deterministic = other.tuning.deterministic
        return other

    # ---- queries ------------------------------------------------------------------------------------------------
    def free_memory(self) -> int | None:
        """Bytes the device can still hand out: free device memory plus what CuPy's pool holds unused."""
        free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return int(free + pool.free_bytes())

    def device_identity(self) -> str:
        """The GPU's model, memory, compute capability and clock, the driver's and CUDA runtime's versions, CuPy's."""
        runtime = cupy.cuda.runtime
        props = runtime.getDeviceProperties(runtime.getDevice())
        name = props["name"].decode("utf-8", "replace") if isinstance(props["name"], bytes) else str(props["name"])
        return (f"{name}, {props['totalGlobalMem']} bytes, sm_{props['major']}{props['minor']}, "
                f"{props.get('multiProcessorCount')} SMs at {props.get('clockRate')} kHz, driver "
                f"{runtime.driverGetVersion()}, runtime {runtime.runtimeGetVersion()}, cupy {cupy.__version__}")

    def storage_dtype(self, kind: str) -> np.dtype:
        """The array dtype of a state region declared `kind` ("float32", or "act" for the storage dtype)."""
        return region_dtype(kind, self.act_dtype)

    def release_cached_memory(self):
        """Give CuPy's cached, unused device blocks back to the driver (before another library allocates)."""
        cupy.get_default_memory_pool().free_all_blocks()

    def prepare_kernels(self, plan=None):
        """Load every kernel module's functions and warm cuBLAS up for the plan's GEMMs (kernels/cuda_warmup.py) on a
        background thread while the caller uploads the weights. `plan`: None, or a function returning the model's
        kernels/warmup.py KernelPlan, called on that thread. `kernel`'s lock makes a step that needs a module still
        loading wait for it, never load it twice; a stream capture waits for the thread (`_PREPARERS`)."""
        if self._preparing is None:
            self._preparing = threading.Thread(target=cuda_warmup.prepare, daemon=True, name="prefixrun-kernels",
                                               args=(cupy.cuda.Device().id, self._act, plan, PREPARED_FILES,
                                                     self.tuning.deterministic, self.tuning.gemm_pairing))
            self._preparing.start()
            _PREPARERS[:] = [t for t in _PREPARERS if t.is_alive()] + [self._preparing]

    def kernel_account(self):
        """The latest warm-up's account (kernels/cuda_warmup.py LAST), times relative to its start."""
        account = dict(cuda_warmup.LAST)
        if not account:
            return None
        started, ended = account.pop("started", None), account.pop("ended", None)
        account["seconds"] = round(ended - started, 4) if started is not None and ended is not None else None
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in account.items()}

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
        parts = list(host_parts)
        if parts and all(isinstance(p, Fp8Matrix) for p in parts):
            return self._upload_fp8_rows(parts, dt)
        if any(isinstance(p, Fp8Matrix) for p in parts):  # mixed with plain parts: each dequantised on the device
            return self._device_rows([self._upload_fp8_rows([p], dt) if isinstance(p, Fp8Matrix) else p
                                      for p in parts], dt)
        if any(isinstance(p, cupy.ndarray) for p in parts):
            return self._device_rows(parts, dt)
        parts = [np.asarray(p) for p in parts]
        if not parts or any(p.ndim == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
            if len(parts) == 1 and parts[0].ndim == 0:  # a scalar: nothing to stage
                return cupy.asarray(np.asarray(parts[0], dt))
            raise ValueError(f"upload_rows: parts {[p.shape for p in parts]} do not stack along axis 0")
        src = parts[0].dtype
        if src not in TYPE_NAMES or any(p.dtype != src for p in parts):
            src = dt  # other dtypes (or a mix) convert on the host, as NumPy converts them
        out = cupy.empty((sum(p.shape[0] for p in parts),) + parts[0].shape[1:], src)
        row = 0
        for p in parts:
            upload_bytes(out[row:row + p.shape[0]], np.ascontiguousarray(p, dtype=src))
            row += p.shape[0]
        return out if src == dt else cast(out, dt)

    def _device_rows(self, parts, dt):
        """upload_rows of parts that are on the device already (weights read ahead, kernels/weight_reads.py), host
        parts among them uploaded first: a lone part in `dt` is the result itself, else each part is copied (and
        converted) into its rows on the device."""
        parts = [p if isinstance(p, cupy.ndarray) else self.upload_rows([p], dt) for p in parts]
        if any(p.ndim == 0 or p.shape[1:] != parts[0].shape[1:] for p in parts):
            raise ValueError(f"upload_rows: parts {[p.shape for p in parts]} do not stack along axis 0")
        if len(parts) == 1 and parts[0].dtype == dt and parts[0].flags.c_contiguous:
            return parts[0]
        out = cupy.empty((sum(p.shape[0] for p in parts),) + parts[0].shape[1:], dt)
        stream, at = cupy.cuda.get_current_stream(), out.data.ptr
        for p in parts:
            p = cupy.ascontiguousarray(self._cast(p, dt))
            if p.nbytes:
                cupy.cuda.runtime.memcpyAsync(at, p.data.ptr, p.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                              stream.ptr)
            at += p.nbytes
        return out

    def upload_permuted(self, part, view_shape, axes):
        """The stored bytes go up as they are (fp32, bf16: read ahead or staged), are converted on the device, then
        one strided device copy of their bits (as unsigned integers of their size) makes the new layout."""
        dt = np.dtype(self.act_dtype)
        if not isinstance(part, cupy.ndarray):
            part = np.asarray(part)
            part = self.upload_rows([part], part.dtype if part.dtype in TYPE_NAMES else dt)
        bits = np.dtype(f"u{dt.itemsize}")
        a = self._cast(part, dt).view(bits).reshape(view_shape)
        return cupy.ascontiguousarray(a.transpose(axes)).view(dt)

    def upload_mxfp4(self, blocks, scales):
        """The packed bytes go up as stored (a quarter of bf16's bytes) and one kernel writes the values."""
        packed = []
        for a in (blocks, scales):
            a = np.ascontiguousarray(a, np.uint8)
            packed.append(cupy.empty(a.shape, np.uint8))
            upload_bytes(packed[-1], a)
        out = cupy.empty(tuple(blocks.shape[:-2]) + (blocks.shape[-2] * 2 * blocks.shape[-1],), self._act)
        if out.size:
            kernel("elementwise", f"mxfp4_kernel<{type_name(self._act)}>")(
                (blocks_for(out.size),), (THREADS,), (packed[0], packed[1], i64(out.size), out))
        return out

    def upload_linear(self, host_parts):
        """A projection's weight: FP8 parts on the 128 x 128 grid kept as fp8 bytes + block scales for cuBLASLt's
        block-scaled FP8 GEMM, the rest dequantised (kernels/cuda_fp8.py upload_projection)."""
        return upload_projection(self, list(host_parts))

    def read_weights(self, spans):
        """Read ahead through a ring of pinned buffers and asynchronous DMAs (kernels/cuda_weight_reads.py): the
        tensors whose stored dtype the kernels take (fp32, bf16, FP8 values as bytes); the others go the upload's
        way."""
        from prefixrun.kernels.cuda_weight_reads import start_reads

        return start_reads(list(spans), self._device_id)

    def _upload_fp8_rows(self, parts, dt):
        """upload_rows of FP8 matrices: each dequantised on the device into its rows (kernels/cuda_fp8.py)."""
        shapes = [p.shape for p in parts]
        if any(s[1] != shapes[0][1] for s in shapes):
            raise ValueError(f"upload_rows: parts {shapes} do not stack along axis 0")
        out = cupy.empty((sum(s[0] for s in shapes), shapes[0][1]), dt)
        row = 0
        for p, (n, _) in zip(parts, shapes):
            dequantize_into(out[row:row + n], p)
            row += n
        return out

    def upload_index(self, host_array):
        return device_index(host_array)

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
        return cast(x, dtype, copy)

    def _dynamic_smem(self, kern, nbytes: int):
        """Allow `kern` more than the default 48 KiB of dynamic shared memory (set once per kernel and size)."""
        if nbytes > 48 * 1024 and (id(kern), nbytes) not in self._smem_set:
            kern.max_dynamic_shared_size_bytes = nbytes
            self._smem_set.add((id(kern), nbytes))
        return kern

    # ---- sparse MoE: kernels/moe_cuda.py (contracts: kernels/moe_reference.py) ----------------------------------
    def moe_route(self, router_logits, top_k, normalize):
        return moe_cuda.route(router_logits, top_k, normalize)

    def moe_route_sigmoid(self, router_logits, bias, top_k, normalize, scale):
        return moe_cuda.route_sigmoid(router_logits, bias, top_k, normalize, scale)

    def moe_permute(self, experts, num_experts):
        return moe_cuda.permute(experts, num_experts)

    def moe_grouped_linear(self, x, weight, offsets, token_of_row=None, bias=None, activation=None):
        rows = token_of_row.shape[0] if token_of_row is not None else x.shape[0]
        stages = moe_gemm_stages(self.tuning, rows=rows, experts=weight.shape[0])
        tile_rows = moe_gemm_rows(self.tuning, rows=rows, experts=weight.shape[0])
        if activation not in _MOE_EPILOGUES:
            raise ValueError(f"moe_grouped_linear: no activation {activation!r} (silu_mul, relu2)")
        epilogue = _MOE_EPILOGUES[activation]
        if epilogue and moe_cuda.fuses(x, weight, bias, epilogue):  # the activation in the GEMM's epilogue
            return moe_cuda.grouped_linear(x, weight, offsets, token_of_row, bias, stages, epilogue, tile_rows)
        out = moe_cuda.grouped_linear(x, weight, offsets, token_of_row, bias, stages, tile_rows=tile_rows)
        return out if activation is None else getattr(self, activation)(out)

    def moe_combine(self, y, position, weights, shared=None, shared_gate=None, scale=1.0):
        return moe_cuda.combine(y, position, weights, shared, shared_gate, out_dtype=self._act, scale=scale)

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
            # call imports numpy.ma (tens of ms, in the first fork of every run's first group)
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
        grid = (max(1, min(-(-max_units // THREADS), 1024)), npairs, len(arrays))
        if few is not None:  # indices as kernel arguments: no host->device copy
            pad = [0] * (8 - npairs)
            kernel("elementwise", f"copy_rows_few_kernel<{utype}>")(
                grid, (THREADS,), (table[0], table[1]) + tuple(i64(i) for i in list(few[0]) + pad)
                + tuple(i64(i) for i in list(few[1]) + pad))
        else:
            kernel("elementwise", f"copy_rows_kernel<{utype}>")(grid, (THREADS,), (table[0], table[1], src_d, dst_d))

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
            kernel("sampling", "feed_tokens_kernel")((blocks_for(n),), (THREADS,),
                                                      (token_ids, cupy.ascontiguousarray(source), previous, i32(n)))

    def apply_token_bitmask(self, logits, bitmask):
        """logits[b, v] = -inf where bit v % 32 of bitmask[b, v // 32] is clear: fp32 logits [B, V] in place (rows
        may be strided, columns contiguous), int32 bitmask [B, W] on the device with W * 32 >= V. One launch of
        one thread per logit, no host sync (structured output's masks, uploaded by the caller)."""
        if logits.dtype != F32 or logits.ndim != 2 or logits.strides[1] != 4 or bitmask.ndim != 2 \
                or bitmask.dtype not in (np.int32, np.uint32) or bitmask.shape[0] != logits.shape[0] \
                or bitmask.shape[1] * 32 < logits.shape[1]:
            raise ValueError(f"apply_token_bitmask: fp32 logits [B, V] with contiguous rows and an int32 bitmask "
                             f"[B, >= V / 32] expected, got {logits.dtype} {logits.shape} {logits.strides} and "
                             f"{bitmask.dtype} {bitmask.shape}")
        b, v = logits.shape
        if b and v:
            mask = cupy.ascontiguousarray(bitmask)
            kernel("sampling", "token_bitmask_kernel")((-(-v // THREADS), b), (THREADS,),
                                                       (logits, mask, i32(v), i64(logits.strides[0] // 4),
                                                        i32(mask.shape[1])))

    def sample_into(self, logits, params, out):
        """`sample` with the parameters already packed on the device (uint32 [8, B], pack_sampling_params; int32
        holding the same bits, as an index buffer written by write_index, is read the same) into
        a preallocated out int64 [B]: no allocation for fp32 logits, no copy, so it can be captured in a graph
        whose replays rewrite `params` in place."""
        logits = logits if logits.dtype == F32 else self._cast(logits, F32)
        logits = last_contiguous(logits)
        b, v = logits.shape
        if params.shape != (8, b) or params.dtype not in (np.uint32, np.int32) or out.shape != (b,) \
                or out.dtype != np.int64:
            raise ValueError(f"sample_into: params uint32/int32 [8, {b}] and out int64 [{b}] expected, got "
                             f"{params.dtype} {params.shape} and {out.dtype} {out.shape}")
        if b == 0:
            return out
        kernel("sampling", "sample_kernel")((b,), (_SAMPLE_THREADS,), (logits, i32(b), i32(v),
                                                                         i64(logits.strides[0] // 4),
                                                                         cupy.ascontiguousarray(params), out))
        return out

    def process_logits(self, logits, edits):
        """The logits-processing stage's edits in place (NumpyOps.process_logits' contract, kernels/logits.cu):
        one launch, one block per row, no host sync."""
        b, v = logits.shape
        if logits.dtype != F32 or logits.strides[1] != 4 or edits.dtype != np.int32:
            raise ValueError(f"process_logits: fp32 logits with contiguous rows and int32 edits expected, got "
                             f"{logits.dtype} {logits.strides} and {edits.dtype}")
        if b:
            kernel("logits", "process_logits_kernel")(
                (b,), (_LOGITS_THREADS,),
                (logits, i32(b), i64(logits.strides[0] // 4), cupy.ascontiguousarray(edits)))
        return logits

    def token_logprobs(self, logits, rows, tokens, k):
        """NumpyOps.token_logprobs' contract on the device (kernels/logits.cu): one launch, one block per row."""
        logits = logits if logits.dtype == F32 else self._cast(logits, F32)
        logits = last_contiguous(logits)
        rows = cupy.ascontiguousarray(cupy.asarray(rows, np.int32))
        tokens = cupy.ascontiguousarray(cupy.asarray(tokens, np.int64))
        if not 0 <= k <= 64:
            raise ValueError(f"token_logprobs: k must be in [0, 64], got {k}")
        out = cupy.empty((rows.shape[0], 1 + 2 * k), np.float32)
        if rows.shape[0]:
            kernel("logits", "token_logprobs_kernel")(
                (rows.shape[0],), (_LOGITS_THREADS,),
                (logits, i32(logits.shape[1]), i64(logits.strides[0] // 4), rows, tokens, i32(k), out))
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
