"""kernels/cublaslt_search.py's choice on the CPU, with NumPy standing in for CuPy and a fake cuBLASLt whose
"algorithms" sum in one of two orders and cost a known time on a virtual clock: each bucket takes the fastest
algorithm that gives the reference's bits (never a faster one with other bits), a later choice reads the stored
one back, and a planted algorithm with other bits is measured away. (The device's own: tests/test_cuda_deterministic.py.)"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels import cublas
from prefixrun.kernels.cublaslt_lib import LtAlgo

BF16 = cublas._DATA_TYPES[np.dtype(ml_dtypes.bfloat16)]
BUCKETS = (1, 16, 64)
CLOCK = [0.0]  # ms on the fake device


def _fake_cupy():
    class Stream:
        def __init__(self, non_blocking=False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    class Event:
        def record(self):
            self.t = CLOCK[0]

        def synchronize(self):
            pass

    class RandomState:
        def __init__(self, seed):
            self.rng = np.random.RandomState(seed)

        def randint(self, lo, hi, size, dtype):
            return self.rng.randint(lo, hi, size=size, dtype=dtype)

        def standard_normal(self, shape):
            return self.rng.standard_normal(shape)

    def RawKernel(source, name):  # the timing spacer queued before decode-sized timings: no device time here
        def launch(grid, block, args):
            pass
        return launch

    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, get_elapsed_time=lambda a, b: b.t - a.t)
    return types.SimpleNamespace(cuda=cuda, empty=np.zeros, array_equal=np.array_equal, RawKernel=RawKernel,
                                 random=types.SimpleNamespace(RandomState=RandomState))


@dataclass
class Info:
    algo_id: int


def algo(ident: int, reversed_sum: bool, ms_per_row: float) -> LtAlgo:
    a = LtAlgo()
    a.data[0], a.data[1], a.data[2] = ident, int(reversed_sum), int(ms_per_row * 1000)
    return a


class FakeGemm:
    """Heuristic answers and configurations of known cost; algorithms with data[1] set give other bits; matmul
    advances the virtual clock by the algorithm's cost per row."""

    reference_rows, reduction_mask = 256, 0

    def __init__(self, offers):
        self.workspace = np.zeros(64, np.uint8)
        self.offers = offers

    def machine(self):
        return {"gpu": "fake"}

    def heuristics(self, n, k, a_type, c_type, compute, m, count=1):
        return [(a, Info(int(a.data[0]))) for a in self.offers[:count]]

    def configurations(self, algo_id, a_type, c_type, compute):
        return iter(())

    def check(self, a, n, k, a_type, c_type, compute, m):
        return 0

    def describe(self, a, workspace_bytes):
        return Info(int(a.data[0]))

    def matmul(self, a, x, w, out, compute, a_type, c_type, workspace=None):
        prod = x.astype(np.float32) @ w.astype(np.float32).T
        if a.data[1]:  # another summation order: here, other last bits in every element
            prod = prod * np.float32(1 + 2 ** -6)
        out[...] = prod.astype(out.dtype)
        CLOCK[0] += a.data[2] / 1000 * x.shape[0]


@pytest.fixture
def search(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path))
    from prefixrun.kernels import cublaslt_search

    monkeypatch.setattr(cublaslt_search, "_SPACER", [])  # the fake's spacer is never kept for a real device
    return cublaslt_search


def _chosen(search, gemm, base):
    got = search.pair_buckets(gemm, 48, 40, BF16, BF16, 68, (base, Info(int(base.data[0]))), BUCKETS)
    return {b: int(a.data[0]) for b, (a, _) in got.items()}


def test_the_fastest_algorithm_with_the_references_bits_wins(search):
    base = algo(1, False, 3.0)
    offers = [algo(2, True, 0.5),  # fastest, other bits: never
              algo(3, False, 2.0), algo(4, False, 1.0), algo(5, False, 4.0)]
    assert _chosen(search, FakeGemm(offers), base) == {1: 4, 16: 4, 64: 4}
    slow = [algo(6, False, 5.0), algo(7, True, 0.1)]
    assert _chosen(search, FakeGemm(slow), algo(8, False, 2.0)) == {1: 8, 16: 8, 64: 8}  # the reference itself


def test_a_stored_choice_is_read_back_and_a_planted_one_measured_away(search):
    import json

    from prefixrun.kernels.gemm_choices import ChoiceStore

    base = algo(1, False, 3.0)
    gemm = FakeGemm([algo(3, False, 2.0), algo(4, False, 1.0)])
    assert _chosen(search, gemm, base) == {1: 4, 16: 4, 64: 4}
    # the stored choice is used without timing again (offers changed: a fresh search would pick 9)
    gemm.offers = [algo(9, False, 0.2)]
    assert _chosen(search, gemm, base) == {1: 4, 16: 4, 64: 4}
    store = ChoiceStore(gemm.machine(), BUCKETS)
    doc = json.loads(store.path.read_text())
    (shape, entry), = doc["entries"].items()
    entry["buckets"]["16"] = search.algo_hex(algo(2, True, 0.5))  # planted: other bits
    store.path.write_text(json.dumps(doc))
    assert _chosen(search, gemm, base) == {1: 9, 16: 9, 64: 9}  # measured afresh, with today's offers
    assert json.loads(store.path.read_text())["entries"][shape]["buckets"]["16"] == search.algo_hex(algo(9, False,
                                                                                                            0.2))
