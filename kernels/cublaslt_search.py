"""The row-count buckets of kernels/cublaslt.py's `PinnedGemm`: for each, the fastest cuBLASLt algorithm among
those that give the reference algorithm's bits.

Candidates for a bucket: cuBLASLt's heuristic answers (HEURISTIC_ANSWERS each) at the bucket's smallest and largest
row counts, then the tile and stage configurations without split-K of the reference's algorithm id and of the
answers' ids that cublasLtMatmulAlgoCheck accepts for the shape; MAX_CANDIDATES at most. Each runs on fixed test
data at the bucket's smallest and largest row counts and is kept only where every row equals the reference
algorithm's bit for bit (a kernel whose summation order, or whose split of the work, changes with the tile count
differs there). The kept ones and the reference are timed at those two row counts (the least of TIMING_REPS
timings, on a stream of their own, each behind a spinning kernel so the launches run back to back whatever a call
costs the host; one clearly slower than the best so far is dropped after its first), and the
least total wins: picking among equal bits by speed moves no bit. The heuristics' first answer alone, kept by bits
alone, was up to 4x slower than the reference itself for few rows at large K (docs/PERFORMANCE.md).

Measuring takes a few hundred products per shape, so the choice goes to the cache folder (kernels/gemm_choices.py)
and a later process on the machine takes it from there, after checking each stored algorithm again (accepted for
the shape, the reference's bits on the test data); a stored choice that fails is measured afresh.
"""
from __future__ import annotations

import numpy as np

from prefixrun.kernels import cublas
from prefixrun.kernels.gemm_choices import ChoiceStore, fastest

HEURISTIC_ANSWERS = 12  # asked of the heuristics per row count
MAX_CANDIDATES = 64  # per bucket, the heuristics' answers first
MAX_CHECKS = 512  # configurations offered to cublasLtMatmulAlgoCheck per bucket
TIMING_REPS = 3
DROP_SLOWER = 1.5  # a candidate whose first run takes this many times the best so far is not run again
VERIFY_MAX_N = 16384  # columns of test data at most (an LM head's first ones: a kernel's order is per element)
# decode-sized buckets (rows up to TIMED_WIDE_ROWS) are timed on as many of the shape's own columns as fit in
# TIMED_WEIGHT_BYTES (how fast a kernel is at few rows depends on how many column tiles it spreads over: an LM
# head's first 16,384 columns ranked its kernels wrongly) and BATCHED launches back to back per timing (one launch
# of a few microseconds would time the host's call as much as the kernel); larger buckets on the test data's
TIMED_WIDE_ROWS = 256
TIMED_WEIGHT_BYTES = 256 << 20
BATCHED = 4
# and the launches of a timing take turns over copies of the weight filling this many bytes (a few), so a weight
# that fits in the L2 cache is read from memory, as a decode step reads it, not from the cache
TIMED_ROTATION_BYTES = 128 << 20
# each timing starts behind a kernel that spins this many clock cycles (~0.2 ms), so the host has queued the timed
# launches before the first one runs: back to back on the device, whatever one launch costs the host (a decode-sized
# GEMM takes 10-30 us, about what its call through ctypes takes, so an unspaced timing measured the host)
SPACER_CYCLES = 400_000
_SPACER_SOURCE = r"""extern "C" __global__ void gemm_timing_spacer(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""
_SPACER = []
TEST_SEED = 20261203
NP_TYPES = {code: dtype for dtype, code in cublas._DATA_TYPES.items()}
BITS = {2: np.uint16, 4: np.uint32}


def algo_hex(algo) -> str:
    return bytes(algo.data).hex()


def pair_buckets(gemm, n: int, k: int, a_type: int, c_type: int, compute: int, base, buckets) -> dict:
    """bucket -> (algorithm, PinnedAlgo) for each of `buckets` (row counts, ascending), `base` = (the reference
    algorithm, its PinnedAlgo) serving where nothing faster gives its bits. `gemm`: a kernels/cublaslt.py
    PinnedGemm."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)  # never a capturing stream; synchronised alone
    with stream:
        bench = CandidateBench(gemm, n, k, a_type, c_type, compute, base[0], buckets)
        store = ChoiceStore(gemm.machine(), bench.buckets)
        shape = (f"{n}x{k}:{a_type}:{c_type}:{compute}:rows{gemm.reference_rows}:reduction{gemm.reduction_mask}"
                 f":workspace{gemm.workspace.nbytes}")
        reference = algo_hex(base[0])
        chosen = bench.stored(store.entry(shape, reference))
        if chosen is None:
            chosen = {b: bench.fastest_agreeing(b) for b in bench.buckets}
            store.save(shape, reference, {b: algo_hex(algo) for b, algo in chosen.items()})
        out = {}
        for b, algo in chosen.items():
            if algo_hex(algo) == reference:
                out[b] = base
            else:
                out[b] = (algo, gemm.describe(algo, gemm.check(algo, n, k, a_type, c_type, compute, b) or 0))
        stream.synchronize()
    return out


