"""SIGTERM and SIGHUP handled as Ctrl-C (SIGINT) is: batch schedulers (Slurm, Kubernetes, CI runners, `timeout`)
stop a job with SIGTERM, and a closed terminal sends SIGHUP.

Each becomes a `Stopped` exception raised in the main thread where it is working, a KeyboardInterrupt as Ctrl-C's
is, so one path (cli/output.py `run_to_output`) keeps the finished results, says one line and exits with 128 + the
signal's number, as a shell reports a process a signal ended: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP.

A signal that is ignored when the process starts stays ignored: `nohup` ignores SIGHUP and a shell starts a
background job with SIGINT ignored, and a job run that way must keep running. Once one stop signal has arrived,
later ones are ignored, so the finished results are written whole rather than cut short by a second Ctrl-C or a
scheduler's repeated SIGTERM (SIGKILL still ends the process; --resume then recovers from the journal).

Within `deferred()` a stop signal waits until the block ends: a result's record and the count of finished results
change together, so a partial report never counts one result fewer than the records written.
"""
from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Deferral:
    """How deep the main thread is in `deferred()` blocks, and the stop signal that arrived there."""
    depth = 0
    pending: int | None = None


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_reason(exc: KeyboardInterrupt) -> Stopped:
    """The Stopped of an interrupt: Python's own KeyboardInterrupt is Ctrl-C's (SIGINT)."""
    return exc if isinstance(exc, Stopped) else Stopped(signal.SIGINT)


@contextlib.contextmanager
def stop_signals_raise():
    """Within: SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread (those not ignored at the start);
    the previous handlers come back at the end."""
    stopping = False

    def handler(signum, frame):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        if _Deferral.depth:
            _Deferral.pending = signum
            return
        raise Stopped(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        current = signal.getsignal(signum)
        if current == signal.SIG_IGN or current is None:  # None: set outside Python; leave it as it is
            continue
        try:
            previous[signum] = signal.signal(signum, handler)
        except ValueError:  # not the main thread (an embedding caller): signals stay theirs
            break
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        _Deferral.pending = None  # a stop held in a block that ended by its own exception belongs to this run


@contextlib.contextmanager
def deferred():
    """Within: a stop signal is held until the block ends, then raised (the block's own exception goes first)."""
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
    if not _Deferral.depth and _Deferral.pending is not None:
        signum, _Deferral.pending = _Deferral.pending, None
        raise Stopped(signum)
