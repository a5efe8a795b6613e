"""Kernel checks and timings on the bench models' shapes (device only):
`python3 bench/kernel_bench.py [attn|delta|decode|elem|kda]`.

Each part (PARTS below; no argument runs them all) returns rows: a check (a kernel's error against the NumPy
reference on the bench shapes, its bound) or a timing (ms and a rate, next to the old kernel and the vendor
baseline). A part checks a kernel before it times it and times nothing that failed its check. The script prints one
table per part (each part in its own process when several run) and exits 1 when a check failed or a part crashed.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    ms: float | None = None  # a timing
    rate: str = ""
    error: float | None = None  # a check: norm-relative error against the reference, and its bound
    bound: float | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None and not self.error <= self.bound  # NaN fails


def time_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    """Mean device time of fn() in ms (CuPy events on the current stream)."""
    import cupy

    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters


def torch_time_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- attention prefill: mma.sync vs the wgmma schedules vs torch SDPA ------------------------------------------------
# name, sequences, new tokens each, cached tokens before them, q heads, kv heads, head dim, window (0: none)
ATTN_CASES = [
    ("prefill 32 x 2304, 16/4 heads x 256", 32, 2304, 0, 16, 4, 256, 0),
    ("prefill 32 x 2304, 32/8 heads x 128", 32, 2304, 0, 32, 8, 128, 0),
    ("suffixes 64 x 256 after 2048 cached, 16/4 x 256", 64, 256, 2048, 16, 4, 256, 0),
]  # kept to ~70 s for every part together: three shapes, 256 checked queries each, 5 timed runs
ATTN_BOUND = 1e-2  # tests/test_cuda_kernels.py WGMMA_TOL: two bf16 roundings (P and the output)
ATTN_CHECK_ROWS = 256  # the last sequence's last queries are checked against the reference (all its keys)


def _causal_pairs(n: int, hist: int, window: int) -> int:
    """(query, key) pairs a sequence of n new queries after `hist` cached tokens computes."""
    if not window:
        return n * hist + n * (n + 1) // 2
    return sum(min(p + 1, window) for p in range(hist, hist + n))


def attn_part() -> list[Row]:
    import cupy
    import numpy as np

    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.reference import NumpyOps

    base = CudaOps("bfloat16")
    kernels, rows = _attn_kernels(base)
    ref = NumpyOps()
    rng = np.random.default_rng(0)
    bs = base.default_block_size
    for name, b, n, hist, hq, hkv, d, window in ATTN_CASES:
        ctx_len = hist + n
        nblk = -(-ctx_len // bs)
        tables_h = rng.permutation(b * nblk).reshape(b, nblk).astype(np.int32)
        ctx_h = np.full(b, ctx_len, np.int32)
        cu_h = (np.arange(b + 1) * n).astype(np.int32)
        k_cache = base.upload(cupy.random.standard_normal((b * nblk, bs, hkv, d), dtype=np.float32))  # bf16
        v_cache = base.upload(cupy.random.standard_normal((b * nblk, bs, hkv, d), dtype=np.float32))
        q = base.upload(cupy.random.standard_normal((b * n, hq, d), dtype=np.float32))
        tables, ctx, cu = base.upload_index(tables_h), base.upload_index(ctx_h), base.upload_index(cu_h)
        scale = d ** -0.5
        win = window or None
        flops = 4 * hq * d * b * _causal_pairs(n, hist, window)

        # the reference on the last sequence's last queries (the most keys each) over its blocks only
        picked = [b - 1]
        m = min(n, ATTN_CHECK_ROWS)
        blocks = tables_h[picked].reshape(-1)
        sub_tables = np.arange(len(blocks), dtype=np.int32).reshape(len(picked), nblk)
        host = lambda a: np.asarray(base.to_host(a)).astype(np.float32)
        k_sub, v_sub = host(k_cache[cupy.asarray(blocks)]), host(v_cache[cupy.asarray(blocks)])
        q_rows = np.arange(cu_h[b] - m, cu_h[b])
        q_rows_dev = cupy.asarray(q_rows)
        q_sub = host(q[q_rows_dev])
        sub_cu = np.array([0, m], np.int32)
        want = ref.paged_attention(q_sub, k_sub, v_sub, sub_tables, ctx_h[picked], sub_cu, scale, win)

        sdpa = _sdpa_rows(name, b, n, hist, hq, hkv, d, window, flops)
        rows += sdpa
        timed = {}
        for label, ops in kernels.items():
            run = lambda ops=ops: ops.paged_attention(q, k_cache, v_cache, tables, ctx, cu, scale, win)
            try:
                err = rel(host(run()[q_rows_dev]), want)
            except Exception as e:  # a kernel fault poisons this process's CUDA context: stop the part here
                rows.append(Row(f"{name}: {label} vs reference", error=float("nan"), bound=ATTN_BOUND,
                                rate=f"{type(e).__name__}: {str(e)[:100]}"))
                return rows
            rows.append(Row(f"{name}: {label} vs reference", error=err, bound=ATTN_BOUND))
            if rows[-1].failed:
                continue
            timed[label] = time_ms(run, iters=5, warmup=1)
            rows.append(Row(f"{name}: {label}", timed[label], f"{flops / timed[label] / 1e9:.0f} TFLOP/s"))
        best_sdpa = min((r.ms for r in sdpa if r.ms is not None), default=None)
        if best_sdpa:
            ratios = ", ".join(f"{label} {ms / best_sdpa:.2f}x" for label, ms in timed.items())
            rows.append(Row(f"{name}: time / best torch SDPA", rate=f"{ratios} (issue 14 goal: <= 2x)"))
        del k_cache, v_cache, q
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _attn_kernels(base) -> tuple[dict, list[Row]]:
    """({label: ops} of the attention prefill kernels to time, [a row for a failed smoke run]): mma.sync, and on
    sm_90a the schedules of kernels/attention_sm90.cu and attention_sm90_ws.cu."""
    from prefixrun.kernels import attention_sm90

    kernels = {"mma.sync": base.retuned(attn_prefill_kernel="mma")}
    rows: list[Row] = []
    if attention_sm90.available():
        kernels["wgmma"] = base.retuned(attn_prefill_kernel="wgmma")
        kernels["wgmma-overlap"] = base.retuned(attn_prefill_kernel="wgmma-overlap")
        # the warp-specialised kernel (the default at every head dim) after a smoke run in a child process: a pipeline
        # that never completes costs the child's timeout, not the bench
        ws_failure = _ws_smoke_failure()
        if ws_failure:
            rows.append(Row("wgmma-ws / wgmma-pingpong smoke run", error=float("nan"), bound=ATTN_BOUND,
                            rate=ws_failure))
        else:
            for choice in ("wgmma-ws", "wgmma-pingpong"):
                kernels[choice] = base.retuned(attn_prefill_kernel=choice)
    return kernels, rows


def _ws_smoke_failure() -> str:
    """Why the warp-specialised kernel must not run in this process ("" if it may): it runs first in a child process
    (tests/test_cuda_kernels.py wgmma_smoke_in_child), so a fault or a pipeline that never completes costs a row,
    not the part."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_cuda_kernels import wgmma_smoke_in_child

    return wgmma_smoke_in_child(("wgmma-ws", "wgmma-pingpong"), "attn_ws_kernel", 120).replace("\n", " ")[-400:]