class CandidateBench:
    """Fixed test data of one shape, the reference algorithm's product of it, and candidates checked and timed
    against it (on the caller's stream, with a workspace of its own: the handle's may be in use elsewhere)."""

    def __init__(self, gemm, n: int, k: int, a_type: int, c_type: int, compute: int, reference, buckets):
        import cupy

        self.cupy, self.gemm, self.buckets = cupy, gemm, tuple(buckets)
        self.n, self.k, self.types, self.compute = n, k, (a_type, c_type), compute
        self.reference = reference
        nt, rows = min(n, VERIFY_MAX_N), self.buckets[-1]
        in_dt, out_dt = NP_TYPES[a_type], NP_TYPES[c_type]
        self.workspace = cupy.empty(gemm.workspace.nbytes, np.uint8)
        rng = cupy.random.RandomState(TEST_SEED)
        self.w, self.x = (test_values(rng, shape, in_dt) for shape in ((nt, k), (rows, k)))
        self.ref, self.y = cupy.empty((rows, nt), out_dt), cupy.empty((rows, nt), out_dt)
        self.bits = BITS[out_dt.itemsize]
        self._run(reference, rows, self.ref)
        self.wide = min(n, max(nt, TIMED_WEIGHT_BYTES // (k * in_dt.itemsize)))  # the timed weights' rows
        self._timed = None

    @property
    def timed(self) -> tuple[list, object]:
        """(copies of a weight `wide` rows long, an output of TIMED_WIDE_ROWS rows) for the decode-sized buckets'
        timings, made on first use (a stored choice is checked without them; contents never matter to a time)."""
        if self._timed is None:
            in_dt, out_dt = self.w.dtype, self.y.dtype
            wide, k = self.wide, self.k
            copies = max(1, min(BATCHED, -(-TIMED_ROTATION_BYTES // (wide * k * in_dt.itemsize))))
            self._timed = ([self.cupy.empty((wide, k), in_dt) for _ in range(copies)],
                           self.cupy.empty((min(self.x.shape[0], TIMED_WIDE_ROWS), wide), out_dt))
        return self._timed

    def rows_of(self, bucket: int) -> tuple[int, ...]:
        """The smallest and the largest row count of `bucket` (one where they are the same)."""
        below = max((b for b in self.buckets if b < bucket), default=0)
        return tuple(sorted({below + 1, bucket}))

    def _run(self, algo, m: int, out, w=None) -> bool:
        try:
            self.gemm.matmul(algo, self.x[:m], self.w if w is None else w, out[:m], self.compute, *self.types,
                             self.workspace)
        except cublas.CublasError:
            return False
        return True

    def accepted(self, algo, bucket: int) -> bool:
        """cuBLASLt takes `algo` for the real shape, the test data's and the timed one at both ends of `bucket`."""
        a_type, c_type = self.types
        return all(self.gemm.check(algo, n, self.k, a_type, c_type, self.compute, m) is not None
                   for n in {self.n, self.w.shape[0], self.wide} for m in self.rows_of(bucket))

    def agrees(self, algo, bucket: int) -> bool:
        """Every row of `algo`'s product equals the reference's, bit for bit, at both ends of `bucket`."""
        for m in self.rows_of(bucket):
            if not self._run(algo, m, self.y):
                return False
            if not bool(self.cupy.array_equal(self.y[:m].view(self.bits), self.ref[:m].view(self.bits))):
                return False
        return True

    def seconds(self, algo, bucket: int, best: float = float("inf")) -> float:
        """`algo`'s time at both ends of `bucket` (each the least of TIMING_REPS runs), or inf where its first
        runs already took DROP_SLOWER times `best`."""
        cupy = self.cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        least = {m: float("inf") for m in self.rows_of(bucket)}
        weights, y = self.timed if bucket <= TIMED_WIDE_ROWS else ([self.w], self.y)
        runs = BATCHED if bucket <= TIMED_WIDE_ROWS else 1
        for rep in range(TIMING_REPS):
            for m in least:
                if runs > 1:  # decode-sized: a launch costs the host about what it costs the device
                    spacer()
                start.record()
                for i in range(runs):
                    if not self._run(algo, m, y, weights[i % len(weights)]):
                        return float("inf")
                end.record()
                end.synchronize()
                least[m] = min(least[m], cupy.cuda.get_elapsed_time(start, end) / 1e3 / runs)
            if rep == 0 and sum(least.values()) > DROP_SLOWER * best:
                return float("inf")
        return sum(least.values())

    def candidates(self, bucket: int) -> list:
        """The bucket's candidates besides the reference, deduplicated: the heuristics' answers, then the
        configurations of the reference's algorithm id, then those of the answers' ids."""
        a_type, c_type = self.types
        seen, out = {algo_hex(self.reference)}, []
        ids = [self.gemm.describe(self.reference, 0).algo_id]

        def add(algo):
            h = algo_hex(algo)
            if h not in seen and len(out) < MAX_CANDIDATES:
                seen.add(h)
                out.append(algo)

        for m in self.rows_of(bucket):
            for algo, info in self.gemm.heuristics(self.n, self.k, a_type, c_type, self.compute, m,
                                                   HEURISTIC_ANSWERS):
                ids.append(info.algo_id)
                add(algo)
        checks = 0
        for algo_id in dict.fromkeys(ids):
            for algo in self.gemm.configurations(algo_id, a_type, c_type, self.compute):
                if len(out) >= MAX_CANDIDATES or checks >= MAX_CHECKS:
                    return out
                if algo_hex(algo) not in seen:
                    checks += 1
                    if self.accepted(algo, bucket):
                        add(algo)
        return out

    def fastest_agreeing(self, bucket: int):
        """The fastest of the reference and the bucket's candidates that give its bits."""
        algos = {algo_hex(self.reference): self.reference}
        times = {algo_hex(self.reference): self.seconds(self.reference, bucket)}
        for algo in self.candidates(bucket):
            if self.accepted(algo, bucket) and self.agrees(algo, bucket):
                h = algo_hex(algo)
                algos[h] = algo
                times[h] = self.seconds(algo, bucket, min(times.values()))
        return algos[fastest(times, algo_hex(self.reference))]

    def stored(self, entry: dict[int, str] | None) -> dict | None:
        """A stored choice {bucket: algorithm hex} as algorithms, if it covers every bucket and each algorithm is
        accepted for the shape and gives the reference's bits; else None."""
        if entry is None or set(entry) != set(self.buckets):
            return None
        out = {}
        for bucket, h in entry.items():
            algo = type(self.reference).from_buffer_copy(bytes.fromhex(h))
            if h != algo_hex(self.reference) and not (self.accepted(algo, bucket) and self.agrees(algo, bucket)):
                return None
            out[bucket] = algo
        return out


def spacer():
    """Queue SPACER_CYCLES of spinning on the current stream (one thread; the kernel compiled on first use)."""
    import cupy

    if not _SPACER:
        _SPACER.append(cupy.RawKernel(_SPACER_SOURCE, "gemm_timing_spacer"))
    _SPACER[0]((1,), (1,), (np.int64(SPACER_CYCLES),))


def test_values(rng, shape, dtype):
    """Random test data in `dtype`: fp32 normals, or bf16 / fp16 bit patterns of moderate magnitude (no casts)."""
    if dtype.itemsize == 4:
        return rng.standard_normal(shape).astype(np.float32)
    bits = rng.randint(0, 1 << 16, size=shape, dtype=np.int32)
    if dtype == np.dtype(np.float16):  # sign, exponent 12..17 (2^-3 .. 2^2), mantissa
        bits = (bits & 0x83FF) | ((12 + (bits >> 10) % 6) << 10)
    else:  # bf16: sign, exponent 124..129 (2^-3 .. 2^2), mantissa
        bits = (bits & 0x807F) | ((124 + (bits >> 7) % 6) << 7)
    return bits.astype(np.uint16).view(dtype)
