"""`inspect-cache` in words a newcomer reads without the source: a K/V block cell says what its second number is,
counts take their singular, and a listing narrowed with --model does not present the whole cache's bytes as that
model's."""
from __future__ import annotations

import re

import pytest
from conftest import cli
from test_cache_hostile_folder import TOKENS, put

from prefixrun.engine.cache.store import CheckpointStore


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """A signing key of this test's own, outside the cache folder."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def one_entry_cache(tmp_path):
    with CheckpointStore(tmp_path / "cache" / "checkpoints") as store:
        assert put(store)  # 40 tokens in K/V blocks of 8 rows: 5 blocks, none shared
    return str(tmp_path / "cache")


def test_the_table_says_what_its_numbers_are(tmp_path):
    res = cli("inspect-cache", "--cache-dir", one_entry_cache(tmp_path), env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "5 (0 shared)" in res.output and "/0s" not in res.output
    assert "1 entry, " in res.output and "1 entries" not in res.output


def test_the_tree_and_verify_count_in_the_singular(tmp_path):
    cache = one_entry_cache(tmp_path)
    tree = cli("inspect-cache", "--cache-dir", cache, "--tree")
    assert tree.exit_code == 0 and "(1 entry, " in tree.output and "5 (0 shared)" in tree.output, tree.output
    verify = cli("inspect-cache", "--cache-dir", cache, "--verify")
    assert verify.exit_code == 0 and "verified 1 entry: 1 ok, 0 bad" in verify.output, verify.output


def test_a_listing_of_one_model_keeps_the_whole_cache_apart(tmp_path):
    res = cli("inspect-cache", "--cache-dir", one_entry_cache(tmp_path), "--model", "ff", env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "0 entries of model ff; the whole cache holds " in res.output, res.output


def _row(output: str) -> str:
    (row,) = [line for line in output.splitlines() if line.startswith("│")]
    return row


def test_a_piped_table_keeps_every_column_and_the_whole_preview(tmp_path, monkeypatch):
    """Rich lays a table out at 80 columns off a terminal: `inspect-cache > list.txt` lost the last-used time's
    minutes and the whole prefix column. Off a terminal (COLUMNS unset) the table is as wide as its cells."""
    monkeypatch.delenv("COLUMNS", raising=False)
    res = cli("inspect-cache", "--cache-dir", one_entry_cache(tmp_path))
    assert res.exit_code == 0, res.output
    assert "last used" in res.output and "prefix" in res.output, res.output
    row = _row(res.output)
    assert re.search(r"│ \d{4}-\d\d-\d\d \d\d:\d\d │", row), row
    assert " ".join(map(str, TOKENS[:12])) + " …" in row, row


def test_a_narrow_terminal_gets_long_lines_not_cut_columns(tmp_path):
    """At 80 columns the other cells need more than the terminal has: each stays whole, the prefix keeps a few
    characters, and the line is longer than the terminal instead of cut."""
    res = cli("inspect-cache", "--cache-dir", one_entry_cache(tmp_path), env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    row = _row(res.output)
    assert re.search(r"│ \d{4}-\d\d-\d\d \d\d:\d\d │ " + str(TOKENS[0]), row), row
    assert row.endswith("… │") and len(row) > 80, row
