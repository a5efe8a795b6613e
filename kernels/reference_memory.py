"""The CPU backend's memory ops (kernels/reference.py `NumpyOps`): uploads, index buffers and host copies, where the
device is the host (arrays are NumPy's, copies are made at once)."""
from __future__ import annotations

import numpy as np

from prefixrun.kernels.fp8 import Fp8Matrix
from prefixrun.kernels.mxfp4 import dequantize_mxfp4
from prefixrun.kernels.weight_reads import HostLanding, WeightReads

_READ_THREADS = 2  # the CPU backend's models are small; its cores compute
_READ_WINDOW = 1 << 30  # bytes read ahead of the build at most


class HostMemoryOps:
    """`NumpyOps`' memory ops (its `act_dtype`)."""

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.act_dtype)

    def upload(self, host_array, dtype=None):
        """Host array -> backend array (a copy, converted to `dtype` or the activation dtype)."""
        return np.array(host_array, dtype=dtype or self.act_dtype, copy=True)

    def upload_rows(self, host_parts, dtype=None):
        """Host arrays [n_i, ...] (or FP8 matrices: kernels/fp8.py, dequantised) -> their concatenation along axis 0,
        converted to `dtype` or the activation dtype."""
        parts = [p.dequantize() if isinstance(p, Fp8Matrix) else np.asarray(p) for p in host_parts]
        return np.concatenate(parts, axis=0).astype(dtype or self.act_dtype, copy=False)

    def upload_permuted(self, part, view_shape, axes):
        """Converted first, then one strided copy (converting a strided bf16 view is NumPy's slow path)."""
        a = np.asarray(part).astype(self.act_dtype)
        return np.ascontiguousarray(a.reshape(view_shape).transpose(axes))

    def upload_mxfp4(self, blocks, scales):
        return dequantize_mxfp4(blocks, scales).astype(self.act_dtype, copy=False)

    def upload_linear(self, host_parts):
        """A projection's weight: `upload_rows` (FP8 parts exactly dequantised, the reference's fp32)."""
        return self.upload_rows(host_parts)

    def read_weights(self, spans):
        """The weights read by a few threads into host arrays (kernels/weight_reads.py), the build converting each
        as it takes it; the memory-mapped path is the caller's fallback."""
        return WeightReads(list(spans), HostLanding(), threads=_READ_THREADS, window_bytes=_READ_WINDOW)

    def upload_index(self, host_array):
        return np.ascontiguousarray(host_array, dtype=np.int32)

    def write_index(self, dst, host_array):
        """Overwrite an existing index buffer in place (graph inputs are updated this way)."""
        dst[...] = host_array

    def upload_into(self, pairs):
        """Plain copies (same shape and item size; a bf16/fp32 mismatch is refused, not converted)."""
        for dst, host_array in pairs:
            if tuple(dst.shape) != tuple(np.shape(host_array)) or dst.dtype.itemsize != host_array.dtype.itemsize:
                raise ValueError(f"upload_into: {host_array.dtype} {np.shape(host_array)} into {dst.dtype} "
                                 f"{dst.shape}")
            dst[...] = host_array

    def upload_ahead(self, arrays):
        """The arrays themselves: they are in the memory this backend computes in (the caller does not change them)."""
        return list(arrays)

    def to_host(self, array) -> np.ndarray:
        return np.asarray(array)

    def to_host_later(self, array):
        """The copy is made now (the device is the host: nothing is queued)."""
        copied = np.array(array, copy=True)
        return lambda: copied

    def start_host_copy(self, arrays):
        """The copies are made now (the caller changes the arrays next); the function only hands them over."""
        copied = [np.array(a, copy=True) for a in arrays]
        return lambda: copied

    def synchronize(self):
        pass
