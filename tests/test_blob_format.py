"""engine.blob_format: a blob's bytes read once and hashed on several threads, its safetensors layout parsed from
that buffer with every field checked (the persistent cache's files are input: a damaged one must be an error
that names the problem, never a crash or a wrong tensor)."""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import safetensors.numpy

from prefixrun.engine.cache import blob_format
from prefixrun.engine.cache.blob_format import BlobFormatError, parse, read_file, serialize, tree_digest


def tensors():
    rng = np.random.default_rng(0)
    return {"state": rng.standard_normal((3, 5), dtype=np.float32), "kv": np.arange(14, dtype=np.uint16).reshape(7, 2),
            "empty": np.zeros((0, 4), np.float32), "__tokens__": np.arange(3, dtype=np.int32),
            "flag": np.array(True), "half": np.ones(3, np.float16)}


def test_round_trip_matches_safetensors_and_reads_back_bit_exact(tmp_path):
    payload = serialize(tensors(), {"prefixrun.format": "x"})
    assert payload == safetensors.numpy.save(tensors(), metadata={"prefixrun.format": "x"})  # plain safetensors
    path = tmp_path / "blob"
    path.write_bytes(payload)
    buffer, digest = read_file(path, len(payload))
    assert digest == tree_digest(payload)
    metadata, got = parse(buffer)
    assert metadata == {"prefixrun.format": "x"}
    for name, want in tensors().items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert got[name].tobytes() == want.tobytes(), name