def _sdpa_rows(name, b, n, hist, hq, hkv, d, window, flops) -> list[Row]:
    """torch.nn.functional.scaled_dot_product_attention on dense [B, H, L, D] bf16 tensors of the same shape: GQA
    native (enable_gqa) and with K/V repeated to every query head; queries after cached keys use the lower-right
    causal mask. Sliding windows have no fused SDPA path: not timed."""
    if window:
        return [Row(f"{name}: torch SDPA", rate="n/a (no fused sliding-window path)")]
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right
    except ImportError as e:
        return [Row(f"{name}: torch SDPA", rate=f"skipped: {e}")]
    qt = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(b, hkv, hist + n, d, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn_like(kt)
    mask = dict(is_causal=True) if hist == 0 else dict(attn_mask=causal_lower_right(n, hist + n))
    rows = []
    variants = {"torch SDPA, enable_gqa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, **mask)}
    kr, vr = kt.repeat_interleave(hq // hkv, dim=1), vt.repeat_interleave(hq // hkv, dim=1)
    variants["torch SDPA, K/V repeated"] = lambda: F.scaled_dot_product_attention(qt, kr, vr, **mask)
    for label, fn in variants.items():
        try:
            ms = torch_time_ms(fn, iters=5, warmup=1)
        except Exception as e:  # a backend without this combination
            rows.append(Row(f"{name}: {label}", rate=f"failed: {type(e).__name__}: {str(e)[:80]}"))
            continue
        rows.append(Row(f"{name}: {label}", ms, f"{flops / ms / 1e9:.0f} TFLOP/s"))
    del qt, kt, vt, kr, vr
    torch.cuda.empty_cache()
    return rows


def delta_part() -> list[Row]:
    """The gated delta rule's prefill: tensor cores vs the previous kernels and flash-linear-attention
    (bench/kbench_delta.py; apart because it is long)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kbench_delta

    return kbench_delta.delta_part()


def decode_part() -> list[Row]:
    """The gated delta rule's decode step: gdn_decode_kernel vs the previous kernel, GB/s by batch
    (bench/kbench_delta_decode.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kbench_delta_decode

    return kbench_delta_decode.decode_part()


def elem_part() -> list[Row]:
    """Row norms, GLUs and sigmoid_mul at decode (64 rows) and prefill (8192 rows) shapes: us and GB/s
    (bench/kbench_elem.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kbench_elem

    return kbench_elem.elem_part()


def kda_part() -> list[Row]:
    """Kimi's KDA (a decay per key channel): the chunked prefill and per-channel decode vs token steps, next to Gated
    DeltaNet's per-head kernels (bench/kbench_kda.py)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kbench_kda

    return kbench_kda.kda_part()


PARTS = {"attn": attn_part, "delta": delta_part, "decode": decode_part, "elem": elem_part, "kda": kda_part}


def print_table(part: str, rows: list[Row]) -> None:
    print(f"\n== {part} ==")
    print(f"{'':<72} {'ms':>9}  rate / check")
    for r in rows:
        if r.error is not None:
            verdict = "FAIL" if r.failed else "ok"
            print(f"{r.name:<72} {'':>9}  {verdict}: error {r.error:.2e} (bound {r.bound:.0e}) {r.rate}")
        else:
            ms = f"{r.ms:9.4f}" if r.ms is not None else f"{'':>9}"
            print(f"{r.name:<72} {ms}  {r.rate}")


def main(argv: list[str]) -> int:
    names = argv or list(PARTS)
    unknown = [a for a in names if a not in PARTS]
    if unknown:
        print(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if len(names) > 1:  # one process per part: a kernel fault is sticky for its CUDA context, not for the others
        import subprocess

        codes = [subprocess.run([sys.executable, __file__, part]).returncode for part in names]
        for part, code in zip(names, codes):
            if code not in (0, 1):
                print(f"\n== {part} == exited with status {code} (crashed before its table)")
        return 0 if all(c == 0 for c in codes) else 1
    rows = PARTS[names[0]]()
    print_table(names[0], rows)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
