"""Ctrl-C or SIGTERM while a run with checkpoints trains: the first signal (a real one, sent to this
process) only asks to stop, the second stops at once; without checkpoints SIGTERM stops at once, as
Ctrl-C does; the handlers are the interpreter's own again afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gradmon_ray.app.train.interrupts import EndingGuard, GracefulInterrupt, TrainingInterrupted


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


# --- a signal while the run ends (issue #46 item 7) -----------------------------------------------


def _ray_driver_sigterm_handler():
    """The SIGTERM handler ``ray.init`` installs in a driver (``sys.exit(15)``), as
    ``ray._private.worker`` defines it: what a real run's driver has while it ends."""

    def sigterm_handler(signum, frame):
        raise SystemExit(signum)

    sigterm_handler.__module__ = "ray._private.worker"
    return sigterm_handler


def test_a_signal_while_ending_cuts_the_step_short_skips_the_rest_and_never_raises_outside():
    ray_handler = _ray_driver_sigterm_handler()
    signal.signal(signal.SIGTERM, ray_handler)
    with EndingGuard() as ending:

        def slow_stop() -> str:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler's KeyboardInterrupt ends the sleep
            return "stopped"

        start = time.monotonic()
        assert ending.cut_short(slow_stop, "cut") == "cut" and time.monotonic() - start < 10
        assert ending.signalled == signal.SIGTERM
        assert ending.cut_short(lambda: "ran", "skipped") == "skipped"  # the rest up to the close
        _sigint()  # outside a step (the sink's close): recorded, nothing raised
        assert ending.signalled == signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) is ray_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with EndingGuard() as ending, pytest.raises(KeyboardInterrupt):  # a step's own KeyboardInterrupt is not ours
        ending.cut_short(_raise_keyboard_interrupt, None)


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


class _StoppingAlgo:
    """Stands in for the RLlib algorithm at the run's end: its ``stop`` is where the signal lands (a
    slow ``algo.stop()`` waiting on its actors), or ``train`` fails first."""

    def __init__(self, signum: int | None, fail: bool) -> None:
        self.signum, self.fail, self.stopped, self.logdir = signum, fail, False, None

    def stop(self) -> None:
        if self.signum is not None:
            os.kill(os.getpid(), self.signum)
            time.sleep(30)
        self.stopped = True


@pytest.fixture
def ended_run(tmp_path, monkeypatch):
    """``run_training`` with a real sqlite sink; only Ray's parts are stand-ins (no Ray starts: the
    algorithm is ``_StoppingAlgo``, its iterations one logged value each); returns
    ``(run it, the store, the algorithm)``.  The driver's SIGTERM handler is Ray's."""
    import gradmon_ray.app.train.run as run_module
    from gradmon_ray.config import config_from_dict

    signal.signal(signal.SIGTERM, _ray_driver_sigterm_handler())
    store = f"sqlite:///{tmp_path / 'm.db'}"
    cfg = config_from_dict({"iterations": 2, "mlflow": {"tracking_uri": store, "experiment": "end", "plots_every": 0}})
    algo: list[_StoppingAlgo] = []

    def build(self) -> None:
        self.algo = algo[0]

    def iterate(self) -> None:
        if algo[0].fail:
            raise RuntimeError("a learner died")
        for iteration in (1, 2):
            self.sink.log_iteration(iteration, {"loss": iteration / 4})
            self.outcome.iterations_done = iteration

    monkeypatch.setattr(run_module, "start_ray", lambda cfg, request: False)
    monkeypatch.setattr(run_module._TrainingRun, "build", build)
    monkeypatch.setattr(run_module._TrainingRun, "iterate", iterate)

    def run(signum: int | None, fail: bool = False):
        algo[:] = [_StoppingAlgo(signum, fail)]
        try:
            return run_module.run_training(cfg, progress=None, checked=True)
        except TrainingInterrupted:
            raise
        except (SystemExit, KeyboardInterrupt) as exc:  # a failure of this test, not the end of pytest
            pytest.fail(f"the signal escaped the run's end: {exc!r}")

    return run, store, algo


def _only_run(store: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("end").experiment_id])
    return run, client


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_while_the_run_ends_ends_it_killed_with_every_iteration(ended_run, signum):
    """Both iterations trained, the signal lands in the algorithm's stop: the stop is cut short, the
    sink still closes, and MLflow has the run KILLED (not RUNNING, its status lost), with its
    "killed" tag and both iterations; ``run_training`` raises ``TrainingInterrupted`` (the CLI's 130)."""
    run, store, algo = ended_run
    with pytest.raises(TrainingInterrupted) as stopped:
        run(signum)
    assert not algo[0].stopped  # cut short
    mlflow_run, client = _only_run(store)
    assert (mlflow_run.info.status, mlflow_run.data.tags["gradmon.status"]) == ("KILLED", "killed")
    assert sorted((p.step, p.value) for p in client.get_metric_history(mlflow_run.info.run_id, "loss")) == [
        (1, 0.25),
        (2, 0.5),
    ]
    assert stopped.value.outcome.mlflow_complete and stopped.value.outcome.run_id == mlflow_run.info.run_id
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the ending's handlers are gone


def test_a_failed_run_signalled_while_it_ends_stays_failed(ended_run):
    """The failure is what ended it: FAILED, and its error reaches the caller, not the signal."""
    run, store, algo = ended_run
    with pytest.raises(RuntimeError, match="a learner died"):
        run(signal.SIGTERM, fail=True)
    assert not algo[0].stopped and _only_run(store)[0].info.status == "FAILED"


def test_a_run_ending_without_a_signal_finishes(ended_run):
    run, store, algo = ended_run
    outcome = run(None)
    assert algo[0].stopped and outcome.mlflow_complete and _only_run(store)[0].info.status == "FINISHED"
