"""``app/resource_wait.py`` without Ray: where a Ray address connects, an address nothing answers at,
and the resources a run asks for (oracle: RLlib's own ``PPO.default_resource_request``).
Through the CLI against a real Ray: ``tests/e2e/test_up_front_checks_e2e.py``."""

from __future__ import annotations

import time

import pytest

from tests.app.ray_address_stubs import answering, grpc_like, web_server
from tests.e2e.processes import free_port


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("127.0.0.1:6380", ("127.0.0.1", 6380)),
        ("head", ("head", 6379)),  # ray start --head's default GCS port
        ("ray://head", ("head", 10001)),  # the Ray Client server's default port
        ("ray://head:10002", ("head", 10002)),
        ("[::1]:6379", ("::1", 6379)),
        ("auto", None),  # Ray resolves these itself
        ("local", None),
    ],
)
def test_where_a_ray_address_connects(address, target):
    from gradmon_ray.app.resource_wait import _host_port

    assert _host_port(address) == target


def test_a_ray_address_nothing_answers_at_is_refused_at_once(monkeypatch):
    import socket
    import time

    from gradmon_ray.app.resource_wait import ray_address_problem

    port = free_port()
    attempts, sleeps = [], []
    connect, sleep = socket.create_connection, time.sleep
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: attempts.append(a[0]) or connect(*a, **k))
    monkeypatch.setattr(time, "sleep", lambda s: sleeps.append(s) or sleep(s))
    assert ray_address_problem(f"127.0.0.1:{port}") == (
        f"cannot reach Ray at 127.0.0.1:{port}: nothing listens on 127.0.0.1:{port}; start the cluster or fix "
        "the address (unset: a local Ray)"
    )
    assert attempts == [("127.0.0.1", port)] and sleeps == []  # a refusal is final: one try, no wait (no clock)
    monkeypatch.undo()
    assert "unknown host 'no-such-host.invalid'" in ray_address_problem("no-such-host.invalid:6379")
    with grpc_like() as address:  # a gRPC server's handshake (Ray's GCS: the e2e) passes
        assert ray_address_problem(address) is None
    assert ray_address_problem(None) is None and ray_address_problem("auto") is None


def test_a_ray_address_where_something_else_answers_is_refused_at_once():
    """A web server (a dashboard port given for the GCS one, say): ``ray.init`` would retry for minutes."""
    from gradmon_ray.app.resource_wait import ray_address_problem

    with web_server() as address:
        started = time.monotonic()
        problem = ray_address_problem(address)
        assert time.monotonic() - started < 2.0  # final at once, not after the 15 s of silence
    host, port = address.split(":")
    assert problem == (
        f"cannot reach Ray at {address}: {host}:{port} answers, but not as a Ray cluster does (no gRPC); give the "
        "head's GCS address (host:6379 by default) or ray://host:10001; start the cluster or fix the address "
        "(unset: a local Ray)"
    )


def test_a_silent_listener_is_refused_after_the_timeout_in_seconds():
    """Accepts, never answers: retried until ``timeout_s`` (seconds: a ms/s mix-up is 1000x off)."""
    from gradmon_ray.app.resource_wait import ray_address_problem

    with answering(None) as address:
        started = time.monotonic()
        problem = ray_address_problem(address, timeout_s=1.5)
        elapsed = time.monotonic() - started
    assert 1.4 <= elapsed <= 4.0, elapsed
    assert problem is not None and f"no answer from {address} within 1.5 s" in problem


def test_a_request_over_the_total_and_one_that_fits():
    from gradmon_ray.app.resource_wait import over_total_problem, requested_resources
    from gradmon_ray.config import config_from_dict

    eight = requested_resources(config_from_dict({"resources": {"num_env_runners": 8}}))
    assert eight == {"CPU": 8.0}
    problem = over_total_problem(eight, {"CPU": 2.0, "memory": 1e9})
    assert problem is not None and problem.startswith("this run asks for CPU 8 but this Ray has CPU 2 in total")
    assert "resources.num_cpus" in problem
    assert over_total_problem(eight, {"CPU": 8.0}) is None  # fits the total (free or not: that is the wait)
    gpu = requested_resources(config_from_dict({"resources": {"num_learners": 2, "num_gpus_per_learner": 1}}))
    assert gpu == {"CPU": 1.0, "GPU": 2.0}  # RLlib gives a GPU learner no CPU ("auto"); one EnvRunner
    assert "GPU 2" in over_total_problem(gpu, {"CPU": 16.0, "GPU": 1.0}) and "resources.num_cpus" not in (
        over_total_problem(gpu, {"CPU": 16.0, "GPU": 1.0}) or ""
    )
    custom = requested_resources(
        config_from_dict({"resources": {"num_env_runners": 2, "custom_resources_per_env_runner": {"runner": 1}}})
    )
    assert "runner 2" in over_total_problem(custom, {"CPU": 4.0})


