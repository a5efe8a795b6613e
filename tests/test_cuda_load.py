"""Weights and restored state reach the device byte for byte, fast (kernels/upload.py, CudaOps.upload_rows).

Skipped without CuPy and a GPU. `PREFIXRUN_LOAD_MODEL=DIR` (e.g. a `prefixrun make-model --config
bench/models/qwen3_5-4b-like.json` folder) also times a whole model load with the files in the page cache
and prints it; PREFIXRUN_LOAD_SECONDS (default 2.5) is the bound it must meet.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from conftest import write_tensors  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("bfloat16")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("n", [1, 1000, (4 << 20) // 2 - 1, 5_000_003, 70_000_001])  # to 140 MB: several chunks
def test_bf16_arrives_bit_exact(ops, n):
    from prefixrun.kernels import upload

    assert 70_000_001 * 2 > 2 * upload.CHUNK_BYTES  # the largest case wraps around both staging buffers
    rng = np.random.default_rng(n)
    host = rng.standard_normal(n, dtype=np.float32).astype(BF16).reshape(-1, 1) if n > 1 else np.ones((1, 1), BF16)
    dev = ops.upload(host)
    assert dev.dtype == BF16 and dev.shape == host.shape
    assert np.array_equal(_bits(ops.to_host(dev)), _bits(host))


def test_memmap_slices_and_fp32_conversion(ops, tmp_path):
    """A slice of a memory-mapped file (as safetensors tensors are) uploads as stored; fp32 converts to bf16 on the
    device exactly as the host conversion (round to nearest even); fp32 kept fp32 is exact."""
    rng = np.random.default_rng(0)
    raw = rng.standard_normal(12_000_000, dtype=np.float32)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[4 * 1000:4 * 11_001_000].view(np.float32).reshape(-1, 1000)  # [11000, 1000], offset start
    as_bf16 = ops.upload(view)
    assert np.array_equal(_bits(ops.to_host(as_bf16)), _bits(np.asarray(view).astype(BF16)))
    as_f32 = ops.upload(view, np.float32)
    assert np.array_equal(ops.to_host(as_f32), np.asarray(view))
    # usable at once on the compute stream: a reduction right after the upload sees every byte
    assert float(cupy.asnumpy(as_f32.sum(dtype=np.float64))) == pytest.approx(float(np.asarray(view, np.float64).sum()))


def test_upload_rows_is_the_concatenation(ops):
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((r, 640), dtype=np.float32).astype(BF16) for r in (4096, 1, 3000, 0, 9000)]
    got = ops.to_host(ops.upload_rows(parts))
    assert np.array_equal(_bits(got), _bits(np.concatenate(parts)))
    with pytest.raises(ValueError, match="do not stack"):
        ops.upload_rows([np.zeros((2, 3), BF16), np.zeros((2, 4), BF16)])


def _arrays(obj, prefix="", seen=None):
    """Every numpy/cupy array reachable from a model object's attributes, by attribute path."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    if isinstance(obj, (np.ndarray, cupy.ndarray)):
        return {prefix: obj}
    out = {}
    items = (enumerate(obj) if isinstance(obj, (list, tuple)) else
             vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, type) else ())
    for k, v in items:
        if k in ("ops", "cfg", "load"):
            continue
        out.update(_arrays(v, f"{prefix}.{k}", seen))
    return out


def test_model_weights_equal_the_cpu_load(ops, model_dirs):
    """Every weight of a (bf16-stored) model loaded on the GPU equals the CPU load rounded to the storage dtype."""
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.reference import NumpyOps

    for family, path in model_dirs.items():
        gpu = _arrays(load_model(path, ops)[0])
        cpu = _arrays(load_model(path, NumpyOps())[0])
        common = gpu.keys() & cpu.keys()  # a backend may cache extra arrays of its own; the weights are common
        assert len(common) > 10 and len(common) >= 0.9 * len(cpu), (family, sorted(cpu.keys() - gpu.keys())[:5])
        for name in sorted(common):
            d = gpu[name]
            want = cpu[name]
            got = ops.to_host(d)
            assert got.shape == want.shape, (family, name)
            assert np.array_equal(np.asarray(got, np.float32), np.asarray(want).astype(got.dtype).astype(np.float32)), \
                (family, name)


