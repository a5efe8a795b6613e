"""`prefixrun inspect-cache`: the persistent checkpoint cache as a table, a tree or JSON; prune, verify, clear."""
from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from prefixrun.cli import io
from prefixrun.cli.report import human_bytes


def _preview(entry, tokenizer) -> str:
    ids = list(entry.token_preview)
    if tokenizer is not None:
        try:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            return (text[:60] + "…") if len(text) > 60 or entry.n_tokens > len(ids) else text
        except Exception:  # an id outside this tokenizer's vocabulary: fall back to ids
            pass
    shown = " ".join(map(str, ids[:12]))
    return shown + (" …" if entry.n_tokens > 12 else "")


def _entry_json(e) -> dict:
    return {"entry_id": e.entry_id, "model_digest": e.model_digest, "layout_digest": e.layout_digest,
            "tokens": e.n_tokens, "bytes": e.nbytes, "hits": e.hits, "created": e.created,
            "last_used": e.last_used, "token_preview": list(e.token_preview), "path": str(e.path), "meta": e.meta}


def _nesting(entries) -> dict:
    """parent entry id (or None) for each entry: the longest other entry of the same model and layout whose
    token preview is a prefix of this one's (previews hold the first tokens, so deep nesting is approximate)."""
    parent = {}
    ordered = sorted(entries, key=lambda e: e.n_tokens)
    for e in ordered:
        best = None
        for c in ordered:
            if c.n_tokens >= e.n_tokens or (c.model_digest, c.layout_digest) != (e.model_digest, e.layout_digest):
                continue
            n = min(len(c.token_preview), c.n_tokens)
            if tuple(e.token_preview[:n]) == tuple(c.token_preview[:n]):
                best = c if best is None or c.n_tokens > best.n_tokens else best
        parent[e.entry_id] = best.entry_id if best else None
    return parent


def run_inspect(root: Path, *, model, as_json, tree, model_dir, prune_older_than_days, prune_to_bytes, clear,
                verify, yes, budget_bytes: int | None = None) -> int:
    from prefixrun.engine.store import CheckpointStore

    console = Console(file=sys.stderr, stderr=True, markup=False, emoji=False)  # paths and previews are user text
    ckpt_root = Path(root) / "checkpoints"
    if not ckpt_root.exists():
        if as_json:
            print(json.dumps({"cache_dir": str(ckpt_root), "entries": [], "total_bytes": 0}))
        else:
            console.print(f"no cache at {ckpt_root}")
        return io.EXIT_OK
    store = CheckpointStore(ckpt_root)
    try:
        entries = store.entries()
        if model:
            entries = [e for e in entries if e.model_digest.startswith(model)]
        model_digest = entries[0].model_digest if model and entries else None
        if clear or prune_older_than_days is not None or prune_to_bytes is not None:
            what = "remove every entry" if clear and not model else (
                f"remove entries of model {model}" if clear else "prune entries")
            if not yes:
                if not sys.stdin.isatty():
                    console.print(f"refusing to {what} without --yes (stdin is not a terminal)")
                    return io.EXIT_USAGE
                if input(f"{what} in {ckpt_root}? [y/N] ").strip().lower() not in ("y", "yes"):
                    console.print("nothing removed")
                    return io.EXIT_OK
            if clear and not model:
                n = store.clear()
            elif clear:
                n = store.prune(model_digest=model_digest) if model_digest else 0
            else:
                n = store.prune(older_than_s=prune_older_than_days * 86400 if prune_older_than_days is not None
                                else None, to_bytes=prune_to_bytes, model_digest=model_digest)
            console.print(f"removed {n} entries")
            entries = store.entries()
        if verify:
            bad = store.verify_all()
            console.print(f"verified {len(entries)} entries: {len(bad)} bad, moved aside")
            # Files a killed run left behind (temp files of dead writers, unindexed blobs) are never read, but
            # they take disk space outside the budget; nothing else removes them.
            swept = store.sweep_orphans()
            n_files = len(swept.removed_temp_files) + len(swept.removed_unindexed_files)
            if n_files or swept.dropped_rows:
                console.print(f"removed {n_files} leftover files of interrupted writes, "
                              f"{len(swept.dropped_rows)} entries whose file was gone")
            entries = store.entries()
        total = store.total_bytes()
        if as_json:
            print(json.dumps({"cache_dir": str(ckpt_root), "total_bytes": total, "budget_bytes": budget_bytes,
                              "entries": [_entry_json(e) for e in entries]}, indent=2))
            return io.EXIT_OK
        tokenizer = None
        if model_dir is not None:
            from prefixrun.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_dir(model_dir)
        out = Console(markup=False, emoji=False)  # the table is the command's output: stdout; its text is the user's
        if tree:
            parents = _nesting(entries)
            by_id = {e.entry_id: e for e in entries}
            root_tree = Tree(f"{ckpt_root} ({len(entries)} entries, {human_bytes(total)})")
            nodes = {}
            for e in sorted(entries, key=lambda e: e.n_tokens):
                label = f"{e.n_tokens} tokens · {human_bytes(e.nbytes)} · {e.hits} hits · {_preview(e, tokenizer)}"
                parent = parents[e.entry_id]
                nodes[e.entry_id] = (nodes[parent] if parent in by_id else root_tree).add(label)
            out.print(root_tree)
            return io.EXIT_OK
        table = Table(title=f"checkpoint cache {ckpt_root}")
        for col in ("model", "tokens", "bytes", "hits", "last used", "prefix"):
            table.add_column(col, justify="right" if col in ("tokens", "bytes", "hits") else "left")
        for e in sorted(entries, key=lambda e: -e.last_used):
            table.add_row(e.model_digest[:12], f"{e.n_tokens:,}", human_bytes(e.nbytes), str(e.hits),
                          datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M"), _preview(e, tokenizer))
        out.print(table)
        against = f" of a {human_bytes(budget_bytes)} budget ({total / budget_bytes:.0%})" if budget_bytes else ""
        out.print(f"{len(entries)} entries, {human_bytes(total)} in total{against}")
        return io.EXIT_OK
    finally:
        store.close()
