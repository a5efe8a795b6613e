"""The gated delta rule's decode kernel (kernels/delta_rule.cu gdn_decode_kernel) on the GPU against the NumPy
reference: both block widths, both storage types, decode batches with an empty sequence and padding rows on a
shared scratch slot, several tokens per sequence, grouped key heads passed as strided views, a decay that clears
the state, non-zero initial states; the previous token-stepped kernel on the same inputs; and a CUDA-graph replay.
Bounds as tests/test_cuda_kernels.py's TOL_SEQ (fp32 1e-5; bf16 2e-2, the same bf16-rounded inputs given to the
reference). Skipped without CuPy and a GPU; the emulated test (tests/test_delta_decode_emulated.py) runs in CI."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from prefixrun.kernels.tuning import GDN_DECODE_BLOCKS, delta_rule_launch  # noqa: E402
from test_cuda_kernels import rel  # noqa: E402 - ||a - b|| / ||b||, shapes checked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


class _Step:
    """One step's inputs: q and k strided views of [T, 2 Hk, Dk] (as the layer passes them), rounded to the
    storage type so the reference sees what the GPU sees."""

    def __init__(self, ops, lens, hk, h, dk, dv, nslots, slots, seed):
        rng = np.random.default_rng(seed)
        self.lens, self.h, self.hk = list(lens), h, hk
        self.cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = int(self.cu[-1])
        qk = rng.standard_normal((t, 2 * hk, dk)).astype(np.float32)
        qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
        rnd = lambda a: ops.to_host(ops.upload(a)).astype(np.float32)  # the storage type's rounding
        self.qk = rnd(qk)
        self.v = rnd(rng.standard_normal((t, h, dv)).astype(np.float32))
        self.g = (-np.abs(rng.standard_normal((t, h))) * 0.3).astype(np.float32)
        self.g[0, 0] = -200.0  # exp underflows to 0: that head's state is cleared by its first token
        self.beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
        self.state0 = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
        self.slots = np.asarray(slots, np.int32)

    def run(self, ops, d_state):
        d_qk = ops.upload(self.qk)
        return ops.gated_delta_rule(d_qk[:, :self.hk], d_qk[:, self.hk:], ops.upload(self.v),
                                    ops.upload(self.g, np.float32), ops.upload(self.beta, np.float32), d_state,
                                    ops.upload_index(self.slots), ops.upload_index(self.cu))

    def reference(self, seqs):
        """(o, state) of the reference over sequences `seqs` only (each alone, in order)."""
        state = self.state0.copy()
        o = np.zeros(self.v.shape, np.float32)
        ref = NumpyOps()
        for b in seqs:
            s, e = int(self.cu[b]), int(self.cu[b + 1])
            o[s:e] = ref.gated_delta_rule(self.qk[s:e, :self.hk], self.qk[s:e, self.hk:], self.v[s:e], self.g[s:e],
                                          self.beta[s:e], state, self.slots[b:b + 1], np.array([0, e - s]))
        return o, state


def _decode_ops(ops, block):
    """ops with the decode kernel forced on (any token count per sequence), `block` (warps, value columns; None:
    the default)."""
    return ops.retuned(gdn_decode=True, gdn_decode_block=block, gdn_chunked=False, gdn_tensor_cores=False)


@pytest.mark.parametrize("block", GDN_DECODE_BLOCKS)
@pytest.mark.parametrize("lens,hk,h,dk,dv", [
    ([1] * 9 + [0, 1, 1], 4, 8, 128, 128),  # decode; the last two rows are padding on scratch slot 0
    ([2, 1, 3, 0], 2, 4, 64, 40),  # several tokens per sequence; columns past Dv idle
    ([1, 1], 1, 2, 100, 260),  # key dim padded to 128; three 128-column tiles, the last partial
])
def test_decode_kernel_matches_the_reference(ops, block, lens, hk, h, dk, dv):
    nslots = len(lens) + 3
    real = [b for b in range(len(lens)) if lens[b] and not (len(lens) == 12 and b >= 10)]
    slots = np.random.default_rng(len(lens)).permutation(np.arange(1, nslots))[:len(lens)]
    if len(lens) == 12:
        slots[10:] = 0  # padding rows share the scratch slot, as a padded decode graph's rows do
    step = _Step(ops, lens, hk, h, dk, dv, nslots, slots, seed=dk + dv + block[0] + block[1])
    tuned = _decode_ops(ops, block)
    launch = delta_rule_launch(tuned.tuning, tuned._sm_count, tokens=int(step.cu[-1]), seqs=len(lens), heads=h,
                               dk=dk, dv=dv)
    assert launch.kernel.startswith("gdn_decode_kernel<")
    d_state = ops.upload(step.state0, np.float32)
    o = ops.to_host(tuned._cast(step.run(tuned, d_state), np.float32))
    state = ops.to_host(d_state)
    want_o, want_state = step.reference(real)
    rows = np.concatenate([np.arange(step.cu[b], step.cu[b + 1]) for b in real])
    used = step.slots[real]
    assert np.isfinite(o[rows]).all()
    assert rel(o[rows], want_o[rows]) <= TOL[ops.dtype_name]
    assert rel(state[used], want_state[used]) <= TOL[ops.dtype_name]
    untouched = np.setdiff1d(np.arange(nslots), step.slots[np.asarray(lens) > 0])
    np.testing.assert_array_equal(state[untouched], step.state0[untouched])


def test_decode_kernel_agrees_with_the_previous_kernel(ops):
    """4b-like heads (32 value / 16 key heads, 128 x 128), a decode batch of 33: gdn_decode_kernel and gdn_cols_kernel
    round differently only in fp32 summation order."""
    lens = [1] * 33
    step = _Step(ops, lens, 16, 32, 128, 128, 40, np.arange(3, 36), seed=3)
    got = {}
    for name, tuned in (("new", _decode_ops(ops, None)), ("old", ops.retuned(gdn_decode=False))):
        d_state = ops.upload(step.state0, np.float32)
        got[name] = (ops.to_host(tuned._cast(step.run(tuned, d_state), np.float32)), ops.to_host(d_state))
    assert rel(got["new"][0], got["old"][0]) <= TOL[ops.dtype_name] / 2
    assert rel(got["new"][1], got["old"][1]) <= 1e-5  # fp32 states either way


def test_decode_kernel_replays_in_a_graph(ops):
    """Captured once, replayed on new inputs written in place: each replay matches the reference from the state the
    previous replay left (no allocation or host work inside the captured call)."""
    lens = [1] * 5
    tuned = _decode_ops(ops, None)
    first = _Step(ops, lens, 2, 4, 128, 128, 6, np.arange(1, 6), seed=11)
    d_state = ops.upload(first.state0, np.float32)
    d_qk, d_v = ops.upload(first.qk), ops.upload(first.v)
    d_g, d_b = ops.upload(first.g, np.float32), ops.upload(first.beta, np.float32)
    d_slots, d_cu = ops.upload_index(first.slots), ops.upload_index(first.cu)
    call = lambda: tuned.gated_delta_rule(d_qk[:, :2], d_qk[:, 2:], d_v, d_g, d_b, d_state, d_slots, d_cu)
    graph = tuned.capture(call, warmup=1)  # the warm-up ran one step eagerly: restart from the initial state
    host_state = first.state0.copy()
    for seed in (12, 13):
        step = _Step(ops, lens, 2, 4, 128, 128, 6, np.arange(1, 6), seed=seed)
        step.state0 = host_state
        for dst, src in ((d_state, ops.upload(host_state, np.float32)), (d_qk, ops.upload(step.qk)),
                         (d_v, ops.upload(step.v)), (d_g, ops.upload(step.g, np.float32)),
                         (d_b, ops.upload(step.beta, np.float32))):
            assert dst.shape == src.shape and dst.dtype == src.dtype
            dst.data.copy_from_device(src.data, src.nbytes)  # in place: the graph reads these buffers
        o = ops.to_host(tuned._cast(graph.replay(), np.float32))
        want_o, want_state = step.reference(range(5))
        assert rel(o, want_o) <= TOL[ops.dtype_name]
        host_state = ops.to_host(d_state)
        assert rel(host_state, want_state) <= TOL[ops.dtype_name]
