"""Ctrl-C or SIGTERM while a run with checkpoints trains: the first signal (a real one, sent to this
process) only asks to stop, the second stops at once; without checkpoints SIGTERM stops at once, as
Ctrl-C does; the handlers are the interpreter's own again afterwards."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from gradmon_ray.app.train.interrupts import GracefulInterrupt, TrainingInterrupted


@pytest.fixture(autouse=True)
def _interpreters_own_handler():
    """The premise of every test here: Python's own SIGINT handler, as in a program started from a
    terminal (an xdist worker process starts with SIGINT ignored, so that Ctrl-C reaches pytest's
    controller only); the worker's own disposition is put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, previous)
    signal.signal(signal.SIGTERM, previous_term)


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    signal.getsignal(signal.SIGINT)  # a bytecode boundary: Python runs the handler by now


def test_the_first_ctrl_c_asks_the_second_stops(capfd):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the premise
    with pytest.raises(KeyboardInterrupt), GracefulInterrupt() as interrupt:
        assert not interrupt.requested
        _sigint()
        assert interrupt.requested  # no exception: the iteration goes on
        notice = "gradmon-ray: Ctrl-C: stopping after this iteration, once it is checkpointed (Ctrl-C again to stop"
        assert notice in capfd.readouterr().err
        _sigint()
        pytest.fail("the second Ctrl-C must raise")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _sigterm(interrupt: GracefulInterrupt) -> None:
    # Only ever sent while our handler is installed: SIGTERM's default would end the test process.
    assert signal.getsignal(signal.SIGTERM) == interrupt._handle
    os.kill(os.getpid(), signal.SIGTERM)
    signal.getsignal(signal.SIGTERM)


def test_the_first_sigterm_asks_the_second_stops(capfd):
    with pytest.raises(KeyboardInterrupt), GracefulInterrupt() as interrupt:
        _sigterm(interrupt)
        assert interrupt.requested
        err = capfd.readouterr().err
        assert "gradmon-ray: SIGTERM: stopping after this iteration, once it is checkpointed" in err
        assert "(send SIGTERM again to stop now)" in err
        _sigterm(interrupt)
        pytest.fail("the second SIGTERM must raise")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_without_checkpoints_sigterm_stops_at_once_and_ctrl_c_keeps_its_own_handler():
    with GracefulInterrupt(graceful=False) as interrupt:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # it raises at once already
        with pytest.raises(KeyboardInterrupt):
            _sigterm(interrupt)
        assert not interrupt.requested
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_sigterm_handler_ray_init_installs_is_taken_over_but_not_for_sigint():
    """``ray.init`` makes a driver's SIGTERM ``sys.exit(15)`` (the run would end FAILED): a handler
    with its module and name is taken over like the default; the same function on SIGINT is someone
    else's handler and stays."""

    def sigterm_handler(signum, frame):  # Ray's, as ray._private.worker defines it in init()
        raise SystemExit(signum)

    sigterm_handler.__module__ = "ray._private.worker"
    signal.signal(signal.SIGTERM, sigterm_handler)
    with GracefulInterrupt() as interrupt:
        assert signal.getsignal(signal.SIGTERM) == interrupt._handle
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler
    signal.signal(signal.SIGINT, sigterm_handler)
    with GracefulInterrupt():
        assert signal.getsignal(signal.SIGINT) is sigterm_handler


def test_without_ctrl_c_nothing_is_requested_and_the_handler_is_restored():
    with GracefulInterrupt() as interrupt:
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert not interrupt.requested
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        _sigint()  # the interpreter's own behaviour is back


def test_someone_elses_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with GracefulInterrupt() as interrupt:
            _sigint()
        assert seen == [signal.SIGINT] and not interrupt.requested
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_it_does_nothing():
    states = []

    def body() -> None:
        with GracefulInterrupt() as interrupt:
            states.append(interrupt.requested)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert states == [False]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_training_interrupted_is_a_keyboard_interrupt_carrying_the_outcome():
    outcome = object()
    with pytest.raises(KeyboardInterrupt) as caught:
        raise TrainingInterrupted(outcome)
    assert caught.value.outcome is outcome
