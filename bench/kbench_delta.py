"""kernel_bench part `delta`: the gated delta rule's prefill (kernels/delta_tc.cu, tensor cores) against the NumPy
reference, the previous CUDA kernels and flash-linear-attention's chunk_gated_delta_rule, on the bench shapes.

Per shape, first the checks: the tensor-core form against the reference (kernels/reference.py, fp32, on the same
bf16 inputs; the longest sequence, outputs and exit state, from non-zero initial states), both scan block widths
against each other, the previous kernels against the reference too. Then the timings: previous default kernel,
tensor-core form (both widths, and its prep pass alone), then each prep variant (kernels/tuning.py GDN_TC_PREPS):
checked (its full form against the reference, its scratch against v1's) and timed side by side, on the bench shapes
and on PREP_SHAPES (the 4b-like model's 8192-token steps). A form that failed a check is not timed. Last, fla in a
child process with what is left of the part's time budget (Triton compiles and autotunes fla's kernels on first use,
tens of seconds on a fresh machine): the tensor-core form against fla on every sequence, then fla's time.
Budget: KBENCH_DELTA_BUDGET_S (default 32 s); KBENCH_DELTA_FULL=1 runs every
shape with fla and the tuning table (tensor cores vs the previous kernels by sequence count and length).
Inputs are laid out as the layer passes them: q and k strided views of one [T, 2 Hk, Dk] buffer.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import GDN_TC_PREPS, GDN_TC_WARPS, delta_rule_launch

TOL_REF = 1e-2  # tensor-core form vs the reference (tests/test_cuda_kernels.py TOL_TC says why)
TOL_OLD = 2e-2  # the previous bf16 kernels vs the reference (TOL_SEQ)
TOL_FLA = 2e-2  # against fla: both round to bf16 at similar points, so about twice one side's error
# prep variants against each other (W, U0: the same fp32 solve in another order, so an operand of T diag(.) rounds
# to the other bf16 neighbour now and then: 4e-5 on the CPU emulation's inputs); Aqk and gc are computed alike
TOL_PREP = 1e-3
FULL = os.environ.get("KBENCH_DELTA_FULL") == "1"
BUDGET_S = float(os.environ.get("KBENCH_DELTA_BUDGET_S", "32"))

# (label, value heads, key heads, sequence lengths, compare with fla); 128 x 128 heads throughout
SHAPES = [
    ("4b-like 32 x 2304", 32, 16, [2304] * 32, True),  # the anchor: fla 4.70 ms, previous kernel 13.2 ms
    ("4b-like 1 x 2048 (shared prefix)", 32, 16, [2048], FULL),
    ("4b-like 64 x 256 (suffixes)", 32, 16, [256] * 64, FULL),
] + ([
    ("0.8b-like 32 x 2304", 16, 16, [2304] * 32, True),
    ("4b-like 4 x 4096 (doc-qa documents)", 32, 16, [4096] * 4, True),
    ("4b-like ragged 60 x 100 + 4 x 2000 + 3 x 1", 32, 16, [100] * 60 + [2000] * 4 + [1] * 3, True),
] if FULL else [])
# the prep pass alone on the 8192-token steps of the 4b-like model (32 value / 16 key heads): v1 against v2
PREP_SHAPES = [(32, 256), (64, 128), (4, 2048), (1, 8192)]
PREP_REF_TOKENS = 1024  # the reference checks the first tokens of sequence 0 (outputs are causal: a prefix suffices)
# (sequences, length) for the tuning table: where does the tensor-core form stop paying?
RULE_SHAPES = [(1, 512), (8, 512), (64, 128), (64, 64), (64, 32), (64, 16), (128, 16), (256, 8), (64, 8)]


def _rel(a, b) -> float:
    """||a - b|| / ||b|| of host arrays."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


def _rel_dev(a, b) -> float:
    """The same on the device (fp32 CuPy arrays), so the whole batch's outputs never cross to the host."""
    import cupy

    d = float(cupy.linalg.norm(b))
    return float(cupy.linalg.norm(a - b)) / (d if d > 0 else 1.0)


