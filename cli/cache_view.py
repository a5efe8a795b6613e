"""`prefixrun inspect-cache`: the persistent checkpoint cache as a table, a tree or JSON; prune, verify, clear.

Stdout carries the command's output (the table, the tree, the JSON, the --verify summary); questions, progress
notes and errors go to stderr, so a redirected stdout never hides a prompt. Everything shown that comes from the
cache or the user (paths, decoded prompts) is printed literally, never as Rich markup, control characters escaped
(cli/report.py `literal`).
"""
from __future__ import annotations

import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from prefixrun.cli import io
from prefixrun.cli.report import human_bytes, literal, printable
from prefixrun.engine.counts import count

EXIT_DAMAGED = io.EXIT_FAILURE
_SHOW_BAD = 20  # bad entries listed by --verify; the rest are counted
_MIN_PREFIX = 8  # the table's prefix column where the other cells alone are wider than the terminal


class _Previews:
    """Entry prefix -> text with the tokenizer of --model-dir, token ids otherwise. Never a tokenizer from a folder
    the index names: anyone who can write the cache folder writes the index, and loading a tokenizer from a path
    they chose reads (and may run) what they put there."""

    def __init__(self, model_dir: Path | None, err: Console):
        self._fixed = self._load(model_dir, err) if model_dir is not None else None

    @staticmethod
    def _load(model_dir, err: Console):
        from prefixrun.engine.load.tokenizer import Tokenizer

        try:
            return Tokenizer.from_model_dir(Path(model_dir))
        except Exception as problem:  # a moved, deleted or damaged model folder: previews fall back to token ids
            why = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
            err.print(literal(f"warning: prefixes are shown as token ids: the tokenizer of --model-dir {model_dir} "
                              f"cannot be loaded ({why})"), soft_wrap=True)
            return None

    def __call__(self, entry) -> str:
        ids = list(entry.token_preview)
        tokenizer = self._fixed
        if tokenizer is not None:
            try:
                text = tokenizer.decode(ids, skip_special_tokens=False).replace("\n", "⏎")
                return repr(text[:60] + "…") if len(text) > 60 or entry.n_tokens > len(ids) else repr(text)
            except Exception:  # an id outside this tokenizer's vocabulary: fall back to ids
                pass
        shown = " ".join(map(str, ids[:12]))
        return shown + (" …" if entry.n_tokens > 12 else "")


def _reader_went_away():
    """Rich exits with status 1 when stdout's reader leaves (`| head`); the command answers 141, as batch does."""
    raise BrokenPipeError


def _entry_json(e) -> dict:
    return {"entry_id": e.entry_id, "model_digest": e.model_digest, "layout_digest": e.layout_digest,
            "tokens": e.n_tokens, "bytes": e.nbytes, "kv_blocks": e.blocks, "kv_block_bytes": e.block_bytes,
            "kv_blocks_shared": e.shared_blocks, "hits": e.hits, "created": _finite_or_none(e.created),
            "last_used": _finite_or_none(e.last_used), "token_preview": list(e.token_preview), "path": str(e.path),
            "meta": e.meta}


def _nesting(entries) -> dict:
    """parent entry id (or None) for each entry: the longest other entry of the same model and layout whose
    token preview is a prefix of this one's (previews hold the first tokens, so deep nesting is approximate).
    Near-linear: each entry is filed in a trie of previews at the node of its own comparable prefix, and looks for
    its parent only along its own path (at most PREVIEW_TOKENS nodes), by binary search on their lengths."""
    import bisect

    trie: dict = {}  # (model, layout, token, token, ...) prefix as nested dicts; node[None] = sorted [(n, id)]
    for c in entries:
        node = trie.setdefault((c.model_digest, c.layout_digest), {})
        for token in c.token_preview[:min(len(c.token_preview), c.n_tokens)]:
            node = node.setdefault(token, {})
        bisect.insort(node.setdefault(None, []), (c.n_tokens, c.entry_id))
    parent = {}
    for e in entries:
        best = None
        node = trie[(e.model_digest, e.layout_digest)]
        for token in (None, *e.token_preview):
            if token is not None:
                node = node.get(token)
                if node is None:
                    break
            here = node.get(None, [])
            i = bisect.bisect_left(here, (e.n_tokens, ""))  # the longest shorter than e
            if i and (best is None or here[i - 1][0] > best[0]):
                best = here[i - 1]
        parent[e.entry_id] = best[1] if best else None
    return parent