def test_tree_digest_sees_every_byte_and_the_size(monkeypatch):
    monkeypatch.setattr(blob_format, "CHUNK_BYTES", 64)  # many chunks on a small buffer
    data = bytearray(np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    base = tree_digest(bytes(data))
    for i in (0, 63, 64, 500, 999):
        flipped = bytearray(data)
        flipped[i] ^= 1
        assert tree_digest(bytes(flipped)) != base, i
    assert tree_digest(bytes(data) + b"\0") != base and tree_digest(bytes(data[:-1])) != base
    chunks = [hashlib.sha256(bytes(data[i:i + 64])).digest() for i in range(0, 1000, 64)]
    assert base == hashlib.sha256(blob_format.TREE_LABEL + (1000).to_bytes(8, "little") + b"".join(chunks)).hexdigest()


def test_a_file_of_another_length_than_recorded_is_an_error(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100)
    with pytest.raises(BlobFormatError, match="longer"):
        read_file(path, 50)
    with pytest.raises(BlobFormatError, match="shorter"):
        read_file(path, 150)
    with pytest.raises(FileNotFoundError):
        read_file(tmp_path / "gone", 10)


def blob(header: dict, data: bytes = b"") -> np.ndarray:
    raw = json.dumps(header).encode()
    return np.frombuffer(struct.pack("<Q", len(raw)) + raw + data, np.uint8)


@pytest.mark.parametrize("buffer, problem", [
    (np.zeros(4, np.uint8), "shorter than a safetensors header"),
    (np.frombuffer(struct.pack("<Q", 1 << 40) + b"{}", np.uint8), "header length"),
    (np.frombuffer(struct.pack("<Q", 3) + b"{x}", np.uint8), "not JSON"),
    (np.frombuffer(struct.pack("<Q", 2) + b"\xff\xfe", np.uint8), "not JSON"),
    (blob([1, 2]), "not a JSON object"),
    (blob({"__metadata__": {"a": 1}}), "metadata"),
    (blob({"t": {"dtype": "F32", "shape": [1]}}), "malformed entry"),
    (blob({"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "unknown dtype"),
    (blob({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "bad shape"),
    (blob({"t": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}, b"\0" * 4), "bad shape"),
    (blob({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "outside the data"),
    (blob({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, b"\0" * 8), "outside the data"),
    (blob({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "bytes for shape"),
    (blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), "overlap"),
])
def test_malformed_layouts_are_named(buffer, problem):
    with pytest.raises(BlobFormatError, match=problem):
        parse(buffer)


def test_streamed_write_is_safetensors_with_the_digest_of_its_bytes(tmp_path):
    from prefixrun.engine.cache import blob_format
    big = np.arange(3 * (blob_format.CHUNK_BYTES // 4) + 5, dtype=np.float32)  # chunk boundaries inside a tensor
    cases = [tensors(), {"big": big, "small": np.arange(3, dtype=np.int16), "z": np.zeros((0, 4), np.uint16),
                         "s": np.array(7, np.int64), "b": np.array([True, False])}]
    for i, case in enumerate(cases):
        path = tmp_path / f"{i}.safetensors"
        with open(path, "wb") as handle:
            size, digest = blob_format.write_file(handle, case, {"prefixrun.format": "x"})
        data = path.read_bytes()
        assert size == len(data) and digest == tree_digest(data)
        loaded = safetensors.numpy.load(data)  # the official reader takes it
        metadata, parsed = parse(np.frombuffer(data, np.uint8))
        assert metadata == {"prefixrun.format": "x"} and set(loaded) == set(parsed) == set(case)
        for name, array in case.items():
            assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array)
            assert np.array_equal(parsed[name], array)
        buffer, read_digest = read_file(path, size)
        assert read_digest == digest
    with pytest.raises(ValueError):
        with open(tmp_path / "bad", "wb") as handle:
            blob_format.write_file(handle, {"t": np.zeros((4, 4), np.float32)[:, ::2]}, {})


@pytest.mark.parametrize("most", [1, 7, 48, 1 << 30])
def test_a_file_is_written_in_one_writev_and_whole_through_short_writes(tmp_path, monkeypatch, most):
    """The header and every tensor go to the file in one writev (a writing thread takes the interpreter's lock back
    once a file, not once a tensor); a write of fewer bytes continues where it stopped, inside a piece or at its
    edge, and the file is the same."""
    from prefixrun.engine.cache import blob_format
    rng = np.random.default_rng(2)
    case = {"a": rng.standard_normal((5, 9), dtype=np.float32), "b": np.arange(11, dtype=np.uint16),
            "c": np.zeros((0, 3), np.float32), "d": rng.integers(0, 255, 37, dtype=np.uint8)}
    with open(tmp_path / "plain.safetensors", "wb") as handle:
        blob_format.write_file(handle, case, {"k": "v"})
    real, calls = blob_format.os.writev, []

    def short_writev(descriptor, buffers):
        calls.append(len(buffers))
        joined = b"".join(bytes(b) for b in buffers)[:most]
        return real(descriptor, [joined])

    monkeypatch.setattr(blob_format.os, "writev", short_writev)
    path = tmp_path / "short.safetensors"
    with open(path, "wb") as handle:
        size, digest = blob_format.write_file(handle, case, {"k": "v"})
    assert path.read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert size == path.stat().st_size and digest == tree_digest(path.read_bytes())
    assert calls[0] == 4  # the header, a, b, d: the empty tensor is no piece
    assert len(calls) == (1 if most >= size else -(-size // most))


def test_read_into_places_fills_them_with_the_files_tensors_and_checks_the_fit(tmp_path):
    from prefixrun.engine.cache import blob_format
    case = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.uint16)}
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as handle:
        size, digest = blob_format.write_file(handle, case, {"k": "v"})
    places = {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.uint16)}
    metadata, got = blob_format.read_into(path, size, lambda names: places)
    assert metadata == {"k": "v"} and got == digest == tree_digest(path.read_bytes())
    assert all(np.array_equal(places[n], case[n]) for n in case)
    for wrong in ({"a": np.zeros((4, 3), np.float32), "b": np.zeros(5, np.uint16)},
                  {"a": np.zeros((3, 4), np.float64), "b": np.zeros(5, np.uint16)},
                  {"a": np.zeros((3, 8), np.float32)[:, ::2], "b": np.zeros(5, np.uint16)}):
        with pytest.raises(BlobFormatError):
            blob_format.read_into(path, size, lambda names, wrong=wrong: wrong)
    with pytest.raises(BlobFormatError):  # a size other than the file's
        blob_format.read_into(path, size - 1, lambda names: places)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert blob_format.read_into(path, size, lambda names: places)[1] != digest  # the caller compares digests


@pytest.mark.parametrize("most", [1, 7, 48, 1000])
def test_read_into_fills_every_tensor_through_short_reads(tmp_path, monkeypatch, most):
    """All tensors of a file are read with one preadv over their buffers; a read that returns fewer bytes (a
    signal, a network file system) continues where it stopped, inside a tensor or at its edge."""
    rng = np.random.default_rng(1)
    case = {"a": rng.standard_normal((5, 9), dtype=np.float32), "b": np.arange(11, dtype=np.uint16),
            "c": np.zeros((0, 3), np.float32), "d": rng.integers(0, 255, 37, dtype=np.uint8)}
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as handle:
        size, digest = blob_format.write_file(handle, case, {})
    real, calls = blob_format.os.preadv, []

    def short_preadv(descriptor, buffers, offset):
        calls.append(len(buffers))
        budget, taken = most, []
        for buffer in buffers:  # the kernel fills the buffers in order: give it at most `most` bytes in all
            if budget <= 0:
                break
            taken.append(memoryview(buffer)[:budget])
            budget -= len(taken[-1])
        return real(descriptor, taken, offset)

    monkeypatch.setattr(blob_format.os, "preadv", short_preadv)
    places = {name: np.full_like(array, 0) for name, array in case.items()}
    _, got = blob_format.read_into(path, size, lambda names: places)
    assert got == digest
    assert all(np.array_equal(places[n], case[n]) for n in case)
    if most >= 1000:
        assert calls == [3]  # every non-empty tensor in one call
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(BlobFormatError):
        blob_format.read_into(path, size, lambda names: places)
