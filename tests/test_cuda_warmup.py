"""The background warm-up of CudaOps.prepare_kernels (kernels/cuda_warmup.py) on the GPU: it loads every function
of the prepared modules and runs the model's planned GEMMs on scratch, it never changes a result (the same
logits, bit for bit, before and after; the weights untouched; GEMMs beside it exact), its scratch stays free in the
pool for the engine, and a failing warm-up costs nothing but its account (also after GEMMs on streams that are
gone). Skipped without CuPy and a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from conftest import new_state, random_prompt  # noqa: E402
from prefixrun.engine.load.hf_config import load_config  # noqa: E402
from prefixrun.engine.models import load_model  # noqa: E402
from prefixrun.engine.load.gemm_plan import model_plan  # noqa: E402
from prefixrun.engine.load.weights import CheckpointTensors  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.warmup import GemmShape, KernelPlan, row_ladder  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def _prepare(ops, plan_fn):
    """The loader thread's body, run here (so the test sees its end); returns its account."""
    from prefixrun.kernels import cuda_modules, cuda_warmup

    cuda_warmup.prepare(cupy.cuda.Device().id, ops.act_dtype, plan_fn, cuda_modules.PREPARED_FILES)
    return cuda_warmup.LAST


def _logits(model, ops):
    """fp32 logits [3, V] of a prefill of three sequences, then [3, V] of a decode step, as host arrays."""
    state = new_state(model, ops, block_size=ops.default_block_size)
    hs = [state.new_sequence() for _ in range(3)]
    prefill = model.forward(state.prepare_step(hs, [random_prompt(i, n) for i, n in enumerate((70, 9, 131))]), state)
    decode = model.forward(state.prepare_step(hs, [[1], [2], [3]]), state)
    return ops.to_host(prefill), ops.to_host(decode)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_warmup_changes_no_result(model_dirs, dtype):
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps(dtype)
    path = model_dirs["qwen3_5"]
    model = load_model(path, ops)[0]
    weights = [ops.to_host(a).view(np.uint8).copy() for a in (model.lm_head, model.layers[0].mlp.gate_up)]
    before = _logits(model, ops)
    cfg, _ = load_config(path)
    account = _prepare(ops, lambda: model_plan(cfg, CheckpointTensors(path), ops.act_dtype, max_step_tokens=512))
    assert not account["errors"] and account["gemm_calls"] > 0 and account["gemms_left_out"] == 0
    after = _logits(model, ops)
    for b, a in zip(before, after):
        assert np.array_equal(b.view(np.uint8), a.view(np.uint8))
    for w, a in zip(weights, (model.lm_head, model.layers[0].mlp.gate_up)):
        assert np.array_equal(ops.to_host(a).view(np.uint8), w)


def test_every_prepared_function_is_loaded():
    from prefixrun.kernels import cuda, cuda_modules

    ops = cuda.CudaOps("bfloat16")
    account = _prepare(ops, None)
    assert not account["errors"], account["errors"]
    dev = cupy.cuda.Device().id
    missing = [(f, n) for f in cuda_modules.PREPARED_FILES for n in cuda_modules.KERNEL_NAMES[f]
               if (dev, f, n) not in cuda_modules._FUNCTIONS]
    assert not missing, missing[:5]


def test_scratch_is_left_free_in_the_pool_for_the_engine():
    """The products' scratch ends up free in the device pool, in the arena the engine's thread allocates from: an
    activation of that size afterwards is cut from it, without growing the pool."""
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    _prepare(ops, None)  # modules and cuBLAS set up first
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    used = pool.used_bytes()
    plan = KernelPlan((GemmShape(16384, 8192, row_ladder(2048)), GemmShape(32000, 4096, (1, 64), "float32")))
    account = _prepare(ops, lambda: plan)  # a 256 MiB weight stand-in, 32 + 64 MiB of input and output
    assert not account["errors"] and account["gemm_calls"] == len(row_ladder(2048)) + 2
    assert pool.used_bytes() == used and pool.free_bytes() >= 256 << 20
    total = pool.total_bytes()
    activation = cupy.empty(200 << 20, np.uint8)
    assert pool.total_bytes() == total
    del activation


