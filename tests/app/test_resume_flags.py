"""``train --resume``'s own flags and checks (issue #37 item 6), through the CLI in this process:
``--iterations`` not above the iterations done and an unreachable ``--ray-address`` are refused in
one line before Ray starts or the run is reopened; ``--ray-address`` reaches the resumed run's config;
resume runs ``train``'s up-front checks (preflight, advisories).  Real checkpoints on disk (the real
``CheckpointReporter``), a real sqlite store; only ``run_training`` is replaced where Ray would start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.app import cli
from gradmon_ray.app.train.checkpoints import CheckpointReporter
from gradmon_ray.app.train.resume import CHECKPOINT_ROOT_ENV
from gradmon_ray.config import GradmonConfig
from tests.app.conftest import Learners
from tests.app.ray_address_stubs import grpc_like
from tests.app.test_resume_command import _fake_training, _run

DONE = 5


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No checkpoint root, store or Ray address from the environment; ``tmp_path`` is the working directory."""
    for name in (CHECKPOINT_ROOT_ENV, "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray must not start (``ray.is_initialized()`` may be True from another test in this worker)."""
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)


def _interrupted(store: str, learners: Learners, cfg: GradmonConfig | None = None) -> str:
    """A run checkpointed after ``DONE`` iterations under ``./gradmon-checkpoints`` (the default root)."""
    root = Path.cwd() / "gradmon-checkpoints"
    run_id = _run(store, root)
    CheckpointReporter(cfg or learners.cfg, lambda timeout_s: run_id, root=root).save(DONE, learners.at("a"), None)
    return run_id


def _untouched(store: str, run_id: str) -> bool:
    """The run was never reopened: still as created (a sink that opened and closed it would end it)."""
    info = MlflowClient(store).get_run(run_id).info
    return info.status == "RUNNING" and info.end_time is None


@pytest.mark.parametrize("n", [DONE - 2, DONE])
def test_iterations_not_above_those_done_are_refused_before_ray(store, learners, monkeypatch, capsys, n):
    seen = _fake_training(monkeypatch)
    run_id = _interrupted(store, learners)
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store, "--iterations", str(n)]) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"gradmon-ray: config error: --iterations: {n} is not more than the {DONE} iterations run {run_id} has "
        f"done; give --iterations N with N > {DONE}, or leave it out to train to the run's own "
        f"{learners.cfg.iterations}\n"
    )
    assert out == "" and seen == {} and _untouched(store, run_id)


def test_ray_address_and_iterations_reach_the_resumed_run_after_trains_checks(store, learners, monkeypatch, capsys):
    """``--iterations DONE+1`` is accepted; ``--ray-address`` (a gRPC server) is the resumed
    run's Ray; the run's config's advisories are printed as ``train`` prints them."""
    seen = _fake_training(monkeypatch)
    cfg = learners.cfg.model_copy(deep=True)
    cfg.vgs.enabled, cfg.vgs.apply_to, cfg.optimizer = True, "gradient", "adam"  # an advisory, as train gives
    run_id = _interrupted(store, learners, cfg)
    with grpc_like() as address:  # answers HTTP/2's handshake as Ray's GCS does
        argv = ["train", "--resume", run_id, "--mlflow-uri", store, "--iterations", str(DONE + 1)]
        assert cli.main([*argv, "--ray-address", address]) == 0
    out, err = capsys.readouterr()
    assert (seen["cfg"].resources.ray_address, seen["cfg"].iterations) == (address, DONE + 1)
    assert seen["resume"].iterations_done == DONE
    assert f"gradmon-ray: resuming run {run_id} after iteration {DONE} of {DONE + 1}\n" in out
    assert err.splitlines()[0].startswith("gradmon-ray: warning: vgs.apply_to: gradient with optimizer adam: ")


def test_an_unreachable_ray_address_is_refused_before_the_run_reopens(store, learners, monkeypatch, capsys):
    seen = _fake_training(monkeypatch)
    run_id = _interrupted(store, learners)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store, "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err == (
        f"gradmon-ray: config error: --ray-address: cannot reach Ray at 127.0.0.1:{port}: nothing listens on "
        f"127.0.0.1:{port}; start the cluster or fix the address (unset: a local Ray)\n"
    )
    assert seen == {} and _untouched(store, run_id)


def test_resume_runs_trains_preflight(store, learners, monkeypatch, capsys):
    """A run whose config names an env that cannot be built here: refused as ``train`` refuses it."""
    seen = _fake_training(monkeypatch)
    cfg = learners.cfg.model_copy(deep=True)
    cfg.env.id = "NoSuchEnv-v9"
    run_id = _interrupted(store, learners, cfg)
    assert cli.main(["train", "--resume", run_id, "--mlflow-uri", store]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gradmon-ray: config error: env: cannot create env 'NoSuchEnv-v9': ")
    assert seen == {} and _untouched(store, run_id)


def test_a_missing_local_store_is_refused_and_never_created(tmp_path, capsys):
    missing = tmp_path / "nowhere.db"
    assert cli.main(["train", "--resume", "0" * 32, "--mlflow-uri", f"sqlite:///{missing}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gradmon-ray: config error: --mlflow-uri: ") and str(missing) in line
    assert not missing.exists()
