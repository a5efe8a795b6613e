"""kernel_bench part `delta`: the gated delta rule's prefill (kernels/delta_tc.cu, tensor cores) against the NumPy
reference, the previous CUDA kernels and flash-linear-attention's chunk_gated_delta_rule, on the bench shapes.

Per shape, first the checks: the tensor-core form against the reference (kernels/reference.py, fp32, on the same
bf16 inputs; three of the shape's sequences, outputs and exit states, from non-zero initial states) and against fla
(every sequence); the previous kernels against the reference too. Then the timings: previous default kernel,
tensor-core form (the default rule's block width and each forced one, and its prep pass alone), fla. The last table
feeds kernels/tuning.py's rule (tensor cores vs the previous kernels by sequence count and length).
Inputs are laid out as the layer passes them: q and k strided views of one [T, 2 Hk, Dk] buffer.
"""
from __future__ import annotations

import math

import numpy as np

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import GDN_TC_WARPS, delta_rule_launch

TOL_REF = 1e-2  # tensor-core form vs the reference (tests/test_cuda_kernels.py TOL_TC says why)
TOL_OLD = 2e-2  # the previous bf16 kernels vs the reference (TOL_SEQ)
TOL_FLA = 2e-2  # against fla: both round to bf16 at similar points, so about twice one side's error

# (label, value heads, key heads, sequence lengths); 128 x 128 heads throughout
SHAPES = [
    ("4b-like 32 x 2304", 32, 16, [2304] * 32),  # the anchor: fla 4.70 ms, previous kernel 13.2 ms
    ("0.8b-like 32 x 2304", 16, 16, [2304] * 32),
    ("4b-like 1 x 2048 (shared prefix)", 32, 16, [2048]),
    ("4b-like 64 x 256 (suffixes)", 32, 16, [256] * 64),
    ("4b-like 4 x 4096 (doc-qa documents)", 32, 16, [4096] * 4),
    ("4b-like ragged 60 x 100 + 4 x 2000 + 3 x 1", 32, 16, [100] * 60 + [2000] * 4 + [1] * 3),
]
# (sequences, length) for the tuning table: where does the tensor-core form stop paying?
RULE_SHAPES = [(1, 512), (8, 512), (64, 128), (64, 64), (64, 32), (64, 16), (128, 16), (256, 8), (64, 8)]


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


class _Case:
    """Device inputs of one shape (bf16 q/k/v as the layer lays them out, fp32 gates and states)."""

    def __init__(self, ops, h, hk, lens, seed=0, dk=128, dv=128):
        import cupy

        rng = np.random.default_rng(seed)
        self.h, self.hk, self.dk, self.dv, self.lens = h, hk, dk, dv, list(lens)
        self.cu = np.zeros(len(lens) + 1, np.int32)
        np.cumsum(lens, out=self.cu[1:])
        t = int(self.cu[-1])
        self.t = t
        qk = rng.standard_normal((t, 2 * hk, dk), dtype=np.float32)
        qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
        self.qk = ops.upload(qk)  # bf16 [T, 2 Hk, Dk]
        self.v = ops.upload(rng.standard_normal((t, h, dv), dtype=np.float32))
        # decays as the model's gates make them (-exp(A_log) softplus(.)), mostly mild, a few strong
        self.g = cupy.asarray(-np.abs(rng.standard_normal((t, h), dtype=np.float32)) * 0.1)
        self.beta = cupy.asarray((1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32))
        self.state0 = cupy.asarray((rng.standard_normal((len(lens), h, dk, dv)) * 0.1).astype(np.float32))
        self.slots = ops.upload_index(np.arange(len(lens)))
        self.cu_d = ops.upload_index(self.cu)

    @property
    def q(self):
        return self.qk[:, :self.hk]

    @property
    def k(self):
        return self.qk[:, self.hk:]

    def run(self, ops, state):
        return ops.gated_delta_rule(self.q, self.k, self.v, self.g, self.beta, state, self.slots, self.cu_d)

    def reference(self, ops, seqs):
        """The NumPy reference for sequences `seqs`: {b: (o [len, H, Dv], state [H, Dk, Dv])}."""
        host = lambda a: np.asarray(ops.to_host(a)).astype(np.float32)
        qk, v, g, beta, s0 = host(self.qk), host(self.v), host(self.g), host(self.beta), host(self.state0)
        ref = NumpyOps()
        out = {}
        for b in seqs:
            s, e = int(self.cu[b]), int(self.cu[b + 1])
            st = s0[b:b + 1].copy()
            o = ref.gated_delta_rule(qk[s:e, :self.hk], qk[s:e, self.hk:], v[s:e], g[s:e], beta[s:e], st,
                                     np.array([0]), np.array([0, e - s]))
            out[b] = (o, st[0])
        return out