def test_gemms_beside_a_warmup_are_exact_and_stop_it():
    """The warm-up shares the process's cuBLAS handle (and its workspace) with the engine: GEMMs issued while it runs
    give exactly the answers they give alone, and the warm-up stops at the first of them."""
    import threading

    from prefixrun.kernels import cuda_modules, cuda_warmup
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    rng = np.random.default_rng(4)
    pairs = [(rng.standard_normal((m, 512)).astype(np.float32), rng.standard_normal((384, 512)).astype(np.float32))
             for m in (1, 7, 300, 2048)]
    alone = [ops.to_host(ops.linear(ops.upload(a), ops.upload(w))) for a, w in pairs]
    plan = KernelPlan((GemmShape(8192, 4096, row_ladder(8192)), GemmShape(4096, 8192, row_ladder(8192))))
    thread = threading.Thread(target=cuda_warmup.prepare, args=(cupy.cuda.Device().id, ops.act_dtype, lambda: plan,
                                                              cuda_modules.PREPARED_FILES))
    thread.start()
    while cuda_warmup.LAST.get("gemm_calls", 0) < 3 and thread.is_alive():
        pass  # until the warm-up is among its products
    beside = [ops.to_host(ops.linear(ops.upload(a), ops.upload(w))) for a, w in pairs]
    thread.join(timeout=600)
    account = cuda_warmup.LAST
    assert not account["errors"], account["errors"]
    assert account["gemms_stopped"] or account["gemm_calls"] == 2 * len(row_ladder(8192))
    for a, b in zip(alone, beside):
        assert np.array_equal(a, b)


def test_warmup_after_gemms_on_a_stream_that_is_gone():
    """The handle's last GEMM went to a stream that no longer exists (a graph capture's, a run ago): the warm-up
    neither touches that stream nor leaves the handle bound to its own, gone at its end."""
    import gc

    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    rng = np.random.default_rng(6)
    a, w = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    da, dw = ops.upload(a), ops.upload(w)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ops.linear(da, dw)
    stream.synchronize()
    del stream
    gc.collect()
    account = _prepare(ops, lambda: KernelPlan((GemmShape(64, 32, (1, 8)),)))
    assert not account["errors"] and account["gemm_calls"] == 2
    np.testing.assert_allclose(ops.to_host(ops.linear(da, dw)), a @ w.T, rtol=1e-5, atol=1e-5)


def test_a_failing_warmup_is_harmless(monkeypatch):
    from prefixrun.kernels.cublas import Cublas
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")

    def broken_plan():
        raise RuntimeError("no plan today")

    account = _prepare(ops, broken_plan)
    assert any("no plan today" in e for e in account["errors"]) and account["gemm_calls"] == 0
    huge = KernelPlan((GemmShape(1 << 20, 1 << 20, (1,)),))  # a 4 TB weight: left out, not attempted
    account = _prepare(ops, lambda: huge)
    assert account["gemms_left_out"] == 1 and account["gemm_calls"] == 0 and not account["errors"]

    def failing_gemm(self, *a, **k):
        raise RuntimeError("cuBLAS says no")

    monkeypatch.setattr(Cublas, "gemm_nt", failing_gemm)
    account = _prepare(ops, lambda: KernelPlan((GemmShape(64, 32, (1, 8)),)))
    assert any("cuBLAS says no" in e for e in account["errors"])
    monkeypatch.undo()
    a = np.random.default_rng(0).standard_normal((7, 32)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    np.testing.assert_allclose(ops.to_host(ops.linear(ops.upload(a), ops.upload(w))), a @ w.T, rtol=1e-5, atol=1e-5)


def test_loader_warms_up_in_a_fresh_process(model_dirs):
    """The user's path: `load` starts the thread with the model's plan; it ends without errors, having run the
    plan's products, and the run's tokens are the ones a process without the warm-up computes."""
    import subprocess
    import sys

    code = """
import sys, numpy as np
from prefixrun.engine.load import loader
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.kernels import cuda, cuda_warmup
if sys.argv[2] == "off":
    cuda.CudaOps.prepare_kernels = lambda self, plan=None: None
outs = []
for run in range(2):  # the second load warms up after the first run's graphs and their streams are gone
    m = loader.load(sys.argv[1], "cuda", "bfloat16", max_step_tokens=256, max_batch=8)
    if sys.argv[2] == "on":
        m.ops._preparing.join(timeout=600)
        acc = cuda_warmup.LAST
        assert not acc["errors"] and acc["gemm_calls"] > 0 and acc["gemms_left_out"] == 0, acc
    eng = Engine(m.model, m.ops, options=EngineOptions(speculative="off",
                                                       max_batch=8, block_size=m.ops.default_block_size))
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(3)
    reqs = [Request(f"r{i}", rng.integers(0, 500, 20 + 37 * i).tolist(), sp, i) for i in range(5)]
    outs.append(sorted((r.custom_id, r.token_ids) for r in eng.run(reqs)))
    eng.close()
assert outs[0] == outs[1]
print(outs[1])
"""
    outs = {}
    for mode in ("on", "off"):
        res = subprocess.run([sys.executable, "-c", code, str(model_dirs["qwen3_5"]), mode], capture_output=True,
                             text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[mode] = res.stdout.strip().splitlines()[-1]
    assert outs["on"] == outs["off"]
