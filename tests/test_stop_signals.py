"""cli/stop_signals.py in the test's own process: a stop signal raises Stopped at once, except inside `deferred()`,
where it waits for the block's end (a record written and counted together), and a block's own error goes first."""
import os
import signal

import pytest

from prefixrun.cli.stop_signals import Stopped, deferred, stop_signals_raise


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # Python runs the handler between bytecodes of the main thread
        pass


def test_a_stop_signal_raises_where_the_run_is():
    reached = []
    with stop_signals_raise(), pytest.raises(Stopped) as caught:
        _signal_self(signal.SIGTERM)
        reached.append(True)
    assert not reached and caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143


def test_a_stop_signal_inside_deferred_waits_for_the_block_to_end():
    steps = []
    with stop_signals_raise(), pytest.raises(Stopped) as caught:
        with deferred():
            _signal_self(signal.SIGTERM)
            steps.append("record written")
            with deferred():  # nested: held until the outermost block ends
                steps.append("inner")
            steps.append("counted")
        steps.append("after the block")
    assert steps == ["record written", "inner", "counted"] and caught.value.name == "SIGTERM"


def test_a_blocks_own_error_goes_first_and_the_held_stop_does_not_outlive_the_run():
    with stop_signals_raise(), pytest.raises(OSError):
        with deferred():
            _signal_self(signal.SIGTERM)
            raise OSError("disk full")
    with stop_signals_raise():
        with deferred():
            pass  # nothing held from the run before
