"""`<output>.inputs`: which input line made each result in a regular `-o` file, so that `--resume` never mixes two
batches (a result of one file's line 7 kept for another file's line 7: both get the id `line-7`, or the same
custom_ids were reused for other prompts).

One JSON line per successful result, appended (and flushed) when the result is written or journaled:
`["<custom_id>", "<digest of its input line>"]`, the digest a SHA-256 of the line's bytes without surrounding
whitespace (a UTF-8 BOM on the first line is not part of it). A fresh run (or `--overwrite`) starts the file
anew; a resumed run reads it and appends.

The rule on `--resume`: a line whose custom_id has a result must be the very line that made it, else the run
stops with exit 2 and one line naming the line. Everything else may change: lines appended or inserted, a bad
line fixed (an error record has no entry: the line runs again), lines removed. The check is made as lines are
read, so on a file or a stream it costs no extra pass; another batch is refused at its first line that has a
result, before any of its requests runs unless more than a window of new lines comes first (the results of
those are kept, as for any stopped run). An output without the file (written by stdout redirection, or by an
older prefixrun) cannot be checked: it resumes without the check.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from prefixrun.cli.appended_file import AppendedFile
from prefixrun.cli.report import shown_id

LEDGER_SUFFIX = ".inputs"


def ledger_path(output: Path) -> Path:
    return output.with_name(output.name + LEDGER_SUFFIX)


def line_digest(data: bytes) -> str:
    return hashlib.sha256(data.strip()).hexdigest()


# the options that change a run's answers: a resumed run must give them as the run that started its output did
# (not --lenient or --max-line-bytes: they decide which lines fail, and a failed line runs again on --resume)
RESULT_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "chat_template_kwargs",
                  "tool_call_parser", "reasoning_parser", "kv_cache_dtype")
_MODEL_FILES = (".json", ".jinja", ".model", ".safetensors")
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # of each weights file: 1 MiB read at most, whatever its size


def run_identity(config) -> dict:
    """What decides a run's answers: the model's content and RESULT_OPTIONS' values (config: a RunConfig whose
    model_dir is set). The model is named by its files' content, not their place, so a copy of it elsewhere (a
    job's node-local scratch) resumes: config, tokenizer and template files whole, and each weights file's size
    and 16 spread samples of 64 KiB (a checkpoint that differs from the first only between those samples, a few
    tensors, is not told apart)."""
    model = hashlib.sha256()
    folder = Path(config.model_dir)
    for path in sorted(p for p in folder.iterdir() if p.suffix in _MODEL_FILES and p.is_file()):
        model.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            model.update(str(size).encode() + b"\0")
            sampled = path.suffix == ".safetensors" and size > _SAMPLES * _SAMPLE_BYTES
            spots = [i * (size - _SAMPLE_BYTES) // (_SAMPLES - 1) for i in range(_SAMPLES)] if sampled else [0]
            for spot in spots:
                f.seek(spot)
                model.update(f.read(_SAMPLE_BYTES if len(spots) > 1 else size))
    identity = {"model": model.hexdigest()}
    identity.update({name: getattr(config, name) for name in RESULT_OPTIONS})
    return json.loads(json.dumps(identity, sort_keys=True, default=str))


def changed_settings(before: dict, now: dict) -> list[str]:
    """The settings (the model, or an option's flag) in which two run identities differ."""
    return [name if name == "model" else "--" + name.replace("_", "-")
            for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name)]


class InputMismatch(Exception):
    """--resume over an input that is not the one the output's results came from (one line for the user)."""


class InputLedger:
    """The ledger of one run into `output` (None: nothing is recorded or checked, as for stdout)."""

    def __init__(self, output: Path | None = None, *, resume: bool = False, identity: dict | None = None):
        self.output = output
        self.path = path = ledger_path(output) if output is not None else None
        self._made_by: dict[str, str] = {}  # custom_id -> digest of the line that made its result
        self._reading: dict[int, str] = {}  # output index -> digest, for lines whose results are not in yet
        self._lines = AppendedFile(path) if path is not None else None
        if path is None:
            return
        if resume:
            self._made_by = _read(path)
        else:
            path.unlink(missing_ok=True)
            if identity is not None:  # the run that starts the output: a resumed one must be the same
                self._lines.append(json.dumps({"run": identity}, sort_keys=True) + "\n")

    def check(self, custom_id: str, line_no: int, data: bytes) -> None:
        """A line whose custom_id already has a result: raise InputMismatch unless it is the line that made it."""
        made_by = self._made_by.get(custom_id)
        if made_by is not None and made_by != line_digest(data):
            raise InputMismatch(
                f"--resume: line {line_no} ({shown_id(custom_id)}) is not the line its result in {self.output} was "
                f"made from: this input is not the one that output was started from (give another -o, or "
                f"--overwrite to replace it)")

    def note(self, index: int, data: bytes) -> None:
        """A line that will run: its digest waits for its result."""
        if self.path is not None:
            self._reading[index] = line_digest(data)

    def wrote(self, index: int, custom_id: str, ok: bool) -> None:
        """The record of output `index` was written or journaled; a successful one is entered."""
        digest = self._reading.pop(index, None)
        if not ok or digest is None or self.path is None:
            return
        self._lines.append(json.dumps([custom_id, digest], ensure_ascii=True) + "\n")

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()


def _read(path: Path) -> dict[str, str]:
    """custom_id -> digest from a ledger; lines that are not entries (a write cut short by a kill) are skipped."""
    made_by: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            for data in f:
                try:
                    entry = json.loads(data)
                except (ValueError, RecursionError):
                    continue
                if isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, str) for v in entry):
                    made_by[entry[0]] = entry[1]
    except FileNotFoundError:
        pass
    return made_by


def started_by(output: Path) -> dict | None:
    """The identity of the run that started `output` (run_identity), if its ledger records one."""
    try:
        with open(ledger_path(output), "rb") as f:
            first = f.readline(1 << 20)
    except OSError:
        return None
    try:
        entry = json.loads(first)
    except (ValueError, RecursionError):
        return None
    return entry["run"] if isinstance(entry, dict) and isinstance(entry.get("run"), dict) else None
