"""CUDA activation and bias ops that config fidelity added (exact-erf GELU, the GLU family as the MLP selects it,
fp32 biases on strided GEMM outputs) vs the NumPy reference. Skipped cleanly without CuPy or a GPU.

Bounds as in test_cuda_kernels.py: 1e-5 norm-relative on the fp32 backend, 1e-2 on bf16 (the reference sees the
same bf16-rounded inputs, so only the GPU's own rounding counts).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.engine.models.layers import ACTIVATIONS  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def ref():
    return NumpyOps()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ops(request):
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps(request.param)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _rounded(ops, x):
    return np.asarray(x, np.float32).astype(np.dtype(ops.act_dtype)).astype(np.float32)


def _host(ops, a):
    return np.asarray(ops.to_host(a)).astype(np.float32)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_glu_activations_match_reference(ops, ref, activation):
    rng = np.random.default_rng(3)
    # gates over the whole useful range, including large negative ones where 1 + erf cancels
    gu = _rounded(ops, rng.standard_normal((17, 2 * 48)) * 4.0)
    glu = ACTIVATIONS[activation]
    got = _host(ops, glu(ops, ops.upload(gu)))
    assert got.shape == (17, 48)
    assert _rel(got, glu(ref, gu)) <= TOL[ops.dtype_name]


def test_exact_gelu_differs_from_tanh_gelu_on_the_device(ops):
    """The two GELUs differ by up to ~1e-3 absolute near |x| ~ 2; the device must not compute one for the other."""
    g = np.linspace(-4, 4, 64, dtype=np.float32)
    gu = np.concatenate([g, np.ones_like(g)])[None]
    exact = _host(ops, ops.gelu_mul(ops.upload(gu)))
    tanh = _host(ops, ops.gelu_tanh_mul(ops.upload(gu)))
    if ops.dtype_name == "float32":
        assert np.abs(exact - tanh).max() > 1e-4


def test_gelu_on_a_strided_gate_up_view(ops, ref):
    """The MLP's gate_up may be a column slice of a wider GEMM output (bias folded or not)."""
    rng = np.random.default_rng(5)
    wide = _rounded(ops, rng.standard_normal((9, 2 * 32 + 7)) * 3.0)
    got = _host(ops, ops.gelu_mul(ops.upload(wide)[:, :64]))
    assert _rel(got, ref.gelu_mul(wide[:, :64])) <= TOL[ops.dtype_name]


def test_fp32_bias_on_projection_outputs(ops, ref):
    """o_proj / MLP biases are fp32 vectors added to activation-dtype GEMM outputs; the result keeps the
    activation dtype."""
    rng = np.random.default_rng(6)
    x = _rounded(ops, rng.standard_normal((11, 40)))
    bias = rng.standard_normal(40).astype(np.float32)
    got = ops.add(ops.upload(x), ops.upload(bias, np.float32))
    assert got.dtype == np.dtype(ops.act_dtype)
    assert _rel(_host(ops, got), ref.add(x, bias)) <= TOL[ops.dtype_name]