class _Case:
    """Device inputs of one shape (bf16 q/k/v as the layer lays them out, fp32 gates and states), drawn on the
    device (the anchor shape is 1.2 GB of inputs: drawing them on the host would take seconds)."""

    def __init__(self, ops, h, hk, lens, seed=0, dk=128, dv=128):
        import cupy

        rng = cupy.random.default_rng(seed)
        self.h, self.hk, self.dk, self.dv, self.lens = h, hk, dk, dv, list(lens)
        self.cu = np.zeros(len(lens) + 1, np.int32)
        np.cumsum(lens, out=self.cu[1:])
        t = self.t = int(self.cu[-1])
        qk = rng.standard_normal((t, 2 * hk, dk), dtype=np.float32)
        qk /= cupy.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
        self.qk = ops._cast(qk, ops.act_dtype)  # bf16 [T, 2 Hk, Dk]
        del qk
        self.v = ops._cast(rng.standard_normal((t, h, dv), dtype=np.float32), ops.act_dtype)
        # decays as the model's gates make them (-exp(A_log) softplus(.) <= 0), beta in (0, 1)
        self.g = -cupy.abs(rng.standard_normal((t, h), dtype=np.float32)) * 0.1
        self.beta = 1 / (1 + cupy.exp(-rng.standard_normal((t, h), dtype=np.float32)))
        self.state0 = rng.standard_normal((len(lens), h, dk, dv), dtype=np.float32) * 0.1
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

    def reference(self, ops, seqs, tokens=None):
        """The NumPy reference for sequences `seqs` (each cut to its first `tokens`, when given):
        {b: (o [len, H, Dv], state [H, Dk, Dv])}."""
        host = lambda a: np.asarray(ops.to_host(a)).astype(np.float32)
        ref = NumpyOps()
        out = {}
        for b in seqs:
            s, e = int(self.cu[b]), int(self.cu[b + 1])
            e = e if tokens is None else min(e, s + tokens)
            qk, v, g, beta = (host(a[s:e]) for a in (self.qk, self.v, self.g, self.beta))
            st = host(self.state0[b:b + 1])
            o = ref.gated_delta_rule(qk[:, :self.hk], qk[:, self.hk:], v, g, beta, st, np.array([0]),
                                     np.array([0, e - s]))
            out[b] = (o, st[0])
        return out


def _torch_view(torch, a):
    """A torch tensor over a CuPy array's memory (no copy, strides kept); bf16 through its 16-bit words."""
    if a.dtype in (np.float32, np.int32):
        return torch.from_dlpack(a)
    return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)


def _prep(case, ops):
    """ops's prep pass (its tuning's gdn_tc_prep variant) on the case: (W, U0, Aqk, gc)."""
    q, k, v = case.q, case.k, case.v
    return ops._gdn_tc_prep(128, q, q.strides[0] // 2, q.strides[1] // 2, k, k.strides[0] // 2, k.strides[1] // 2, v,
                            v.strides[0] // 2, v.strides[1] // 2, case.g, case.beta, case.cu_d, len(case.lens),
                            case.h // case.hk)


def _prep_rows(rows, check, note, label, case, preps, ref_ops):
    """The prep variants on one case: each one's full tensor-core form against the reference (the first
    PREP_REF_TOKENS outputs of sequence 0), the new variants' scratch against v1's, then each variant's prep time
    side by side. A variant that failed a check is not timed and its failure is a FAIL row (the part exits 1)."""
    import cupy

    from kernel_bench import Row, time_ms

    f32 = lambda a: ref_ops._cast(a, np.float32)
    n0 = min(PREP_REF_TOKENS, case.lens[0])
    want_o, _ = case.reference(ref_ops, [0], tokens=n0)[0]
    base = _prep(case, preps["v1"])
    ok = {}
    for name, p_ops in preps.items():
        o = f32(case.run(p_ops, case.state0.copy()))
        bad = check(f"{label}: tensor cores with prep {name} vs reference (sequence 0, first {n0} tokens)",
                    _rel(cupy.asnumpy(o[:n0]), want_o), TOL_REF)
        if name != "v1":
            got = _prep(case, p_ops)
            for what, a, b in zip(("W", "U0", "Aqk", "gc"), got, base):
                bad |= check(f"{label}: prep {name} vs v1, {what} (all tokens)",
                             _rel_dev(f32(a), f32(b)), TOL_PREP if what in ("W", "U0") else 1e-6)
            del got
        ok[name] = not bad
        del o
    del base
    times = {}
    for name, p_ops in preps.items():
        if not ok[name]:
            note(f"{label}: prep {name} NOT timed: it failed a check above")
            continue
        ms = times[name] = time_ms(lambda: _prep(case, p_ops), iters=10, warmup=2)
        speedup = f", {times['v1'] / ms:.2f}x v1" if "v1" in times and name != "v1" else ""
        rows.append(Row(f"{label}:   prep pass {name}", ms, f"{case.t / ms / 1e3:.1f} M tok/s{speedup}"))


def fla_child(shape_index: int) -> dict:
    """In a child process: SHAPES[shape_index] through fla's chunk_gated_delta_rule and the tensor-core form (auto
    width), their difference over every sequence (outputs and exit states, on the device), then fla's time.
    -> {"err": ..., "ms": ...} or {"skip": why}."""
    import cupy

    from kernel_bench import time_ms, torch_time_ms
    from prefixrun.kernels.cuda import CudaOps

    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - any import failure means "no baseline here"
        return {"skip": f"fla not importable: {type(e).__name__}: {e}"}
    label, h, hk, lens, _ = SHAPES[shape_index]
    ops = CudaOps("bfloat16").retuned(gdn_tensor_cores=True)
    case = _Case(ops, h, hk, lens)
    st = case.state0.copy()
    o = ops._cast(case.run(ops, st), np.float32)
    tq, tk = (_torch_view(torch, a).contiguous()[None] for a in (case.q, case.k))
    tv, tg, tb = _torch_view(torch, case.v)[None], _torch_view(torch, case.g)[None], _torch_view(torch, case.beta)[None]
    tcu, tcu_cpu = torch.from_dlpack(case.cu_d).long(), torch.from_numpy(case.cu.astype(np.int64))
    h0 = _torch_view(torch, case.state0)

    def run():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, scale=1 / math.sqrt(128), initial_state=h0,
                                      output_final_state=True, cu_seqlens=tcu, cu_seqlens_cpu=tcu_cpu)

    t0 = time.perf_counter()
    fo, fs = run()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    fo, fs = cupy.from_dlpack(fo[0].float().contiguous()), cupy.from_dlpack(fs.float().contiguous())
    err = max(_rel_dev(o, fo), _rel_dev(st, fs))
    del o, st, fo, fs
    ms = torch_time_ms(run, iters=5, warmup=1)
    return {"err": err, "ms": ms, "first_s": first_s, "tc_ms": time_ms(lambda: case.run(ops, case.state0.copy()))}


