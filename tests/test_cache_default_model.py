"""The embedded default model's folder lives in the cache folder, a place others may write (docs/RELIABILITY.md,
the threat model): a planted link never makes prefixrun build it outside, and edited, added, linked or forged
files are never run: the folder is rebuilt from what prefixrun embeds."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.model_maker import default_model_dir, ensure_default_model


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def contents(folder):
    """Each name's SHA-256 (a FIFO or anything not a file is named, never opened)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "not a file"
            for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """The files of a default model built in a folder nobody touched."""
    return contents(ensure_default_model(tmp_path_factory.mktemp("clean")))


def test_a_models_folder_planted_as_a_link_builds_nothing_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(outside)
    with pytest.raises(ModelLoadError, match="not a folder of its own"):
        ensure_default_model(tmp_path / "cache")
    assert list(outside.iterdir()) == []


def test_a_cache_folder_that_is_a_file_is_one_line_naming_it(tmp_path):
    """`--cache-dir FILE` without --model printed "[Errno 20] Not a directory: 'FILE'", naming no option."""
    planted = tmp_path / "a file"
    planted.write_text("x")
    with pytest.raises(ModelLoadError, match=r"cache folder .*a file cannot hold the default model .*--cache-dir"):
        ensure_default_model(planted)
    p = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", "-", "--cache-dir", str(planted)],
                       input='{"prompt": "x"}\n', capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == "" and planted.read_text() == "x"
    assert "\nerror: the cache folder " in p.stderr and "Errno" not in p.stderr, p.stderr


def _edit_config(folder):
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))


def _add_weights(folder):
    (folder / "model-extra.safetensors").write_bytes((folder / "model.safetensors").read_bytes())


def _add_fifo(folder):
    os.mkfifo(folder / "extra.json")


def _forge_manifest(folder):
    _edit_config(folder)
    manifest = folder.with_name(folder.name + ".manifest")
    forged = json.loads(manifest.read_text())
    forged["files"] = contents(folder)  # digests anyone can compute; the signature needs the user's key
    manifest.write_text(json.dumps(forged))


@pytest.mark.parametrize("tamper", [_edit_config, _add_weights, _add_fifo, _forge_manifest])
def test_a_tampered_default_model_is_rebuilt_never_run(tmp_path, genuine, tamper):
    cache = tmp_path / "cache"
    folder = ensure_default_model(cache)
    tamper(folder)
    again = ensure_default_model(cache)
    assert again == default_model_dir(cache) and not again.is_symlink()
    assert contents(again) == genuine


def test_a_default_model_folder_planted_as_a_link_is_replaced_and_its_target_untouched(tmp_path, genuine):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    folder = ensure_default_model(cache)
    os.rename(folder, outside)
    _edit_config(outside)
    before = contents(outside)
    folder.symlink_to(outside)
    again = ensure_default_model(cache)
    assert not again.is_symlink() and contents(again) == genuine
    assert contents(outside) == before


def test_batch_answers_of_a_tampered_default_model_equal_a_clean_run(tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"custom_id": "a", "prompt": "hello there", "max_tokens": 4}\n')
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}

    def run(cache):
        done = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(prompts), "-q", "--no-cache",
                               "--cache-dir", str(cache)], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return [json.loads(line)["token_ids"] for line in done.stdout.splitlines()]

    clean = run(tmp_path / "clean")
    _edit_config(default_model_dir(tmp_path / "clean"))
    assert run(tmp_path / "clean") == clean


def test_a_signing_key_inside_the_cache_folder_is_not_trusted(tmp_path):
    """XDG_CONFIG_HOME below the cache folder puts the key where whoever writes the folder reads it: the run goes
    on without the cache (one warning) and rebuilds the default model rather than trust its manifest."""
    cache, prompts = tmp_path / "cache", tmp_path / "in.jsonl"
    prompts.write_text('{"custom_id": "a", "prompt": "hello there", "max_tokens": 4}\n')
    env = {**os.environ, "XDG_CONFIG_HOME": str(cache / "config")}
    done = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(prompts), "--cache-dir",
                           str(cache)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "signing key" in done.stderr and "running without it" in done.stderr
    assert "Traceback" not in done.stderr
    _edit_config(default_model_dir(cache))
    manifest = default_model_dir(cache).with_name(default_model_dir(cache).name + ".manifest")
    forged = json.loads(manifest.read_text())
    forged["files"] = contents(default_model_dir(cache))
    import prefixrun.engine.cache.auth as auth
    key = bytes.fromhex((cache / "config" / "prefixrun" / "cache.key").read_text().strip())
    import hashlib as h
    message = "\0".join(["default-model", default_model_dir(cache).name,
                         json.dumps(forged["files"], sort_keys=True)]).encode()
    forged["signature"] = h.blake2b(message, key=key, digest_size=auth._TAG_BYTES).hexdigest()
    manifest.write_text(json.dumps(forged))  # signed with the key anyone writing the folder could read
    again = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(prompts), "--no-cache", "-q",
                            "--cache-dir", str(cache)], capture_output=True, text=True, env=env, timeout=300)
    clean = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(prompts), "--no-cache", "-q",
                            "--cache-dir", str(tmp_path / "clean")], capture_output=True, text=True,
                           env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}, timeout=300)
    assert [json.loads(x)["token_ids"] for x in again.stdout.splitlines()] == \
        [json.loads(x)["token_ids"] for x in clean.stdout.splitlines()]
