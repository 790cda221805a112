"""Issue 27 item 7, the checks that need Ray: an address nothing answers at, a request no local
Ray can ever place, and the wait that remains for a request that fits but is not free.

The CLI cases run the CLI's ``main`` in this process from an empty directory, with the session's
shared Ray shut down for the module (each case is about the Ray a command starts, or fails to
reach): exit 2, one line on stderr naming the problem, no traceback, and no ``mlflow.db`` or
``mlruns`` (the checks come before the store is opened; before, the over-request left a FAILED
run behind).  A sweep's over-request is the same refusal of a request that ``start_ray`` is handed:
which request ``tune`` hands it (each trial's whole placement group) is checked without Ray, by the
last test (a local Ray of its own costs about 5 CPU-s).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.app.ray_address_stubs import web_server
from tests.e2e.in_process import run_cli
from tests.e2e.processes import free_port

TINY = ["--iterations", "1", "--set", "ppo.train_batch_size=128", "--set", "ppo.minibatch_size=64"]


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    """A local Ray unless a test names an address (a developer's RAY_ADDRESS must not leak in)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _sweep_file(directory: Path, **base: object) -> str:
    path = directory / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": {"iterations": 1, **base}, "search_space": {"ppo.lr": 0.001}}))
    return str(path)


def _refused(argv: list[str], cwd: Path) -> str:
    import ray

    proc = run_cli(argv, cwd)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("gradmon-ray: config error: "), err
    assert "Traceback" not in err
    assert not (cwd / "mlflow.db").exists() and not (cwd / "mlruns").exists()
    assert not ray.is_initialized()  # a Ray the command started is shut down again
    return err


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_ray_address_nothing_answers_at(command, without_shared_ray, tmp_path):
    port = free_port()
    target = [] if command == "train" else [_sweep_file(tmp_path)]
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    err = _refused([command, *target, *TINY, "--ray-address", f"127.0.0.1:{port}"], run_dir)
    assert err == (
        f"gradmon-ray: config error: resources.ray_address: cannot reach Ray at 127.0.0.1:{port}: nothing listens "
        f"on 127.0.0.1:{port}; start the cluster or fix the address (unset: a local Ray)"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == []


@pytest.mark.e2e
def test_a_ray_address_where_a_web_server_answers_is_refused_at_once(without_shared_ray, tmp_path):
    """Before, ``ray.init`` printed Ray's GCS warnings for minutes (a new user's report: 20 of them, then
    a ``ConnectionError`` traceback); now one line, well before the 15 s a silent address gets."""
    with web_server() as address:
        started = time.monotonic()
        err = _refused(["train", *TINY, "--ray-address", address], tmp_path)
        assert time.monotonic() - started < 10.0
    assert err.startswith(f"gradmon-ray: config error: resources.ray_address: cannot reach Ray at {address}: ")
    assert "answers, but not as a Ray cluster does (no gRPC)" in err


@pytest.mark.e2e
def test_a_real_ray_gcs_passes_the_address_check(lasting_ray_address):
    """The handshake the check expects is what a real Ray head's GCS answers (the session's shared Ray)."""
    from gradmon_ray.app.resource_wait import ray_address_problem

    assert ray_address_problem(lasting_ray_address, timeout_s=5.0) is None


@pytest.mark.e2e
def test_ray_address_from_the_environment_is_named_as_such(without_shared_ray, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    err = _refused(["train", *TINY], tmp_path)
    assert err.startswith(f"gradmon-ray: config error: RAY_ADDRESS: cannot reach Ray at 127.0.0.1:{port}")


@pytest.mark.e2e
def test_more_env_runners_than_a_local_ray_has_cpus(without_shared_ray, tmp_path):
    """The issue's case: --num-env-runners 8 on a 2-CPU Ray; before, it waited, then left a FAILED
    MLflow run and an mlflow.db behind."""
    err = _refused(["train", *TINY, "--num-env-runners", "8", "--set", "resources.num_cpus=2"], tmp_path)
    assert err.startswith(
        "gradmon-ray: config error: resources: this run asks for CPU 8 but this Ray has CPU 2 in total, "
        "so it can never start"
    ), err
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_hands_start_ray_each_trials_whole_request(tmp_path, monkeypatch):
    """``tune`` asks ``start_ray`` (whose refusal of a request a local Ray can never place is
    ``test_more_env_runners_than_a_local_ray_has_cpus``'s) about a trial's whole placement group:
    RLlib's own request for the trial (oracle: ``PPO.default_resource_request``, every bundle, the
    trial's own process included: 1 + 3 EnvRunners), not a ``train`` run's, which leaves out the
    driver's bundle and would let Tune wait for ever.  ``start_ray`` is a stand-in that refuses as
    a 2-CPU local Ray would: exit 2, one line, nothing written."""
    from ray.rllib.algorithms.ppo import PPO

    import gradmon_ray.app.sweep.run as sweep_run
    from gradmon_ray.config import ConfigError, config_from_dict
    from gradmon_ray.rllib.config import build_ppo_config

    asked: list[dict[str, float]] = []

    def a_ray_with_two_cpus(cfg: object, request) -> bool:
        asked.append(request())
        raise ConfigError("resources", f"this run asks for CPU {asked[-1]['CPU']:g} but this Ray has CPU 2 in total")

    monkeypatch.setattr(sweep_run, "start_ray", a_ray_with_two_cpus)
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    resources = {"num_env_runners": 3, "num_cpus": 2}
    proc = run_cli(["tune", _sweep_file(tmp_path, resources=resources), *TINY], run_dir)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gradmon-ray: config error: resources: this run asks for CPU 4 but this Ray has CPU 2 in total"
    ], proc.stderr
    bundles = PPO.default_resource_request(build_ppo_config(config_from_dict({"resources": resources}))).bundles
    rllib: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            rllib[key] = rllib.get(key, 0.0) + amount
    assert [{k: v for k, v in request.items() if v} for request in asked] == [rllib] == [{"CPU": 4.0}]
    assert list(run_dir.iterdir()) == []