def _shapes(rows, check, note, summary, ops, f32, widths, tc_auto, previous, preps):
    """Checks, then timings, shape by shape (SHAPES); appends to rows and summary."""
    import cupy

    from kernel_bench import Row, time_ms

    for label, h, hk, lens, _ in SHAPES:
        case = _Case(ops, h, hk, lens)
        t, nseq = case.t, len(lens)
        launch = delta_rule_launch(tc_auto.tuning, ops._sm_count, tokens=t, seqs=nseq, heads=h, dk=128, dv=128,
                                   tensor_cores=True)
        note(f"-- {label}: {nseq} sequences, {t} tokens, {h} value / {hk} key heads, 128 x 128")
        # correctness first; the reference on the longest sequence
        pick = int(np.argmax(lens))
        s, e = int(case.cu[pick]), int(case.cu[pick + 1])
        want_o, want_s = case.reference(ops, [pick])[pick]
        outs, failed = {}, False
        for name, o_ops, tol in [(f"tensor cores {w} warps", w_ops, TOL_REF) for w, w_ops in widths.items()] + [
                ("previous", previous, TOL_OLD)]:
            st = case.state0.copy()
            o = f32(case.run(o_ops, st))
            outs[name] = (o, st)
            err = max(_rel(cupy.asnumpy(o[s:e]), want_o), _rel(cupy.asnumpy(st[pick]), want_s))
            bad = check(f"{label}: {name} vs reference (sequence {pick}: outputs, exit state)", err, tol)
            failed |= bad and name != "previous"
        (o_a, st_a), (o_b, st_b) = (outs[f"tensor cores {w} warps"] for w in GDN_TC_WARPS)
        failed |= check(f"{label}: tensor cores, {GDN_TC_WARPS} warps agree (all sequences)",
                        max(_rel_dev(o_a, o_b), _rel_dev(st_a, st_b)), 1e-5)
        del outs, o_a, o_b, st_a, st_b
        # then timings (the state evolves from call to call: the same work every time)
        st = case.state0.copy()
        rate = lambda ms: f"{t / ms / 1e3:.1f} M tok/s"
        row = {"shape": label, "failed": failed}
        ms = row["previous"] = time_ms(lambda: case.run(previous, st), iters=3, warmup=1)
        rows.append(Row(f"{label}: previous kernels (gdn_tensor_cores=False)", ms, rate(ms)))
        if failed:
            note(f"{label}: tensor-core form not timed (a check failed)")
        else:
            for w, w_ops in widths.items():
                ms = time_ms(lambda: case.run(w_ops, st), iters=5, warmup=1)
                if w == launch.warps:
                    row["tc"] = ms
                rows.append(Row(f"{label}: tensor cores, {w} warps per scan block"
                                f"{' (the auto rule)' if w == launch.warps else ''}", ms, rate(ms)))
            ms = time_ms(lambda: _prep(case, ops), iters=5, warmup=1)
            rows.append(Row(f"{label}:   of which the prep pass ({ops.tuning.gdn_tc_prep}, the default)", ms))
            _prep_rows(rows, check, note, label, case, preps, ops)
        summary.append(row)
        case = None  # the next shape's inputs replace these
        cupy.get_default_memory_pool().free_all_blocks()


