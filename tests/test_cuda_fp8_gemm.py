"""FP8 GEMMs with block scales on the GPU (kernels/cuda_fp8.py, kernels/cublaslt_fp8.py): the activations'
quantisation kernel bit for bit the host's (kernels/fp8.py quantize_groups), cuBLASLt's block-scaled GEMM against
the fp32 product of the same quantised operands on the 4b-like shapes, its error against the bf16 GEMM of the
dequantised weight, a projection of FP8 and plain parts, and the engine on an FP8 model against its dequantised twin.

Skipped without CuPy and a GPU; the GEMM tests skip (saying why) where cuBLASLt has no block-scaled FP8.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from conftest import new_state, random_prompt  # noqa: E402
from prefixrun.engine.load.loader import load  # noqa: E402
from prefixrun.engine.load.model_maker import make_model_dir  # noqa: E402
from prefixrun.engine.load.quantization import quantize_blocks  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.fp8 import Fp8Matrix, quantize_groups  # noqa: E402
from test_fp8_weights import FP8_QWEN3_5, dequantised_twin  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES_4B = [(18432, 2560), (2560, 9216), (12288, 2560), (2560, 4096)]  # [N, K] of the 4b-like projections
# cuBLASLt's product of the quantised operands against the fp32 one: bf16 output rounding (2^-9 relative) and the
# order of fp32 sums; normwise and worst element, relative to the largest output
EXACT_NORM, EXACT_MAX = 4e-3, 1.6e-2
# the FP8 GEMM against the bf16 GEMM of the dequantised weight: e4m3 activations (3 mantissa bits, about 3.6%
# RMS relative per element) on random data
W8A8_NORM = 0.06
# the tiny FP8 models' weight scale: at PARITY_STD a random model turns the GEMMs' 2.5% error into 40% of its
# logits (emulated on the CPU: quantize_groups before each projection); at 0.02, 13% with 98.6% argmax agreement
FP8_INIT_STD = 0.02


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("bfloat16")


@pytest.fixture(scope="module")
def support():
    from prefixrun.kernels.cublaslt_fp8 import block_fp8_support

    s = block_fp8_support()
    print(f"block-scaled FP8 GEMM: {'supported' if s.supported else 'NOT supported'}: {s.detail}")
    return s


def _require(support):
    if not support.supported:
        pytest.skip(f"no block-scaled FP8 GEMM here: {support.detail}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cols", [300, 304, 2560])  # 300: the scalar path; 304, 2560: 16-byte vectors
def test_the_activation_kernel_quantises_as_the_host_bit_for_bit(dtype, cols, ops):
    from prefixrun.kernels.cuda_fp8 import quantize_activations

    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((37, cols)) * rng.uniform(1e-3, 50, (37, 1))).astype(np.float32)
    x[5] = 0.0
    x[6, 130:200] = 0.0
    host = x.astype(BF16) if dtype == "bfloat16" else x
    q_want, s_want = quantize_groups(host.astype(np.float32))
    wide = ops.upload(np.concatenate([host, host], axis=1), dtype)  # rows strided: every row's first half
    for dev in (ops.upload(host, dtype), wide[:, :cols]):
        q, s = quantize_activations(dev)
        np.testing.assert_array_equal(cupy.asnumpy(q), q_want.view(np.uint8))
        np.testing.assert_array_equal(cupy.asnumpy(s), s_want.T)  # [groups, rows]: rows contiguous


@functools.lru_cache(maxsize=8)
def _weight(n: int, k: int) -> Fp8Matrix:
    """A random FP8 weight [n, k]: e4m3 bytes with bit 3 clear (no NaN pattern) and block scales (one per shape)."""
    rng = np.random.default_rng(n * 7 + k)
    values = (rng.integers(0, 256, (n, k), dtype=np.uint8) & 0xF7).view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-4, 3e-4, (-(-n // 128), -(-k // 128))).astype(np.float32)
    return Fp8Matrix(values, scale, (128, 128))


def _operands(rng, n, k, m):
    """The shape's FP8 weight and bf16 x [m, k]."""
    return _weight(n, k), rng.standard_normal((m, k)).astype(np.float32).astype(BF16)


