"""The command line's background threads run as engine/run/background.py BackgroundTasks: cancelled and waited
for by their owner, and an error stays with its task instead of reaching the terminal raw."""
import threading
import time

from prefixrun.cli.report import RunReporter


def test_a_failing_progress_poller_never_breaks_the_run(capsys):
    # a progress line that cannot be made (here: stats without counters) ends the poller; stop() still returns
    # at once and raises nothing, and no traceback is printed by the thread
    reporter = RunReporter(progress_interval=0.01)
    reporter.watch(object())
    deadline = time.monotonic() + 5
    while not reporter._poller.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(reporter._poller.error, AttributeError)
    reporter.stop()
    assert "Traceback" not in capsys.readouterr().err
    assert not any(t.name == "prefixrun-progress" for t in threading.enumerate())


def test_stop_cancels_a_waiting_poller_without_waiting_out_its_interval():
    reporter = RunReporter(progress_interval=3600)
    reporter.watch(None)
    t0 = time.monotonic()
    reporter.stop()
    assert time.monotonic() - t0 < 2
    reporter.watch(None)  # a stopped reporter starts no poller again
    assert reporter._poller is None