def _fla_rows(rows, check, note, summary, deadline):
    """fla per shape that asks for it, each in a child process limited to what is left of the budget."""
    from kernel_bench import Row

    for i, (label, h, hk, lens, with_fla) in enumerate(SHAPES):
        row = summary[i] if i < len(summary) else {}
        if not with_fla or row.get("failed", True):
            continue
        left = deadline - time.monotonic()
        if left < 5:
            note(f"{label}: fla not run (the part's {BUDGET_S:.0f} s budget is spent)")
            continue
        code = f"import kbench_delta as k, json; print('FLA ' + json.dumps(k.fla_child({i})))"
        try:
            child = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)),
                                   capture_output=True, text=True, timeout=None if FULL else left)
        except subprocess.TimeoutExpired:
            note(f"{label}: fla did not finish within the {left:.0f} s left of the budget (Triton compiling and "
                 f"autotuning on a fresh machine); KBENCH_DELTA_BUDGET_S raises it")
            continue
        out = [ln for ln in child.stdout.splitlines() if ln.startswith("FLA ")]
        if child.returncode or not out:
            note(f"{label}: fla child failed: {child.stderr.strip()[-300:]}")
            continue
        res = json.loads(out[-1][4:])
        if "skip" in res:
            note(f"{label}: {res['skip']}")
            continue
        check(f"{label}: tensor cores vs fla (all sequences: outputs, exit states)", res["err"], TOL_FLA)
        row["fla"] = res["ms"]
        rows.append(Row(f"{label}: flash-linear-attention chunk_gated_delta_rule (first call {res['first_s']:.1f} s)",
                        res["ms"], f"tensor cores in the same process {res['tc_ms']:.4f} ms"))


def delta_part() -> list:
    from kernel_bench import Row, time_ms
    from prefixrun.kernels.cuda import CudaOps

    deadline = time.monotonic() + (math.inf if FULL else BUDGET_S)  # FULL: no budget, no child time limit
    rows: list = []
    check = lambda name, err, bound: rows.append(Row(name, error=err, bound=bound)) or rows[-1].failed
    note = lambda text: rows.append(Row(text))
    ops = CudaOps("bfloat16")
    f32 = lambda a: ops._cast(a, np.float32)
    widths = {w: ops.retuned(gdn_tensor_cores=True, gdn_tc_warps=w) for w in GDN_TC_WARPS}
    tc_auto = ops.retuned(gdn_tensor_cores=True)  # the "auto" rule's block width, the form forced on
    previous = ops.retuned(gdn_tensor_cores=False)
    preps = {p: ops.retuned(gdn_tensor_cores=True, gdn_tc_prep=p) for p in GDN_TC_PREPS}
    summary = []
    try:
        _shapes(rows, check, note, summary, ops, f32, widths, tc_auto, previous, preps)
        note("-- the prep pass alone, 8192-token steps (4b-like heads): " + ", ".join(GDN_TC_PREPS))
        for nseq, length in PREP_SHAPES:
            _prep_rows(rows, check, note, f"prep {nseq} x {length}", _Case(ops, 32, 16, [length] * nseq, seed=2),
                       preps, ops)
    except Exception as ex:  # noqa: BLE001 - a kernel fault is sticky: report it as a failed row, keep the rows so far
        rows.append(Row(f"delta part stopped: {type(ex).__name__}: {str(ex)[:160]}", error=float("inf"), bound=0.0))
        return rows
    _fla_rows(rows, check, note, summary, deadline)
    note("-- summary, ms: previous | tensor cores (auto width) | fla | tensor cores / fla (goal <= 1.5)")
    nan = float("nan")
    for r in summary:
        ratio = f"{r['tc'] / r['fla']:.2f}" if "fla" in r and "tc" in r else "-"
        note(f"   {r['shape']:<42} {r['previous']:>8.3f} {r.get('tc', nan):>8.3f} {r.get('fla', nan):>8.3f}  {ratio}")
    if FULL:
        note("-- tuning table: 4b-like heads, the previous default kernel vs tensor cores (auto width)")
        for nseq, length in RULE_SHAPES:
            case = _Case(ops, 32, 16, [length] * nseq, seed=1)
            st = case.state0.copy()
            a = time_ms(lambda: case.run(previous, st))
            b = time_ms(lambda: case.run(tc_auto, st))
            rows.append(Row(f"rule {nseq} x {length}: previous; tensor cores in rate", a,
                            f"tensor cores {b:.4f} ms, ratio {b / a:.2f}"))
    return rows