@pytest.mark.parametrize("n,k", SHAPES_4B)
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_the_block_fp8_gemm_is_the_product_of_its_quantised_operands(n, k, m, ops, support):
    _require(support)
    rng = np.random.default_rng(n + k + m)
    weight, x = _operands(rng, n, k, m)
    w_dq = ops.upload_rows([weight], "float32")  # the exact dequantisation (tests/test_cuda_fp8.py)
    lt = ops.retuned(fp8_weight_only_rows=0)  # cuBLASLt at every row count (by default few rows are weight-only)
    proj = lt.upload_linear([weight])
    got = lt.to_host(lt.linear(lt.upload(x), proj)).astype(np.float32)
    bf16 = ops.to_host(ops.linear(ops.upload(x), ops.upload_rows([weight]))).astype(np.float32)
    from prefixrun.kernels import cuda_fp8

    if (n, k, m) in cuda_fp8._FELL_BACK:  # cuBLASLt refused these rows: the weight-only kernel (or bf16) ran
        print(f"[{n}, {k}] M={m}: cuBLASLt refused; fallback error {np.abs(got - bf16).max() / np.abs(bf16).max():.2e}")
        assert np.abs(got - bf16).max() < 2 ** -7 * np.abs(bf16).max()
        return
    q, s = quantize_groups(x.astype(np.float32))
    x_dq = cupy.asarray(Fp8Matrix(q, s, (1, 128)).dequantize())
    exact = cupy.asnumpy(x_dq @ w_dq.T)  # what the FP8 GEMM computes, in fp32 (cuBLAS sgemm)
    top = np.abs(exact).max()
    norm_err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    worst = np.abs(got - exact).max() / top
    assert norm_err < EXACT_NORM and worst < EXACT_MAX, (norm_err, worst)
    w8a8 = np.linalg.norm(got - bf16) / np.linalg.norm(bf16)
    print(f"[{n}, {k}] M={m}: vs quantised fp32 {norm_err:.2e}, vs bf16 dequantised GEMM {w8a8:.3f}")
    assert w8a8 < W8A8_NORM


@pytest.mark.parametrize("n,k", SHAPES_4B[:2] + [(200, 336)])
@pytest.mark.parametrize("m", [1, 64])
def test_the_weight_only_kernel_is_the_bf16_product_with_the_dequantised_weight(n, k, m, ops):
    """fp8w_gemm_kernel (tuning.fp8_weight_only_rows): the rows as they are times the weight's dequantisation
    rounded to bf16 (what the bf16 path computes), K split where its tiles are few, into a column range."""
    from prefixrun.kernels.cuda_fp8 import upload_block, weight_only_gemm

    rng = np.random.default_rng(n + k + m)
    weight, x = _operands(rng, n, k, m)
    w_bf16 = ops.upload_rows([weight])  # the exact dequantisation rounded to bf16 (tests/test_cuda_fp8.py)
    want = ops.to_host(ops.logits(ops.upload(x), w_bf16))  # fp32 out: cuBLAS over the same bf16 operands
    out = ops.upload(np.full((m, n + 16), 3.0, np.float32))
    weight_only_gemm(ops.upload(x), upload_block([weight]), out, 8, ops._sm_count)
    got = ops.to_host(out).astype(np.float32)
    assert (got[:, :8] == 3.0).all() and (got[:, 8 + n:] == 3.0).all()
    err = np.abs(got[:, 8:8 + n] - want).max() / np.abs(want).max()
    assert err < 2 ** -7, err  # the bf16 rounding of the output and the order of fp32 sums
    # through `linear` where the tuning sends these rows to it (a projection kept FP8 needs cuBLASLt's support)
    tuned = ops.retuned(fp8_weight_only_rows=64)
    proj = tuned.upload_linear([weight])
    via = tuned.to_host(tuned.linear(tuned.upload(x), proj)).astype(np.float32)
    assert np.abs(via - want).max() / np.abs(want).max() < 2 ** -7


def test_a_projection_of_fp8_and_plain_parts_writes_each_segment_s_columns(ops, support):
    _require(support)
    from prefixrun.kernels.cuda_fp8 import Fp8Block, ProjectionWeight

    rng = np.random.default_rng(5)
    a, _ = _operands(rng, 384, 256, 1)
    b, _ = _operands(rng, 200, 256, 1)  # ragged: ends a's run
    plain = (rng.standard_normal((24, 256)) * 0.02).astype(np.float32)
    c, _ = _operands(rng, 128, 256, 1)
    channel = Fp8Matrix(*quantize_blocks(plain, (1, 256)), (1, 256))  # off the grid: dequantised
    parts = [a, b, plain, c, channel]
    proj = ops.upload_linear(parts)
    assert isinstance(proj, ProjectionWeight) and proj.shape == (760, 256)
    assert [(row, isinstance(seg, Fp8Block)) for row, seg in proj.segments] == [(0, True), (584, False), (608, True),
                                                                                (736, False)]
    x = rng.standard_normal((50, 256)).astype(np.float32).astype(BF16)
    q, s = quantize_groups(x.astype(np.float32))
    x_dq = Fp8Matrix(q, s, (1, 128)).dequantize()
    from prefixrun.kernels import cuda_fp8

    # 50 rows: the weight-only kernels under the default tuning (x as it is), cuBLASLt's path (x quantised) without
    for tuned in (ops, ops.retuned(fp8_weight_only_rows=0)):
        got = tuned.to_host(tuned.linear(tuned.upload(x), proj)).astype(np.float32)
        row = 0
        for p in parts:
            w = p.dequantize() if isinstance(p, Fp8Matrix) else p
            seg_rows = next(seg.shape[0] for r, seg in reversed(proj.segments) if r <= row)
            # weight-only: 50 rows within the tuning's, or a segment of at most 128 weight rows (cuda_fp8.py)
            weight_only = tuned.tuning.fp8_weight_only_rows >= 50 or (tuned.tuning.fp8_weight_only_rows > 0
                                                                        and seg_rows <= 128)
            fp8 = isinstance(p, Fp8Matrix) and p.block == (128, 128) and not weight_only
            fp8 = fp8 and not any(key[2] == 50 for key in cuda_fp8._FELL_BACK)  # refused: the weight-only kernel ran
            want = (x_dq if fp8 else x.astype(np.float32)) @ w.astype(BF16).astype(np.float32).T
            part = got[:, row:row + w.shape[0]]
            # norm-wise (bf16 rounding of the weight and the output, fp32 sums), and no element far off
            assert np.linalg.norm(part - want) / np.linalg.norm(want) < 1e-2, (row, fp8)
            assert np.abs(part - want).max() < 4e-2 * np.abs(want).max(), (row, fp8)
            row += w.shape[0]


