"""bench/seat_bytes.py: a seat's bytes by state region at the bench models' shapes, from their configs (the dry
build's regions on the CUDA backend's storage), and the auto --max-batch's candidate widths by K/V dtype: the
planner charges 8-bit K/V its smaller pages (an attention-only model's widths double), while on the 4b-like hybrid
the two recurrent slots of a seat keep it at 256."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bench_script

MIB = 1 << 20


@pytest.fixture(scope="module")
def seats():
    return bench_script("seat_bytes")


def _raw(name):
    return json.loads((Path(__file__).resolve().parents[1] / "bench" / "models" / f"{name}.json").read_text())


def test_the_hybrids_seat_is_its_recurrent_slots_and_its_kv_by_dtype(seats):
    raw = _raw("qwen3_5-4b-like")
    bf16, fp8 = seats.seat(raw, "auto", 64 << 30), seats.seat(raw, "fp8", 64 << 30)
    # 24 Gated DeltaNet layers: a 32 x 128 x 128 fp32 state and 3 columns of an 8192-channel bf16 convolution
    assert bf16["regions"][("recurrent", False)] == 24 * 32 * 128 * 128 * 4
    assert bf16["slot"] == fp8["slot"] == 24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    # 8 attention layers of 4 K/V heads x 256: 2 bytes a value, or 1 byte and an fp32 scale per 32 values
    assert bf16["kv_token"] == 8 * 2 * 4 * 256 * 2
    assert fp8["kv_token"] == 8 * 2 * 4 * 256 * (1 + 4 / 32)
    assert fp8["seat"] - 2 * fp8["slot"] == 72 * MIB and bf16["seat"] - 2 * bf16["slot"] == 128 * MIB


def test_eight_bit_kv_doubles_the_attention_only_widths_not_the_hybrids(seats):
    attention, hybrid = _raw("qwen3-4b-like"), _raw("qwen3_5-4b-like")
    state = 65 << 30  # about the default state memory for these models on an H200 (half its free memory)
    widths = {kv: seats.seat(attention, kv, state)["widths"] for kv in ("auto", "int8", "fp8")}
    assert widths["int8"] == widths["fp8"] == [2 * w for w in widths["auto"]], widths
    widths = {kv: seats.seat(hybrid, kv, state)["widths"] for kv in ("auto", "fp8")}
    assert max(widths["auto"]) == max(widths["fp8"]) == 256, widths  # twice 256 does not fit at 2,048 tokens


def test_the_script_prints_a_line_per_model_and_dtype(seats, capsys):
    assert seats.main(["qwen3_5-4b-like", "--kv", "auto,int8", "--state-gib", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "recurrent 48.00 MiB" in out[1] and "k_scale" in out[2]
