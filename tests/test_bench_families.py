"""bench/families.py (the Python side of bench/device_families.sh) and make-model's parallel draws: the smoke
configs are the bench configs shrunk, every family parses; a transformers pass stopped by its time limit shows as a
lower bound; large matrices drawn on threads give the same bits whatever the thread count (bf16 as ml_dtypes rounds),
and tiny models keep the values of the one sequential generator."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np

from conftest import bench_script
from prefixrun.engine.load import model_maker
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, tensor_shapes


def test_every_bench_family_has_a_smoke_config_of_its_own_family():
    fam = bench_script("families")
    for name, small in fam.SMOKE.items():
        full = fam.bench_config(name)
        cfg = parse_config({**full, **small})
        assert cfg.family == parse_config(full).family
        assert sum(np.prod(s) for s in tensor_shapes({**full, **small}).values()) < 2_000_000, name
    lines = fam.plan(["lfm2-like"])
    name, nbytes, params = lines[0].split()
    assert name == "lfm2-like" and int(nbytes) == 2 * int(params) and 1.0e9 < int(params) < 1.4e9


def test_a_stopped_transformers_pass_is_a_lower_bound(tmp_path):
    fam = bench_script("families")
    ours = {"wall_seconds": 2.0, "process_wall_seconds": 5.0}
    hf = {"wall_seconds": 20.0, "complete": False, "groups_timed": 1, "groups": 2, "group_size": 32,
          "estimated_wall_seconds": 40.0, "cache": "dynamic", "attn_implementation": "sdpa"}
    (tmp_path / "f-shared-system.json").write_text(json.dumps(ours))
    (tmp_path / "f-shared-system-hf.json").write_text(json.dumps(hf))
    (tmp_path / "f.doc-qa.why").write_text("skipped: 10 s left\n")
    row = fam.row("f", tmp_path)
    assert "> 20.00 (1 of 2 groups of 32" in row and "**> 10.0x** (≈ 20.0x) ✓" in row
    assert "skipped: 10 s left" in row and row.endswith("| not run |")
    (tmp_path / "f-shared-system-hf.json").write_text(json.dumps({**hf, "complete": True, "wall_seconds": 10.0}))
    assert "**5.0x** |" in fam.row("f", tmp_path)
    (tmp_path / "f-shared-system-hf.json").unlink()  # the timed pass failed inside the accuracy process
    (tmp_path / "f-shared-system-hf.why").write_text("OutOfMemoryError: at one request\n")
    assert "| transformers: OutOfMemoryError: at one request | — |" in fam.row("f", tmp_path)


def test_large_matrices_drawn_on_threads_do_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(model_maker, "PARALLEL_DRAW_ELEMENTS", 1000)
    monkeypatch.setattr(model_maker, "_DRAW_BLOCK", 300)
    shapes = {"a.weight": (40, 50), "b.norm.weight": (2000,), "c.weight": (3, 4), "d.A_log": (2000,)}
    draws = [model_maker._draw_all(shapes, np.random.default_rng(0), 5, 0.02, False, ml_dtypes.bfloat16, t)
             for t in (1, 3)]
    for name in shapes:
        assert np.array_equal(draws[0][name].view(np.uint16), draws[1][name].view(np.uint16)), name
    monkeypatch.setattr(model_maker, "PARALLEL_MODEL_ELEMENTS", 2000)  # a large model: every matrix on threads
    many = model_maker._draw_all(shapes, np.random.default_rng(0), 5, 0.02, False, ml_dtypes.bfloat16, 2)
    one = np.empty(12, ml_dtypes.bfloat16)
    model_maker._draw_block(one, 5, "c.weight", 0, 0.02)
    assert np.array_equal(many["c.weight"].reshape(-1).view(np.uint16), one.view(np.uint16))
    assert np.array_equal(many["b.norm.weight"].view(np.uint16), draws[0]["b.norm.weight"].view(np.uint16))
    flat = np.empty(300, ml_dtypes.bfloat16)
    model_maker._draw_block(flat, 5, "a.weight", 0, 0.02)
    want = np.random.default_rng([5, model_maker.zlib.crc32(b"a.weight"), 0]).standard_normal(300, np.float32)
    assert np.array_equal(flat.view(np.uint16), (want * np.float32(0.02)).astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.array_equal(draws[0]["a.weight"].reshape(-1)[:300].view(np.uint16), flat.view(np.uint16))
    assert abs(float(draws[0]["a.weight"].astype(np.float32).std()) - 0.02) < 0.002


def test_tiny_models_keep_the_sequential_generators_values():
    shapes = tensor_shapes(TINY_QWEN3_5)
    got = model_maker._draw_all(shapes, np.random.default_rng(3), 3, 0.05, True, ml_dtypes.bfloat16, 4)
    rng = np.random.default_rng(3)
    for name, shape in shapes.items():
        want = model_maker._init(name, shape, rng, 0.05, True).astype(ml_dtypes.bfloat16)
        assert np.array_equal(got[name].view(np.uint16), want.view(np.uint16)), name