@pytest.mark.parametrize("m", [1, 33])
def test_cublas_writes_a_plain_segment_into_its_columns_of_a_wider_output(ops, m):
    """The GEMM of a projection's plain segment goes straight into its column range (row stride of the whole
    output): the columns equal the product into a buffer of its own, the others are untouched; an output whose
    columns are not contiguous is refused."""
    rng = np.random.default_rng(m)
    x = cupy.asarray(rng.standard_normal((m, 256)).astype(np.float32).astype(BF16).view(np.uint16)).view(BF16)
    w = cupy.asarray(rng.standard_normal((40, 256)).astype(np.float32).astype(BF16).view(np.uint16)).view(BF16)
    own = cupy.empty((m, 40), BF16)
    ops._blas.gemm_nt(x, w, own)
    wide = cupy.asarray(np.full((m, 100), 7.0, np.float32).astype(BF16).view(np.uint16)).view(BF16)
    ops._blas.gemm_nt(x, w, wide[:, 24:64])
    got, want = ops.to_host(wide).astype(np.float32), ops.to_host(own).astype(np.float32)
    np.testing.assert_allclose(got[:, 24:64], want, rtol=1e-2, atol=1e-2)
    assert (got[:, :24] == 7).all() and (got[:, 64:] == 7).all()
    if m > 1:
        with pytest.raises(ValueError, match="unit column stride"):
            ops._blas.gemm_nt(x, w, wide[:, ::2][:, :40])


def test_an_fp8_model_on_the_gpu_stays_close_to_its_dequantised_twin(ops, support, tmp_path):
    """With FP8 GEMMs the logits differ from the dequantised twin's by the activations' FP8 rounding: the error
    and the greedy agreement are printed for the record and bounded; float32 storage keeps the exact path."""
    fp8_dir = make_model_dir(tmp_path / "block", FP8_QWEN3_5, seed=7, init_std=FP8_INIT_STD, fp8="block")
    twin = dequantised_twin(fp8_dir, tmp_path / "block-dq")
    prompt = random_prompt(3, 70)
    for dtype in ("bfloat16", "float32"):
        logits = []
        for path in (fp8_dir, twin):
            loaded = load(path, "cuda", dtype)
            state = new_state(loaded.model, loaded.ops)
            out = loaded.model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True)
            logits.append(loaded.ops.to_host(out).astype(np.float32))
        if dtype == "float32":  # no FP8 GEMM in fp32 storage: the exact dequantisation on both sides
            np.testing.assert_array_equal(logits[0], logits[1])
            continue
        err = np.linalg.norm(logits[0] - logits[1]) / np.linalg.norm(logits[1])
        agree = float((logits[0].argmax(-1) == logits[1].argmax(-1)).mean())
        print(f"FP8 tiny model vs dequantised twin (bf16): logits error {err:.4f}, argmax agreement {agree:.3f} "
              f"(FP8 GEMM {'on' if support.supported else 'off'})")
        if not support.supported:
            np.testing.assert_array_equal(logits[0], logits[1])
        else:
            assert err < 0.25 and agree >= 0.85


def test_the_engine_on_an_fp8_model_gives_the_greedy_tokens_of_its_twin_mostly(support, tmp_path):
    from conftest import run_tokens

    _require(support)
    fp8_dir = make_model_dir(tmp_path / "block", FP8_QWEN3_5, seed=9, init_std=FP8_INIT_STD, fp8="block")
    twin = dequantised_twin(fp8_dir, tmp_path / "block-dq")
    prompts = [random_prompt(40 + i, 30 + 7 * i) for i in range(8)]
    got = [run_tokens(load(path, "cuda", "bfloat16"), prompts, max_tokens=16)[0] for path in (fp8_dir, twin)]
    same = sum(a == b for key in got[1] for a, b in zip(got[0][key], got[1][key]))
    total = sum(len(v) for v in got[1].values())
    # greedy tokens agree until the first near-tie flips; count matching positions (decode through graphs included)
    first = [next((i for i, (a, b) in enumerate(zip(got[0][k], got[1][k])) if a != b), len(got[1][k])) for k in got[1]]
    print(f"FP8 engine vs dequantised twin: {same}/{total} greedy tokens equal; first difference at {first}")
    assert sum(first) >= 0.6 * total
