"""engine/run/background.py: start, cancel, and errors surfaced at join."""
import sys
import threading
from pathlib import Path

import pytest

from prefixrun.engine.run.background import BackgroundTask


def test_join_returns_the_result():
    task = BackgroundTask("t", lambda stop, x: x * 2, 21)
    assert task.join(5) == 42 and task.done() and task.error is None


def test_an_error_is_raised_at_join_on_the_owners_thread():
    def fail(stop):
        raise ValueError("disk on fire")

    task = BackgroundTask("t", fail)
    with pytest.raises(ValueError, match="disk on fire"):
        task.join(5)
    assert isinstance(task.error, ValueError)


def test_cancel_stops_a_loop_that_watches_stop():
    entered = threading.Event()

    def loop(stop):
        entered.set()
        rounds = 0
        while not stop.wait(0.01):
            rounds += 1
        return "stopped"

    task = BackgroundTask("t", loop)
    assert entered.wait(5)
    task.cancel()
    assert task.join(5) == "stopped"


def test_not_started_until_asked():
    ran = []
    task = BackgroundTask("t", lambda stop: ran.append(1), start=False)
    assert not task.started and not task.done() and task.join() is None and ran == []
    task.start()
    task.join(5)
    assert ran == [1]


def test_join_with_a_timeout_leaves_a_running_task_running():
    release = threading.Event()
    task = BackgroundTask("t", lambda stop: release.wait(5))
    assert task.join(0.01) is None and not task.done()
    release.set()
    assert task.join(5) is True


def own_priority() -> int:
    import os

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_caches_threads_yield_the_cpu_to_the_engines_and_the_caller_keeps_its_priority():
    """The persistent cache's writers, hashers and readers run below the thread that feeds the device: on a host
    whose cores are all busy (a cold run's copies, writes and digests) the engine's thread runs first."""
    from prefixrun.engine.cache import blob_format
    from prefixrun.engine.cache.kv_blocks import BlockFiles
    from prefixrun.engine.run.background import BACKGROUND_NICENESS

    mine = own_priority()
    assert BackgroundTask("t", lambda stop: own_priority(), yields_cpu=True).join(5) >= BACKGROUND_NICENESS
    assert BackgroundTask("t", lambda stop: own_priority()).join(5) == mine  # plain tasks keep the caller's priority
    assert blob_format.threads().submit(own_priority).result(5) >= BACKGROUND_NICENESS

    class Files:
        def make_folders(self, name):
            pass

    blocks = BlockFiles(Path("/nonexistent"), "tag", Files())
    for reading in (True, False):
        assert blocks._pool(reading).submit(own_priority).result(5) >= BACKGROUND_NICENESS
    assert own_priority() == mine
