"""engine/run/background.py: start, cancel, and errors surfaced at join."""
import threading

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