@pytest.mark.parametrize(
    "resources",
    [
        {"num_env_runners": 8},
        {"num_env_runners": 0},
        {"num_learners": 2},
        {"num_learners": 2, "num_gpus_per_learner": 1},
        {"num_learners": 1, "num_gpus_per_learner": 0.5, "num_env_runners": 3},
        {"num_env_runners": 2, "custom_resources_per_env_runner": {"runner": 1}},
    ],
)
def test_the_request_is_rllibs_own_without_the_drivers_bundle(resources):
    """Oracle: RLlib's ``PPO.default_resource_request`` for the same config; its first bundle is the
    driver's process, which ``gradmon-ray train`` is (it places no actor there)."""
    from ray.rllib.algorithms.ppo import PPO

    from gradmon_ray.app.resource_wait import requested_resources
    from gradmon_ray.config import config_from_dict
    from gradmon_ray.rllib.config import build_ppo_config

    cfg = config_from_dict({"resources": resources})
    bundles = PPO.default_resource_request(build_ppo_config(cfg)).bundles
    rllib: dict[str, float] = {}
    for bundle in bundles[1:]:
        for key, amount in bundle.items():
            rllib[key] = rllib.get(key, 0.0) + amount
    ours = {k: v for k, v in requested_resources(cfg).items() if v}
    assert ours == {k: v for k, v in rllib.items() if v}


@pytest.mark.parametrize(
    ("request_", "at_start", "now", "short"),
    [
        # The newcomer's false alarm (2 CPUs, one EnvRunner): its CPU is taken, the build is only slow.
        ({"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 1.0}, {}),
        ({"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}, {}),  # not placed yet, but there is room: Ray is starting it
        ({"CPU": 2.0}, {"CPU": 2.0}, {}, {}),  # all placed; Ray leaves out a resource with nothing free
        ({"CPU": 1.0}, {}, {}, {"CPU": 1.0}),  # another job holds every CPU: really waiting
        ({"CPU": 3.0}, {"CPU": 2.0}, {}, {"CPU": 1.0}),  # two placed, the third has no room
        ({"CPU": 1.0, "GPU": 1.0}, {"CPU": 4.0}, {"CPU": 3.0}, {"GPU": 1.0}),  # the CPU placed; the GPU is taken
    ],
)
def test_what_of_a_request_ray_cannot_place_now(request_, at_start, now, short):
    from gradmon_ray.app.resource_wait import unplaced

    assert unplaced(request_, at_start, now) == short


def _watched(free: list[dict[str, float]], build_s: float, caplog: pytest.LogCaptureFixture, wait_s: float = 30.0):
    """A ``ResourceWait`` over a fake cluster of 2 CPUs whose free CPUs go through ``free`` (the first
    is read at the start), around a 'build' of ``build_s`` seconds; reports after 0.2 s short."""
    import logging
    import time

    from gradmon_ray.app.resource_wait import ResourceWait
    from gradmon_ray.config import config_from_dict

    cfg = config_from_dict({"resources": {"num_env_runners": 1, "wait_for_resources_s": wait_s}})
    reads = iter(free)
    last = free[-1]

    def read() -> dict[str, float]:
        return next(reads, last)

    wait = ResourceWait(cfg, report_after_s=0.2, poll_s=0.02, free=read, total=lambda: {"CPU": 2.0})
    with caplog.at_level(logging.WARNING, logger="gradmon_ray.app.resource_wait"), wait:
        deadline = time.monotonic() + build_s
        while time.monotonic() < deadline:  # the build: short sleeps, so an interrupt lands at once
            time.sleep(0.01)
    return wait


def test_a_slow_build_whose_actor_is_placed_is_not_reported(caplog):
    """The finding: 'still waiting ... this run asks for CPU 1; the cluster has CPU 2 in total, CPU 1
    free' after 30 s of a slow build on a loaded 2-core box, whose EnvRunner had its CPU all along."""
    wait = _watched([{"CPU": 2.0}, {"CPU": 1.0}], build_s=1.0, caplog=caplog, wait_s=0.5)
    assert not wait.reported and not wait.gave_up  # past both the report and the give-up time
    # its own logger's records only: an earlier test's thread (urllib3 retrying a dead MLflow) may log here
    assert [r.getMessage() for r in caplog.records if r.name == type(wait).__module__] == []


@pytest.mark.parametrize("sigint", ["ignored", "graceful"])
def test_a_request_with_no_room_is_reported_then_given_up_on(caplog, sigint):
    """Given up on through the main thread's SIGINT handler, whatever it was before: SIGINT ignored
    (a backgrounded process, an xdist worker: interrupt_main then does nothing), or run_training's own
    handler, which only asks to stop after the iteration; both once left the build waiting forever.
    The handler is put back afterwards."""
    import signal
    from contextlib import ExitStack

    from gradmon_ray.app.resource_wait import ResourceWaitTimeout
    from gradmon_ray.app.train.interrupts import GracefulInterrupt

    with ExitStack() as stack:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.callback(signal.signal, signal.SIGINT, previous)
        if sigint == "graceful":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            stack.enter_context(GracefulInterrupt())
        before = signal.getsignal(signal.SIGINT)
        with pytest.raises(ResourceWaitTimeout) as info:
            _watched([{}], build_s=60.0, caplog=caplog, wait_s=0.6)  # ended by the give-up at 0.6 s
        assert signal.getsignal(signal.SIGINT) == before
    status = "this run asks for CPU 1, of which CPU 1 is not placed yet; the cluster has CPU 2 in total, CPU 0 free"
    assert str(info.value) == (
        f"gave up after 0.6 s waiting for Ray to place the run's actors (resources.wait_for_resources_s): {status}"
    )
    [record] = caplog.records
    assert record.getMessage().startswith("still waiting for Ray to place the learners and EnvRunners after 0 s: ")
    assert record.getMessage().endswith(f": {status}")