@pytest.mark.skipif(not os.environ.get("PREFIXRUN_LOAD_MODEL"), reason="set PREFIXRUN_LOAD_MODEL=DIR to time a load")
def test_real_size_load_time(ops):
    from prefixrun.engine.models import load_model
    from prefixrun.engine.load.weights import CheckpointTensors

    path = Path(os.environ["PREFIXRUN_LOAD_MODEL"])
    tensors = CheckpointTensors(path)
    nbytes = sum(f.path.stat().st_size for f in tensors.files)
    for f in tensors.files:  # into the page cache, as a second run finds them
        with open(f.path, "rb") as fh:
            while fh.read(64 << 20):
                pass
    ops.synchronize()
    t0 = time.perf_counter()
    model, _ = load_model(path, ops)
    ops.synchronize()
    seconds = time.perf_counter() - t0
    print(f"\nload {path.name}: {nbytes / 1e9:.2f} GB in {seconds:.2f} s ({nbytes / seconds / 1e9:.1f} GB/s)")
    # spot-check content: the LM head as stored
    for head in [n for n in ("lm_head.weight", "model.embed_tokens.weight") if n in tensors][:1]:
        stored = tensors.get(head)
        assert np.array_equal(_bits(ops.to_host(model.lm_head)[:64]), _bits(np.asarray(stored[:64]).astype(BF16)))
    assert seconds <= float(os.environ.get("PREFIXRUN_LOAD_SECONDS", "2.5"))


def test_kernels_load_in_the_background_while_ops_run():
    """A fresh process: prepare_kernels returns at once, an op used meanwhile waits for (or loads) its module and
    gives the reference's answer, a GEMM meanwhile (cuBLAS warming up on the loader thread's own handle) too, and
    the thread ends with every prepared module loaded."""
    import subprocess
    import sys

    code = """
import numpy as np, time
from prefixrun.kernels import cuda, cuda_modules
from prefixrun.kernels.reference import NumpyOps
assert not cuda_modules._MODULES.keys()
ops = cuda.CudaOps("float32")
t0 = time.perf_counter()
ops.prepare_kernels()
ops.prepare_kernels()  # one loader
assert time.perf_counter() - t0 < 1.0, "prepare_kernels must not block"
x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
w = np.linspace(0.5, 1.5, 64, dtype=np.float32)
got = ops.to_host(ops.rms_norm(ops.upload(x), ops.upload(w), 1e-6))
np.testing.assert_allclose(got, NumpyOps().rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
a = np.random.default_rng(1).standard_normal((7, 48)).astype(np.float32)  # a GEMM while cuBLAS warms up there
b = np.random.default_rng(2).standard_normal((33, 48)).astype(np.float32)
np.testing.assert_allclose(ops.to_host(ops.linear(ops.upload(a), ops.upload(b))), a @ b.T, rtol=1e-5, atol=1e-5)
ops._preparing.join(timeout=600)
assert not ops._preparing.is_alive()
dev = cuda.cupy.cuda.Device().id
missing = [u.key for f in cuda_modules.PREPARED_FILES for u in cuda_modules.UNITS[f]
           if not cuda_modules._MODULES.made((dev, u.key))]
assert not missing, missing
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_weights_read_ahead_equal_the_cpu_load(model_dirs):
    """The loader's path (pinned ring, DMAs on their own stream, kernels/cuda_weight_reads.py): every weight equals
    the CPU load rounded to the storage dtype, and the read-ahead served the build."""
    from prefixrun.engine.load import loader
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.reference import NumpyOps

    for family, path in model_dirs.items():
        loading = loader.start_load(path, "cuda")
        loaded = loading.finish()
        assert loading.weight_reads["error"] is None and loading.weight_reads["taken_bytes"] > 0, family
        gpu, cpu = _arrays(loaded.model), _arrays(load_model(path, NumpyOps())[0])
        common = gpu.keys() & cpu.keys()
        assert len(common) > 10, family
        for name in sorted(common):
            got = loaded.ops.to_host(gpu[name])
            want = np.asarray(cpu[name]).astype(got.dtype)
            assert got.shape == want.shape and np.array_equal(_bits(got), _bits(want)), (family, name)


def test_read_ahead_with_a_small_ring_and_window(ops, tmp_path, monkeypatch):
    """Chunks that wrap the ring many times and a window smaller than a tensor: every byte lands, in any order."""
    from prefixrun.kernels import cuda_weight_reads

    monkeypatch.setattr(cuda_weight_reads, "BUFFER_BYTES", 1 << 20)
    monkeypatch.setattr(cuda_weight_reads, "WINDOW_BYTES", 1 << 20)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((n, 512), dtype=np.float32).astype(BF16) for n in (3000, 1, 777, 4096, 0, 5)]
    reads = ops.read_weights(write_tensors(tmp_path / "w.bin", arrays))
    for i in (3, 0, 5, 1, 2, 4):
        got = reads.take(f"t{i}")
        assert got.dtype == BF16 and np.array_equal(_bits(ops.to_host(got)), _bits(arrays[i])), i
    assert reads.close().error is None
    parts = [cupy.asarray(arrays[0].view(np.uint16)).view(BF16), arrays[2], cupy.asarray(arrays[3].astype(np.float32))]
    stacked = ops.upload_rows(parts)  # device parts, a host part and an fp32 part converted on the device
    want = np.concatenate([arrays[0], arrays[2], arrays[3]])
    assert np.array_equal(_bits(ops.to_host(stacked)), _bits(want))
