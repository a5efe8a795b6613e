"""multiprocessing's resource tracker, made quiet about its own death.

The worker pool's queues hold named semaphores, which multiprocessing registers with its resource tracker (a helper
process). When that process is killed from outside (an OOM killer, a `pkill`), the next call relaunches an empty
one, and asking it to forget a semaphore the dead one knew made it print a KeyError traceback per name on the run's
stderr. Here a name registered with a tracker that is gone is simply not sent to its successor: there is nothing
for it to forget.
"""
from __future__ import annotations

import threading
from multiprocessing import resource_tracker

_lock = threading.Lock()
_known_by: dict[tuple[str, str], int | None] = {}  # (name, kind) -> pid of the tracker it was registered with
_installed = False


def _tracker_gone(pid: int | None) -> bool:
    """Whether the tracker process `pid` has exited (a zombie until multiprocessing reaps it: not signal 0, which
    a zombie still answers, but its state)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def quiet_resource_tracker() -> None:
    """Install once, before the pool creates its queues."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    tracker = resource_tracker._resource_tracker
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def registering(name, rtype):
        register(name, rtype)
        with _lock:
            _known_by[(name, rtype)] = tracker._pid

    def unregistering(name, rtype):
        with _lock:
            pid = _known_by.pop((name, rtype), tracker._pid)
        if pid != tracker._pid or _tracker_gone(pid):
            return  # the tracker that knew the name is gone: its successor never heard of it
        unregister(name, rtype)

    resource_tracker.register, resource_tracker.unregister = registering, unregistering