def _confirm(err: Console, question: str) -> bool | None:
    """Ask on stderr, read stdin. None when stdin is not a terminal (the caller refuses without --yes)."""
    if not sys.stdin.isatty():
        return None
    err.print(literal(f"{question} [y/N] "), end="", soft_wrap=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _refuse_or_ask(err: Console, what: str, yes: bool) -> int | None:
    """None to go ahead; otherwise the exit code to return."""
    if yes:
        return None
    answer = _confirm(err, f"{what}?")
    if answer is None:
        err.print(literal(f"error: refusing to {what} without --yes (stdin is not a terminal)"), soft_wrap=True)
        return io.EXIT_USAGE
    if not answer:
        err.print("nothing removed")
        return io.EXIT_OK
    return None


def _damaged(err: Console, ckpt_root: Path, problem: Exception, *, clear: bool, yes: bool) -> int:
    """The index cannot be opened: say so in one line; --clear removes the cache folder's contents anyway, unless
    the folder is where the problem is (read-only, unreadable, full): --clear could not help, and says so."""
    from prefixrun.engine.cache.admin import place_not_cache
    from prefixrun.engine.cache.store import CheckpointStore, StoreError, clear_folder, folder_bytes

    if place_not_cache(ckpt_root, problem):
        doing = "cleared" if clear else "opened"
        err.print(literal(f"error: the checkpoint cache at {ckpt_root} cannot be {doing} ({problem}): check the "
                          "folder's permissions and free space (the entries may well be whole)"),
                  soft_wrap=True)
        return EXIT_DAMAGED
    if not clear:
        err.print(literal(f"error: the checkpoint cache at {ckpt_root} is damaged ({problem}); it is only a cache: "
                          "`prefixrun inspect-cache --clear` removes it (`--verify` checks the entries of a readable "
                          "index)"), soft_wrap=True)
        return EXIT_DAMAGED
    refused = _refuse_or_ask(err, f"remove the damaged cache at {ckpt_root} ({human_bytes(folder_bytes(ckpt_root))})",
                             yes)
    if refused is not None:
        return refused
    removed = clear_folder(ckpt_root)
    try:  # say "removed" only if the cache works again: something clear_folder may not delete can remain
        CheckpointStore(ckpt_root).close()
    except (StoreError, OSError) as still:
        err.print(literal(f"error: removed {count(removed, 'file')}, but the checkpoint cache at {ckpt_root} is "
                          f"still damaged ({still}); remove what is left there by hand"), soft_wrap=True)
        return EXIT_DAMAGED
    err.print(literal(f"removed the damaged cache ({count(removed, 'file')})"), soft_wrap=True)
    return io.EXIT_OK


class StdoutFailed(OSError):
    """A write to standard output failed (a full disk): the listing is lost, the cache untouched."""


class StdoutWrites:
    """Standard output whose failed writes raise StdoutFailed (BrokenPipeError as it is: a reader that left), so a
    failure to show the cache is never taken for one of the cache."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self._guarded(self.stream.write, text)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    @staticmethod
    def _guarded(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutFailed(exc.errno, exc.strerror) from None

    def __getattr__(self, name):  # fileno, isatty, encoding, ... as the stream has them
        return getattr(self.stream, name)


def run_inspect(root: Path, *, model, as_json, tree, model_dir, prune_older_than_days, prune_to_bytes, clear,
                verify, yes, budget_bytes: int | None = None) -> int:
    import sqlite3

    from prefixrun.engine.cache.store import CheckpointStore, StoreError

    err = Console(file=sys.stderr, stderr=True, highlight=False, markup=False, emoji=False)  # user text: literal
    ckpt_root = Path(root) / "checkpoints"
    try:
        os.lstat(ckpt_root)  # a link or a file there is the store's to refuse (and --clear's to remove)
    except (FileNotFoundError, NotADirectoryError):
        if as_json:
            print(json.dumps({"cache_dir": str(ckpt_root), "entries": [], "total_bytes": 0}))
        else:
            err.print(literal(f"no cache at {ckpt_root}"), soft_wrap=True)
        return io.EXIT_OK
    except OSError as problem:  # a folder above it this user may not enter (another user's cache)
        return _damaged(err, ckpt_root, problem, clear=clear, yes=yes)
    try:
        store = CheckpointStore(ckpt_root)
    except (StoreError, OSError) as problem:
        return _damaged(err, ckpt_root, problem, clear=clear, yes=yes)
    try:
        return _inspect(store, err, ckpt_root, model=model, as_json=as_json, tree=tree, model_dir=model_dir,
                        prune_older_than_days=prune_older_than_days, prune_to_bytes=prune_to_bytes, clear=clear,
                        verify=verify, yes=yes, budget_bytes=budget_bytes)
    except sqlite3.DatabaseError as problem:  # opened, but damaged further in
        store.close()
        return _damaged(err, ckpt_root, problem, clear=clear, yes=yes)
    finally:
        store.close()


def _inspect(store, err: Console, ckpt_root: Path, *, model, as_json, tree, model_dir, prune_older_than_days,
             prune_to_bytes, clear, verify, yes, budget_bytes) -> int:
    entries = store.entries()
    if model:
        entries = [e for e in entries if _of_model(e, model)]
    # --model is a prefix: it may match several models, or none (then a prune must remove nothing, not lose its
    # scope and prune every model)
    model_digests = sorted({e.model_digest for e in entries}) if model else None
    if clear or prune_older_than_days is not None or prune_to_bytes is not None:
        if clear:
            scope = "every entry" if not model else f"the entries of model {model}"
            what = f"remove {scope} in {ckpt_root}: {_count(len(entries))}, " \
                   f"{human_bytes(sum(e.nbytes for e in entries))}"
        else:
            doomed, removes = _prune_preview(store, entries, prune_older_than_days, prune_to_bytes)
            what = f"prune the cache at {ckpt_root}: {removes}"
        # a prune that removes nothing has nothing to confirm (a script's --prune-to would fail without --yes)
        refused = _refuse_or_ask(err, what, yes or not (clear or doomed))
        if refused is not None:
            return refused
        older_than_s = prune_older_than_days * 86400 if prune_older_than_days is not None else None
        if clear and not model:
            n = store.clear()
        elif clear:
            n = store.prune(model_digest=model_digests)
        elif not doomed:
            n = 0
        else:
            n = store.prune(older_than_s=older_than_s, to_bytes=prune_to_bytes, model_digest=model_digests)
        err.print(f"removed {_count(n)}", soft_wrap=True)
        if not (as_json or tree or verify):
            return io.EXIT_OK  # the change is the answer; the table is one `inspect-cache` away
        entries = store.entries()
    if verify:
        from prefixrun.engine.cache import auth

        if auth.key_of_this_process_only():  # every entry would fail as unsigned and be moved aside
            err.print(literal(f"error: cannot verify the cache at {ckpt_root} without the signing key "
                              f"{auth.key_name() or '(no home folder to keep it in: set XDG_CONFIG_HOME)'}; "
                              "nothing was changed"), soft_wrap=True)
            return EXIT_DAMAGED
        return _verify(store, ckpt_root, as_json)
    malformed = store.count_malformed_rows()
    if malformed:
        err.print(literal(f"warning: {count(malformed, 'malformed index row')} are not shown; "
                          "`prefixrun inspect-cache --verify` drops them"), soft_wrap=True)
    total = store.total_bytes()
    if as_json:
        print(json.dumps({"cache_dir": str(ckpt_root), "total_bytes": total, "budget_bytes": budget_bytes,
                          "kv_blocks": store.block_summary(), "entries": [_entry_json(e) for e in entries]}, indent=2))
        return io.EXIT_OK
    preview = _Previews(model_dir, err)
    out = Console(highlight=False, markup=False, emoji=False)  # the command's output: stdout
    out.on_broken_pipe = _reader_went_away
    if tree:
        out.print(_tree(entries, ckpt_root, total, preview))
        return io.EXIT_OK
    # a pipe or a file gets whole previews, not a terminal's 80 columns (COLUMNS, where set, still decides)
    fits = out.width if out.is_terminal or "COLUMNS" in os.environ else None
    table, width = _table(entries, ckpt_root, preview, fits)
    out.width = max(out.width, width)  # print(width=) could only narrow it
    out.print(table, crop=False)
    against = f" of a {human_bytes(budget_bytes)} budget ({total / budget_bytes:.0%})" if budget_bytes else ""
    if model:  # the bytes and blocks below are the whole cache's: an entry's blocks may be shared with others
        out.print(literal(f"{_count(len(entries))} of model {model}; "
                          f"the whole cache holds {human_bytes(total)}{against}"))
    else:
        out.print(literal(f"{_count(len(entries))}, {human_bytes(total)} in total{against}"))
    out.print(literal(_blocks_line(store.block_summary(), total)))
    return io.EXIT_OK


def _tree(entries, ckpt_root: Path, total: int, preview) -> Tree:
    """--tree: each entry under the longest stored prefix of it, shortest first."""
    parents = _nesting(entries)
    by_id = {e.entry_id: e for e in entries}
    root_tree = Tree(literal(f"{ckpt_root} ({_count(len(entries))}, {human_bytes(total)})"))
    nodes = {}
    for e in sorted(entries, key=lambda e: e.n_tokens):
        label = (f"{count(e.n_tokens, 'token')} · {human_bytes(e.nbytes)} + {_blocks_cell(e)} · "
                 f"{count(e.hits, 'hit')} · {preview(e)}")
        parent = parents[e.entry_id]
        nodes[e.entry_id] = (nodes[parent] if parent in by_id else root_tree).add(literal(label))
    return root_tree


def _table(entries, ckpt_root: Path, preview, width: int | None) -> tuple[Table, int]:
    """(the table, the width it needs): one line per entry, every cell whole but the prefix, which gets what is left
    of `width` (None: no limit) and is cut with an ellipsis (the whole of it is in --json). A terminal narrower than
    the other cells gets lines longer than itself, with _MIN_PREFIX characters of prefix, rather than cut columns."""
    heads = ("model", "tokens", "bytes", "K/V blocks", "hits", "last used")
    ordered = sorted(entries, key=lambda e: -e.last_used)
    rows = [(e.model_digest[:8], f"{e.n_tokens:,}", human_bytes(e.nbytes), _blocks_cell(e), str(e.hits),
             _when(e.last_used)) for e in ordered]
    texts = [preview(e) for e in ordered]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(heads)]
    cells = sum(widths) + 3 * (len(heads) + 1) + 1  # each column: its cell, two spaces, a rule; the prefix's rules
    longest = max([len("prefix")] + [len(t) for t in texts])
    left = longest if width is None else width - cells
    room = min(longest, left) if left >= 2 else _MIN_PREFIX  # 2: a character and the ellipsis
    table = Table(title=literal(f"checkpoint cache {ckpt_root}"), title_justify="left")
    for head, w in zip(heads, widths):
        table.add_column(head, justify="left" if head in ("model", "last used") else "right", no_wrap=True,
                         min_width=w)
    table.add_column("prefix", no_wrap=True, overflow="ellipsis", max_width=room)
    for text, row in zip(texts, rows):
        table.add_row(*row, literal(text if len(text) <= room else text[:room - 1] + "…"))
    return table, cells + room


def _finite_or_none(value: float) -> float | None:
    """JSON has no inf / nan (a damaged index can hold them): null instead, so the output stays parseable."""
    return value if math.isfinite(value) else None


def _when(timestamp: float) -> str:
    """A last-used time as a date; "?" for one no calendar holds (a hand-edited or damaged index: 1e300, inf)."""
    try:
        return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, ValueError, OSError):
        return "?"


def _blocks_cell(e) -> str:
    """An entry's K/V block references: how many, how many of them other entries share, and their bytes."""
    if not e.blocks:
        return "-"
    return f"{e.blocks} ({e.shared_blocks} shared) {human_bytes(e.block_bytes)}"


def _count(n: int) -> str:
    return count(n, "entry", "entries")


def _of_model(entry, model: str) -> bool:
    """--model: a model digest (or its first characters), or the model's folder as the entries recorded it."""
    if entry.model_digest.startswith(model):
        return True
    where = entry.meta.get("model_dir")
    try:
        return isinstance(where, str) and Path(model).expanduser().is_dir() \
            and Path(where) == Path(model).expanduser().resolve()
    except OSError:
        return False


def _prune_preview(store, entries, older_than_days, to_bytes) -> tuple[int, str]:
    """What a prune is about to remove: how many entries, and that in entries and bytes (K/V blocks counted with
    the entries that use them; --prune-to evicts least recently used first, as the store does)."""
    import time

    doomed = {e.entry_id for e in entries
              if older_than_days is not None and e.last_used < time.time() - older_than_days * 86400}
    if to_bytes is not None:
        left = store.total_bytes() - sum(e.nbytes + e.block_bytes for e in entries if e.entry_id in doomed)
        for e in sorted(entries, key=lambda e: e.last_used):
            if left <= to_bytes:
                break
            if e.entry_id not in doomed:
                doomed.add(e.entry_id)
                left -= e.nbytes + e.block_bytes
    nbytes = sum(e.nbytes + e.block_bytes for e in entries if e.entry_id in doomed)
    return len(doomed), f"about {len(doomed)} of {_count(len(entries))}, {human_bytes(nbytes)}"


def _blocks_line(summary: dict, total: int) -> str:
    return (f"of which state blobs {human_bytes(total - summary['block_bytes'])}, K/V blocks "
            f"{human_bytes(summary['block_bytes'])} ({count(summary['blocks'], 'block')}, each stored once; "
            f"{summary['shared_blocks']:,} shared by several entries, saving "
            f"{human_bytes(summary['bytes_saved_by_sharing'])})")


def _verify(store, ckpt_root: Path, as_json: bool) -> int:
    """Check every entry, sweep what killed writers left; print a summary (not the table) on stdout, or with
    --json the summary and the remaining entries."""
    bad = store.verify_all()
    unreadable = store.unreadable_folders()
    # Files a killed run left behind (temp files of dead writers, unindexed blobs) are never read, but they take
    # disk space; batch runs sweep them too, in bounded steps.
    swept = store.sweep_orphans()
    n_files = len(swept.removed_temp_files) + len(swept.removed_unindexed_files)
    entries = store.entries()
    ok = len(entries)
    if as_json:
        print(json.dumps({"cache_dir": str(ckpt_root), "verified": ok + len(bad), "ok": ok,
                          "bad": [{"entry_id": b.entry_id, "reason": b.reason} for b in bad],
                          "unreadable_folders": [str(p) for p in unreadable],
                          "removed_leftover_files": n_files, "total_bytes": store.total_bytes(),
                          "entries": [_entry_json(e) for e in entries]}, indent=2))
        return EXIT_DAMAGED if bad or unreadable else io.EXIT_OK
    lines = [f"verified {_count(ok + len(bad))}: {ok} ok, {len(bad)} bad (moved to quarantine/ or dropped)"]
    lines += [f"  bad {printable(b.entry_id[:16])}: {printable(b.reason)}" for b in bad[:_SHOW_BAD]]
    if len(bad) > _SHOW_BAD:
        lines.append(f"  … and {len(bad) - _SHOW_BAD} more")
    if n_files or swept.dropped_rows:
        lines.append(f"removed {count(n_files, 'leftover file')} of interrupted writes, "
                     f"{_count(len(swept.dropped_rows))} whose file was gone")
    total = store.total_bytes()
    lines += [f"  cannot read {printable(str(p))} (permissions): its entries were not checked" for p in unreadable]
    lines.append(f"{_count(len(entries))}, {human_bytes(total)} in total")
    lines.append(_blocks_line(store.block_summary(), total))
    print("\n".join(lines))
    return EXIT_DAMAGED if bad or unreadable else io.EXIT_OK
