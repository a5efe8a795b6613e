"""A cache folder this user may not enter or write (another user's, a read-only one), as the kernel enforces it:
run as root, the commands run without root's power to override permissions (setpriv). `prefixrun batch` runs
without the cache (one warning) and `inspect-cache` says in one line that the folder cannot be opened, never a
traceback, never "damaged", never an offer to --clear what may be whole."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

import pytest

from conftest import cmd
from prefixrun.engine.cache import auth
from prefixrun.engine.cache.store import CheckpointStore
from test_cache_hostile_folder import KEY, TOKENS, cache_with_entries, put

OTHER_USER = 65534  # nobody
POWERS = "-dac_override,-dac_read_search,-fowner,-chown"


def as_plain_user(args: list[str]) -> list[str]:
    """`args` run under file permissions: as they are for a user; for root, without the powers that skip them."""
    if os.geteuid() != 0:
        return args
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    return ["setpriv", f"--inh-caps={POWERS}", f"--bounding-set={POWERS}", *args]


def _another_users(cache, mode: int) -> None:
    if os.geteuid() == 0:
        for path in [cache, *cache.rglob("*")]:
            os.chown(path, OTHER_USER, OTHER_USER, follow_symlinks=False)
    for path in (cache, cache / "checkpoints"):
        path.chmod(mode)


@pytest.mark.parametrize("args", [(), ("--verify",), ("--json",), ("--tree",), ("--clear", "--yes"),
                                  ("--prune-to", "0", "--yes")])
def test_inspect_cache_on_another_users_folder_is_one_line(tmp_path, args):
    cache = cache_with_entries(tmp_path)
    _another_users(cache, 0o700)
    try:
        p = subprocess.run(as_plain_user(cmd("inspect-cache", "--cache-dir", cache, *args)), capture_output=True,
                           text=True, timeout=120)
    finally:
        if os.geteuid() != 0:
            for path in (cache, cache / "checkpoints"):
                path.chmod(0o755)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "cannot be" in lines[0] and "permissions" in lines[0] and "damaged" not in lines[0]



def _batch(model_dir, cache, prompts, env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd("batch", prompts, "--model", model_dir, "--cache-dir", cache, "--device", "cpu",
                              "--cache-policy", "always"), capture_output=True, text=True, timeout=300, env=env)


def _tokens(done: subprocess.CompletedProcess) -> dict:
    return {r["custom_id"]: r["token_ids"] for r in map(json.loads, done.stdout.splitlines())}


def test_a_run_without_the_signing_key_leaves_the_users_entries_alone(model_dirs, tmp_path):
    """Where the key can be neither read nor made (a read-only home in a container), every entry looks unsigned;
    moving each one to quarantine/ with a warning apiece, and writing over rows the user's entries share, would
    spoil the user's cache: the run goes without the cache, in one warning, and `--verify` refuses to judge."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(f'{{"custom_id": "r{i}", "prompt_token_ids": {list(range(3, 300)) + [i + 5]}, '
                               f'"max_tokens": 4}}\n' for i in range(3)))
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "NO_COLOR": "1"}
    first = _batch(model_dirs["qwen3_5"], cache, prompts, env)
    assert first.returncode == 0, first.stderr
    files = sorted(p.relative_to(cache) for p in (cache / "checkpoints").rglob("*.safetensors"))
    assert files
    (tmp_path / "not-a-folder").write_text("")
    keyless = {**env, "XDG_CONFIG_HOME": str(tmp_path / "not-a-folder" / "config")}
    second = _batch(model_dirs["qwen3_5"], cache, prompts, keyless)
    warnings = [line for line in second.stderr.splitlines() if line.startswith("warning:")]
    assert second.returncode == 0 and _tokens(second) == _tokens(first), second.stderr
    assert len(warnings) == 1, second.stderr
    assert "no signing key" in warnings[0] and "leaves its entries alone" in warnings[0]
    assert sorted(p.relative_to(cache) for p in (cache / "checkpoints").rglob("*.safetensors")) == files
    verify = subprocess.run(cmd("inspect-cache", "--cache-dir", cache, "--verify"), capture_output=True, text=True,
                            timeout=120, env=keyless)
    assert verify.returncode == 1 and "without the signing key" in verify.stderr
    assert sorted(p.relative_to(cache) for p in (cache / "checkpoints").rglob("*.safetensors")) == files
    third = _batch(model_dirs["qwen3_5"], cache, prompts, env)  # the user's key again: every entry is a hit
    assert third.returncode == 0 and _tokens(third) == _tokens(first) and "warning:" not in third.stderr, third.stderr



def test_a_cache_signed_with_another_key_is_a_few_warnings_not_one_per_entry(tmp_path, monkeypatch, caplog):
    """A cache copied from another machine (another key): every entry fails alike. A warning apiece buried the
    run's output; the first few are said and one line says more follow (the report counts them all)."""
    root = tmp_path / "cache" / "checkpoints"
    prefixes = [TOKENS[:n] for n in range(4, 41, 4)]
    for config in ("config-a", "config-b"):
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / config))
        monkeypatch.setattr(auth, "_keys", {})
        with caplog.at_level(logging.WARNING), CheckpointStore(root) as store:
            for tokens in prefixes:
                if config == "config-a":
                    assert put(store, tokens)
                else:
                    assert store.lookup(KEY, tokens, len(tokens)) is None
            bad = store.stats.corrupt
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bad == len(prefixes) and len(said) == 4, said
    assert all("failed verification" in line for line in said[:3])
    assert said[3] == "more checkpoints failed verification; they are not shown one by one (the report counts them)"
