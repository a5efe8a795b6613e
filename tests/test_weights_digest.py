"""The weights' content digest (engine/load/weights_digest.py): the same value however many threads hash it and
as each tensor's own tree digest defines it, remembered across cache folders, never reused for changed files."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from prefixrun.engine.cache.blob_format import tree_digest
from prefixrun.engine.load import weights_digest
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.load.weights import CheckpointTensors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("digest") / "m", TINY_QWEN3_5, seed=4, shards=2)


def reference_digest(tensors: CheckpointTensors) -> str:
    """The definition, one tensor at a time: SHA-256 over name, dtype, shape and the tree digest of its bytes."""
    h = hashlib.sha256(b"prefixrun-weights-v2\0")
    for name in sorted(tensors.names()):
        arr = tensors.get(name)
        h.update(name.encode() + b"\0" + str(arr.dtype).encode() + str(arr.shape).encode() + b"\0")
        h.update(tree_digest(np.ascontiguousarray(arr).view(np.uint8).reshape(-1)).encode())
    return h.hexdigest()


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_digest_is_the_definition_whatever_the_threads(model, threads):
    tensors = CheckpointTensors(model)
    assert weights_digest.content_digest(tensors, threads) == reference_digest(tensors)


def test_chunks_of_large_tensors_hash_as_the_tree_does(tmp_path, monkeypatch):
    """Tensors of several chunks (the chunk size made small), an empty tensor, a scalar."""
    import safetensors.numpy

    from prefixrun.engine.cache import blob_format

    monkeypatch.setattr(blob_format, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(weights_digest, "CHUNK_BYTES", 1000)
    rng = np.random.default_rng(0)
    safetensors.numpy.save_file({"big": rng.standard_normal((77, 31)).astype(np.float32), "empty": np.zeros((0, 3)),
                                 "scalar": np.array(2.5, np.float32), "odd": np.arange(1001, dtype=np.uint8)},
                                str(tmp_path / "model.safetensors"))
    tensors = CheckpointTensors(tmp_path)
    assert weights_digest.content_digest(tensors, 4) == reference_digest(tensors)


def test_the_helper_process_hashes_as_this_process_does(model, monkeypatch):
    tensors = CheckpointTensors(model)
    expected = reference_digest(tensors)
    assert weights_digest.content_digest(tensors, 3, helper=False) == expected

    def no_threads(jobs, threads):
        raise AssertionError("hashed in process")

    monkeypatch.setattr(weights_digest, "_hash_in_process", no_threads)
    monkeypatch.setattr(weights_digest, "HELPER_MIN_BYTES", 0)
    assert weights_digest.content_digest(tensors, 3) == expected  # the helper's digests, not this process's


def test_small_weights_hash_in_this_process(model, monkeypatch):
    # a helper process costs more to start than a few megabytes cost to hash, and a fresh folder's key would then
    # arrive after the run's first lookups
    def no_helper(jobs, threads):
        raise AssertionError("a helper process started")

    monkeypatch.setattr(weights_digest, "chunk_digests", no_helper)
    tensors = CheckpointTensors(model)
    assert weights_digest.content_digest(tensors, 3) == reference_digest(tensors)


@pytest.mark.parametrize("executable", ["", "/bin/false", "/nonexistent/python"])
def test_a_helper_that_cannot_run_leaves_the_hashing_to_this_process(model, monkeypatch, executable):
    import sys

    tensors = CheckpointTensors(model)
    monkeypatch.setattr(sys, "executable", executable)
    monkeypatch.setattr(weights_digest, "HELPER_MIN_BYTES", 0)
    assert weights_digest.content_digest(tensors, 2) == reference_digest(tensors)


def _counting(monkeypatch) -> list:
    calls = []
    real = weights_digest.content_digest
    monkeypatch.setattr(weights_digest, "content_digest", lambda t, threads=None: calls.append(1) or real(t, threads))
    return calls


@pytest.fixture
def user_config(tmp_path, monkeypatch):
    """The user's own prefixrun folder (the signing key's, and the digest memos beside it) in a temporary place."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "prefixrun"


