"""kernels/gemm_choices.py on the CPU: the deterministic GEMMs' measured choices on disk are read back only when they
are well formed, name this machine and were made against this process's reference algorithm; anything else in the
file (corrupt, planted, another machine's, oversized) is ignored, and a folder that cannot be written is no error.
(The stored algorithms are checked again on the device before use: tests/test_cuda_deterministic.py.)"""
from __future__ import annotations

import json
import os

import pytest

from prefixrun.kernels.gemm_choices import FORMAT, MAX_FILE_BYTES, ChoiceStore, choices_path, fastest

MACHINE = {"gpu": "Some GPU", "capability": "9.0", "sms": 132, "driver": 13000, "runtime": 13000, "cublaslt": 130100}
BUCKETS = (1, 16, 64, 256, 1024, 4096)
REF, A, B = "0" * 128, "a" * 128, "0b" * 64


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "home"))
    return ChoiceStore(MACHINE, BUCKETS)


def test_a_saved_choice_reads_back_in_another_store(store, tmp_path):
    assert store.path.parent == tmp_path / "home" / "measured" and store.path.name.startswith("gemm-")
    chosen = {b: (A if b < 256 else REF) for b in BUCKETS}
    assert store.save("2560x9216:14:14:68", REF, chosen)
    assert store.save("18432x2560:14:14:68", REF, {1: B})  # a second shape keeps the first
    again = ChoiceStore(MACHINE, BUCKETS)
    assert again.entry("2560x9216:14:14:68", REF) == chosen
    assert again.entry("18432x2560:14:14:68", REF) == {1: B}
    assert again.entry("2560x4096:14:14:68", REF) is None
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]  # no temporary file left


def test_another_reference_or_machine_does_not_read_the_choice(store):
    store.save("s", REF, {1: A})
    assert ChoiceStore(MACHINE, BUCKETS).entry("s", B) is None  # chosen against another reference algorithm
    other = dict(MACHINE, driver=12080)
    assert choices_path(other) != choices_path(MACHINE)
    assert ChoiceStore(other, BUCKETS, path=store.path).entry("s", REF) is None  # the file names another machine
    assert ChoiceStore(MACHINE, (1, 64), path=store.path).entry("s", REF) == {1: A}


@pytest.mark.parametrize("content", [
    b"", b"not json", b"\xff\xfe\x00", b"[]", b"null", b'{"format": 1}', b"[" * 100000,
    json.dumps({"format": FORMAT - 1, "machine": MACHINE, "entries": {"s": {"reference": REF, "buckets": {"1": A}}}}
               ).encode(),
    json.dumps({"format": FORMAT, "machine": MACHINE, "entries": []}).encode(),
])
def test_a_corrupt_file_is_ignored_and_replaced(store, content):
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(content)
    assert store.entry("s", REF) is None
    assert store.save("s", REF, {1: A}) and store.entry("s", REF) == {1: A}


@pytest.mark.parametrize("record", [
    {"reference": REF, "buckets": {"1": A.upper()}},  # not lower-case hex
    {"reference": REF, "buckets": {"1": A[:-2]}},  # 63 bytes
    {"reference": REF, "buckets": {"1": A + "00"}},
    {"reference": REF, "buckets": {"2": A}},  # not a bucket
    {"reference": REF, "buckets": {"1": 7}},
    {"reference": REF, "buckets": [A]},
    {"reference": "zz" * 64, "buckets": {"1": A}},
    {"reference": REF, "buckets": {"1": A}, "extra": 1},
    {"reference": REF},
    "text",
])
def test_a_malformed_entry_is_dropped_alone(store, record):
    doc = {"format": FORMAT, "machine": MACHINE, "entries": {"bad": record, "good": {"reference": REF,
                                                                               "buckets": {"16": B}}}}
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps(doc))
    assert store.entry("bad", REF) is None
    assert store.entry("good", REF) == {16: B}
    assert not store.save("bad", REF, {1: "nope"})  # an invalid choice is never written
    assert store.entry("good", REF) == {16: B}


def test_a_link_a_fifo_or_a_folder_in_its_place_is_not_read(store, tmp_path):
    """Nothing is followed or waited on: a planted link (to a valid file), a FIFO (would block a plain open) and a
    folder are each ignored, and the next save replaces the name with a file of its own."""
    valid = tmp_path / "elsewhere.json"
    ChoiceStore(MACHINE, BUCKETS, path=valid).save("s", REF, {1: A})
    store.path.parent.mkdir(parents=True)
    for plant in (lambda p: p.symlink_to(valid), lambda p: os.mkfifo(p), lambda p: p.mkdir()):
        plant(store.path)
        assert store.entry("s", REF) is None
        if store.path.is_dir() and not store.path.is_symlink():
            store.path.rmdir()
        else:
            assert store.save("s", REF, {16: B}) and store.entry("s", REF) == {16: B}
            assert store.path.is_file() and not store.path.is_symlink()
            assert ChoiceStore(MACHINE, BUCKETS, path=valid).entry("s", REF) == {1: A}  # the link's target kept
            store.path.unlink()


def test_a_link_planted_as_the_measured_folder_is_neither_read_through_nor_written_into(store, tmp_path):
    """A cache folder others may write can hold measured/ as a link to a folder elsewhere: its file is not read
    and nothing is written there (the save fails quietly; the next process measures again)."""
    elsewhere = tmp_path / "elsewhere"
    ChoiceStore(MACHINE, BUCKETS, path=elsewhere / store.path.name).save("s", REF, {1: A})
    before = sorted(p.name for p in elsewhere.iterdir())
    store.path.parent.parent.mkdir(parents=True)
    store.path.parent.symlink_to(elsewhere, target_is_directory=True)
    assert store.entry("s", REF) is None
    assert store.save("s", REF, {16: B}) is False
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert ChoiceStore(MACHINE, BUCKETS, path=elsewhere / store.path.name).entry("s", REF) == {1: A}


def test_an_oversized_file_is_not_read(store):
    doc = {"format": FORMAT, "machine": MACHINE, "entries": {"s": {"reference": REF, "buckets": {"1": A}}},
           "padding": "x" * MAX_FILE_BYTES}
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps(doc))
    assert store.entry("s", REF) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_that_cannot_be_written_is_no_error(store):
    store.path.parent.parent.mkdir(parents=True)
    store.path.parent.parent.chmod(0o500)
    try:
        assert store.save("s", REF, {1: A}) is False
        assert store.entry("s", REF) is None
    finally:
        store.path.parent.parent.chmod(0o700)


def test_a_file_where_the_folder_should_be_is_no_error(store):
    store.path.parent.parent.mkdir(parents=True)
    store.path.parent.write_text("a file")
    assert store.save("s", REF, {1: A}) is False
    assert store.entry("s", REF) is None


def test_the_fastest_candidate_wins_and_the_reference_breaks_ties():
    assert fastest({REF: 3.0, A: 1.0, B: 2.0}, REF) == A
    assert fastest({A: 1.0, REF: 1.0}, REF) == REF
    assert fastest({REF: float("inf"), A: float("nan"), B: 5.0}, REF) == B
    assert fastest({}, REF) == REF
    assert fastest({A: float("nan")}, REF) == REF