def _fla():
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "no baseline here"
        return None, f"{type(e).__name__}: {e}"
    return (torch, chunk_gated_delta_rule), ""


def _torch_view(torch, a):
    """A torch tensor over a CuPy array's memory (no copy, strides kept); bf16 through its 16-bit words."""
    if a.dtype in (np.float32, np.int32):
        return torch.from_dlpack(a)
    return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)


def delta_part() -> list:
    import cupy

    from kernel_bench import Row, time_ms, torch_time_ms
    from prefixrun.kernels.cuda import CudaOps

    rows: list = []
    check = lambda name, err, bound: rows.append(Row(name, error=err, bound=bound)) or rows[-1].failed
    note = lambda text: rows.append(Row(text))
    ops = CudaOps("bfloat16")
    tc_default = ops.retuned(gdn_tensor_cores=True)  # the "auto" rule's block width, the form forced on
    previous = ops.retuned(gdn_tensor_cores=False)
    fla, why = _fla()
    if fla is None:
        note(f"flash-linear-attention not importable ({why}): no fla checks or timings")
    sms = ops._sm_count
    summary = []
    for label, h, hk, lens in SHAPES:
        case = _Case(ops, h, hk, lens)
        t = case.t
        note(f"-- {label}: {len(lens)} sequences, {t} tokens, {h} value / {hk} key heads, 128 x 128")
        launch = delta_rule_launch(tc_default.tuning, sms, tokens=t, seqs=len(lens), heads=h, dk=128, dv=128,
                                   tensor_cores=True)
        # correctness first: nothing that failed is timed
        picks = sorted({0, len(lens) // 2, len(lens) - 1})
        want = case.reference(ops, picks)
        results, failed = {}, False
        for name, o_ops in (("tensor cores", tc_default), ("previous", previous)):
            st = case.state0.copy()
            o = np.asarray(o_ops.to_host(case.run(o_ops, st))).astype(np.float32)
            st_h = cupy.asnumpy(st)
            results[name] = (o, st_h)
            tol = TOL_REF if name == "tensor cores" else TOL_OLD
            err_o = max(_rel(o[case.cu[b]:case.cu[b + 1]], want[b][0]) for b in picks)
            err_s = max(_rel(st_h[b], want[b][1]) for b in picks)
            failed |= check(f"{label}: {name} outputs vs reference (seqs {picks})", err_o, tol)
            failed |= check(f"{label}: {name} exit states vs reference", err_s, tol)
        for w in GDN_TC_WARPS:  # every block width computes the same thing, up to fp32 summation order
            o_ops = ops.retuned(gdn_tensor_cores=True, gdn_tc_warps=w)
            st = case.state0.copy()
            o = np.asarray(o_ops.to_host(case.run(o_ops, st))).astype(np.float32)
            failed |= check(f"{label}: tensor cores, {w} warps, vs the default width", max(
                _rel(o, results["tensor cores"][0]), _rel(cupy.asnumpy(st), results["tensor cores"][1])), 1e-5)
        run_fla = None
        if fla is not None:
            torch, chunk_gdr = fla
            tq = _torch_view(torch, case.q).contiguous()[None]
            tk = _torch_view(torch, case.k).contiguous()[None]
            tv = _torch_view(torch, case.v)[None]
            tg, tb = _torch_view(torch, case.g)[None], _torch_view(torch, case.beta)[None]
            tcu = torch.from_dlpack(case.cu_d).long()
            tcu_cpu = torch.from_numpy(case.cu.astype(np.int64))
            h0 = _torch_view(torch, case.state0)

            def run_fla():
                return chunk_gdr(tq, tk, tv, tg, tb, scale=1 / math.sqrt(128), initial_state=h0,
                                 output_final_state=True, cu_seqlens=tcu, cu_seqlens_cpu=tcu_cpu)

            try:
                fo, fs = run_fla()
            except Exception as e:  # noqa: BLE001 - report the baseline's failure, keep benching ours
                note(f"{label}: fla failed: {type(e).__name__}: {str(e)[:120]}")
                run_fla = None
            else:
                fo = fo[0].float().cpu().numpy()
                fs = fs.float().cpu().numpy()
                o, st_h = results["tensor cores"]
                failed |= check(f"{label}: tensor cores vs fla, outputs (all sequences)", _rel(o, fo), TOL_FLA)
                failed |= check(f"{label}: tensor cores vs fla, exit states", _rel(st_h, fs), TOL_FLA)
                check(f"{label}: fla vs reference (seqs {picks}, for scale)",
                      max(_rel(fo[case.cu[b]:case.cu[b + 1]], want[b][0]) for b in picks), TOL_FLA)
        # then timings (the state evolves from call to call: the same work every time)
        st = case.state0.copy()
        rate = lambda ms: f"{t / ms / 1e3:.1f} M tok/s"
        row = {"shape": label}
        ms = row["previous"] = time_ms(lambda: case.run(previous, st), iters=5, warmup=1)
        rows.append(Row(f"{label}: previous default kernel", ms, rate(ms)))
        if failed:
            note(f"{label}: tensor-core form not timed (a check failed)")
        else:
            ms = row["tc"] = time_ms(lambda: case.run(tc_default, st))
            rows.append(Row(f"{label}: tensor cores, default rule ({launch.warps} warps)", ms, rate(ms)))
            for w in GDN_TC_WARPS:
                o_ops = ops.retuned(gdn_tensor_cores=True, gdn_tc_warps=w)
                ms = time_ms(lambda: case.run(o_ops, st))
                rows.append(Row(f"{label}:   tensor cores, {w} warps per scan block", ms, rate(ms)))
            q, k, v = case.q, case.k, case.v
            ms = time_ms(lambda: ops._gdn_tc_prep(
                128, q, q.strides[0] // 2, q.strides[1] // 2, k, k.strides[0] // 2, k.strides[1] // 2, v,
                v.strides[0] // 2, v.strides[1] // 2, case.g, case.beta, case.cu_d, len(lens), h // hk))
            rows.append(Row(f"{label}:   tensor cores, prep pass alone", ms))
        if run_fla is not None:
            ms = row["fla"] = torch_time_ms(run_fla, iters=10, warmup=3)
            rows.append(Row(f"{label}: flash-linear-attention chunk_gated_delta_rule", ms, rate(ms)))
        summary.append(row)
        del case
        cupy.get_default_memory_pool().free_all_blocks()

    note("-- summary (ms): shape | previous | tensor cores | fla | tensor cores / fla (goal <= 1.5)")
    nan = float("nan")
    for r in summary:
        ratio = f"{r['tc'] / r['fla']:.2f}" if "fla" in r and "tc" in r else "-"
        note(f"   {r['shape']:<44} {r['previous']:>8.3f} {r.get('tc', nan):>8.3f} {r.get('fla', nan):>8.3f}  {ratio}")

    note("-- tuning table: 4b-like heads, tensor cores (default width) vs the previous default kernel")
    for nseq, length in RULE_SHAPES:
        case = _Case(ops, 32, 16, [length] * nseq, seed=1)
        st = case.state0.copy()
        a = time_ms(lambda: case.run(previous, st))
        b = time_ms(lambda: case.run(tc_default, st))
        rows.append(Row(f"rule {nseq} x {length}: previous / tensor cores", a, f"tensor cores {b:.4f} ms, "
                        f"ratio {b / a:.2f}"))
    return rows