def test_a_new_cache_folder_finds_the_digest_any_earlier_run_computed(model, tmp_path, monkeypatch, user_config):
    calls = _counting(monkeypatch)
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "default"))
    first = CheckpointTensors(model).digest(tmp_path / "a" / "digests")  # a run with a folder of its own
    assert calls == [1]
    second = CheckpointTensors(model).digest(tmp_path / "b" / "digests")
    assert second == first and calls == [1]  # from the user's own memo
    assert list((tmp_path / "b" / "digests").glob("*.digest"))  # and now the new folder holds it too
    assert CheckpointTensors(model).digest(tmp_path / "c" / "digests") == first and calls == [1]


def test_the_memos_lie_in_the_run_folder_and_beside_the_key_and_nowhere_else(model, tmp_path, monkeypatch,
                                                                             user_config):
    calls = _counting(monkeypatch)
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "default"))
    CheckpointTensors(model).digest(tmp_path / "a" / "digests")
    assert calls == [1] and not (tmp_path / "default").exists()  # no other cache folder is written
    assert len(list((user_config / "digests").glob("*.digest"))) == 1
    assert len(list((tmp_path / "a" / "digests").glob("*.digest"))) == 1
    CheckpointTensors(model).digest(tmp_path / "a" / "digests")
    assert calls == [1]


def test_a_memo_planted_in_the_user_folder_or_a_cache_folder_is_not_believed(model, tmp_path, monkeypatch,
                                                                            user_config):
    """A memo naming another digest, signed with another key (or not at all), is hashed again in every place."""
    calls = _counting(monkeypatch)
    true = CheckpointTensors(model).digest(tmp_path / "a" / "digests")
    for memo in [*(user_config / "digests").glob("*.digest"), *(tmp_path / "a" / "digests").glob("*.digest")]:
        memo.write_text("f" * 64 + " " + "0" * 32 + "\n")
    assert CheckpointTensors(model).digest(tmp_path / "a" / "digests") == true and calls == [1, 1]


def test_a_changed_file_is_hashed_again_in_every_folder(tmp_path, monkeypatch, user_config):
    path = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=4)
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "default"))
    calls = _counting(monkeypatch)
    before = CheckpointTensors(path).digest(tmp_path / "default" / "digests")
    weights = path / "model.safetensors"
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # one byte of the last tensor, same size, the mtime put back
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    for folder in ("default", "b"):
        assert CheckpointTensors(path).digest(tmp_path / folder / "digests") != before
    assert len(calls) == 2  # the first folder hashed it again, the other found the user's new memo
    assert not (tmp_path / "b" / "digests").exists() or all(
        m.read_text().split()[0] != before for m in (tmp_path / "b" / "digests").glob("*.digest"))


def test_a_file_changed_while_it_is_hashed_is_not_remembered(tmp_path, monkeypatch):
    path = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=4)
    real = weights_digest.content_digest

    def hashed_then_changed(tensors, threads=None):
        value = real(tensors, threads)
        os.utime(path / "model.safetensors", ns=(1, 1))  # a writer came by meanwhile
        return value

    monkeypatch.setattr(weights_digest, "content_digest", hashed_then_changed)
    CheckpointTensors(path).digest(tmp_path / "a" / "digests")
    assert not list((tmp_path / "a" / "digests").glob("*.digest"))


def test_a_load_hashes_its_weights_after_reading_them(model, tmp_path):
    """Hashing and the weights' reads both read every byte: a load's digest waits for its reads (unless a memo
    holds it: then at once)."""
    import threading

    from prefixrun.engine.load import loader

    loading = loader.start_load(model, "cpu")
    got = []
    hashing = threading.Thread(target=lambda: got.append(loading.weights_digest(tmp_path / "a" / "digests")))
    hashing.start()
    hashing.join(0.5)
    assert hashing.is_alive() and not got  # the weights are not read yet
    loading.finish()
    hashing.join(60)
    assert got == [reference_digest(CheckpointTensors(model))]
    again = loader.start_load(model, "cpu")  # the memo now holds it: no wait for a load that never finishes
    assert again.weights_digest(tmp_path / "a" / "digests") == got[0]
    again.finish()
