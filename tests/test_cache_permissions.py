"""A cache folder this user may not enter or write (another user's, a read-only one), as the kernel enforces it:
run as root, the commands run without root's power to override permissions (setpriv). `prefixrun batch` runs
without the cache (one warning) and `inspect-cache` says in one line that the folder cannot be opened, never a
traceback, never "damaged", never an offer to --clear what may be whole."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import cmd
from test_cache_hostile_folder import cache_with_entries

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

