"""A fresh cache folder's first run does not hash the weights before its engine runs (engine/cache/pending_key.py):
the key is made while the run computes, lookups miss meanwhile, the writer waits for it, and every entry is
written under the key a later run computes; a folder with entries keeps the key made up front."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from prefixrun.engine.cache.keys import StoreKey
from prefixrun.engine.cache.pending_key import PendingKey
from prefixrun.engine.cache.opening import open_cache
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

DOCUMENT = list(range(3, 203))
FIRST = [DOCUMENT + [300 + i, 400 + i] for i in range(3)]
SECOND = [DOCUMENT + [310 + i, 410 + i] for i in range(3)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("m") / "model", TINY_QWEN3_5, seed=5, init_std=0.05)
    return loader.load(path, "cpu")


@pytest.fixture(autouse=True)
def user_memos(tmp_path, monkeypatch):
    """The user's own folder (signing key, digest memos beside it) of this test alone."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "prefixrun" / "digests"


def forget_digests(*folders):
    """Every memo of the weights' digest in `folders` removed: the next run hashes them again."""
    for folder in folders:
        for memo in folder.glob("*.digest"):
            memo.unlink()


class HeldDigest:
    """The weights' hashing held until `release` (a 4B model's takes most of a second); counts the hashings."""

    def __init__(self, monkeypatch, loaded):
        self.gate, self.started, self.hashed = threading.Event(), threading.Event(), 0
        real = type(loaded).weights_digest

        def digest(model, memo_dir=None, *, remembered_only=False):
            if not remembered_only:
                self.started.set()
                assert self.gate.wait(20)
                self.hashed += 1
            return real(model, memo_dir, remembered_only=remembered_only)

        monkeypatch.setattr(type(loaded), "weights_digest", digest)

    def release(self):
        self.gate.set()


def run(loaded, persist, prompts):
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8), persist=persist)
    persist.watch_prefill(engine.stats)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0), i) for i, p in enumerate(prompts)]
    tokens = {r.custom_id: r.token_ids for r in engine.run(requests)}
    engine.close()
    return tokens, engine.stats


def test_a_fresh_folders_key_is_made_while_the_run_computes_and_its_writes_wait_for_it(loaded, tmp_path,
                                                                                     monkeypatch, user_memos):
    expected_first, _ = run(loaded, open_cache(tmp_path / "other", 1 << 30, loaded, 16, "always")[0], FIRST)
    expected_second, _ = run(loaded, open_cache(tmp_path / "other2", 1 << 30, loaded, 16, "always")[0], SECOND)
    forget_digests(user_memos)  # a model no run has hashed yet
    held = HeldDigest(monkeypatch, loaded)
    persist, problem = open_cache(tmp_path / "cache", 1 << 30, loaded, 16, "always")
    assert problem is None and persist.key is None  # opened without waiting for the hashing
    time.sleep(0.2)
    assert not held.started.is_set()  # nor hashing beside the weights' upload: it begins once the pools exist
    tokens, stats = run(loaded, persist, FIRST)  # the whole run computes while the key is being made
    assert held.started.wait(20)
    assert tokens == expected_first and stats.reused_from_disk_tokens == 0
    assert persist.key is None and persist.costs.written_bytes == 0  # the writer waits for the key
    held.release()
    persist.finish()
    assert isinstance(persist.key, StoreKey) and persist.costs.written_bytes > 0 and held.hashed == 1
    persist.close()
    # the next run finds the digest remembered and the entries under the key it makes up front
    persist, problem = open_cache(tmp_path / "cache", 1 << 30, loaded, 16, "always")
    assert problem is None and isinstance(persist.key, StoreKey) and held.hashed == 1
    tokens, stats = run(loaded, persist, SECOND)
    persist.finish()
    persist.close()
    assert tokens == expected_second and stats.reused_from_disk_tokens >= len(DOCUMENT) * len(SECOND)


def test_a_folder_with_entries_makes_the_key_before_the_run(loaded, tmp_path, monkeypatch, user_memos):
    persist, _ = open_cache(tmp_path / "cache", 1 << 30, loaded, 16, "always")
    run(loaded, persist, FIRST)
    persist.finish()
    persist.close()
    # forgotten (e.g. the model's files were touched): the index still has entries to find
    forget_digests(tmp_path / "cache" / "digests", user_memos)
    held = HeldDigest(monkeypatch, loaded)
    held.release()
    persist, problem = open_cache(tmp_path / "cache", 1 << 30, loaded, 16, "always")
    assert problem is None and isinstance(persist.key, StoreKey) and held.hashed == 1
    persist.close()


def test_weights_that_cannot_be_hashed_cost_the_cache_not_the_run(loaded, tmp_path, monkeypatch, caplog):
    expected, _ = run(loaded, open_cache(tmp_path / "other", 1 << 30, loaded, 16, "always")[0], FIRST)

    def broken(model, memo_dir=None, *, remembered_only=False):
        if remembered_only:
            return None
        raise OSError("the weights' file went away")

    monkeypatch.setattr(type(loaded), "weights_digest", broken)
    persist, problem = open_cache(tmp_path / "cache", 1 << 30, loaded, 16, "always")
    assert problem is None
    with caplog.at_level(logging.WARNING):
        tokens, _ = run(loaded, persist, FIRST)
        persist.finish()
    persist.close()
    assert tokens == expected and persist.store_error is not None and persist.costs.written_bytes == 0
    assert "weights' digest" in caplog.text


def test_a_pending_key_raises_at_wait_what_making_it_raised():
    pending = PendingKey(lambda: "ab" * 32, "cd" * 32)
    assert pending.wait() == StoreKey("ab" * 32, "cd" * 32) == pending.known()
    failing = PendingKey(lambda: (_ for _ in ()).throw(ValueError("no")), "cd" * 32)
    with pytest.raises(ValueError):
        failing.wait()
    assert failing.known() is None
