"""Real RLlib PPO on a local Ray instance, telemetry read back from a real MLflow store."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.envs import HEAD_NAMES, FactoredOpsEnv
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.plots import ENTROPY_FILE, HEATMAP_FILE, LINES_FILE, norm_matrix
from gradmon_ray.viz.report import PLOTS_ARTIFACT_DIR
from gradmon_ray.viz.runs import load_history

pytestmark = pytest.mark.e2e

ALL_HEADS = [*HEAD_NAMES, "value"]
HEAD_ORDER = [*HEAD_NAMES, "value"]  # the built-in env's declared order, op first
"""The order the tag, watch and the plots give the heads: the module's (the Dict's sorted keys), then value."""


def _random_policy_return(episodes: int = 400) -> tuple[float, float]:
    env = FactoredOpsEnv()
    env.action_space.seed(123)
    returns = []
    for ep in range(episodes):
        env.reset(seed=10_000 + ep)
        total, done = 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(env.action_space.sample())
            total, done = total + r, term or trunc
        returns.append(total)
    return float(np.mean(returns)), float(np.std(returns) / math.sqrt(episodes))


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    cfg = config_from_dict(
        {
            "iterations": 10,
            "seed": 1,
            "checkpoint_dir": str(tmp / "ckpt"),
            "ppo": {"train_batch_size": 1000, "minibatch_size": 125, "num_epochs": 4, "lr": 1e-3},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "e2e", "run_name": "e2e"},
        }
    )
    lines: list[str] = []
    outcome = run_training(cfg, progress=lines.append)
    return cfg, outcome, lines


def test_mlflow_holds_all_telemetry_by_name_and_it_is_finite(trained):
    cfg, outcome, lines = trained
    assert outcome.iterations_done == 10 and outcome.mlflow_complete
    client = MlflowClient(cfg.mlflow.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert [r.info.run_id for r in runs] == [outcome.run_id]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags[mn.TAG_STATUS] == "finished"
    assert run.data.params["ppo.minibatch_size"] == "125"
    assert run.data.tags[mn.TAG_HEAD_NAMES].split(",") == HEAD_ORDER
    names = [mn.head_metric(t, h) for h in ALL_HEADS for t in (mn.HEAD_GRAD_NORM, mn.HEAD_GRAD_NORM_PREV)]
    names += [mn.head_metric(t, h) for h in HEAD_NAMES for t in (mn.HEAD_NAN_LATCH, mn.HEAD_INF_LATCH)]
    names += [mn.GLOBAL_GRAD_NORM, mn.NAN_GRAD_COUNT, mn.INF_GRAD_COUNT, mn.HEAD_GRAD_NORM_CV, mn.SKIPPED_UPDATES]
    for name in names:
        history = client.get_metric_history(outcome.run_id, name)
        assert sorted(m.step for m in history) == list(range(1, 11)), name
        values = [m.value for m in history if not (name.endswith("norm_prev") and m.step == 1)]
        assert all(math.isfinite(v) for v in values), name
    for head in ALL_HEADS:
        norms = [m.value for m in client.get_metric_history(outcome.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))]
        assert all(0.0 < v < 50.0 for v in norms), head
    for name in [mn.head_metric(mn.HEAD_NAN_LATCH, h) for h in HEAD_NAMES] + [mn.NAN_GRAD_COUNT, mn.SKIPPED_UPDATES]:
        assert {m.value for m in client.get_metric_history(outcome.run_id, name)} == {0.0}, name
    assert mn.TAG_NAN_LATCHED_HEADS not in run.data.tags
    # One learner: no local-vs-global pair, so the noise scale is absent, not made up.
    assert client.get_metric_history(outcome.run_id, mn.GLOBAL_NOISE_SCALE) == []
    assert len(lines) == 10 and lines[-1].startswith("iter 10/10 | env steps 10000 | return ")


def test_ppo_beats_a_uniform_random_policy(trained):
    _, outcome, _ = trained
    random_mean, random_sem = _random_policy_return()
    learned = outcome.last_metrics[mn.EPISODE_RETURN_MEAN]
    # Random: about -0.6 per episode; the optimum is about +11.
    assert learned > random_mean + 2.0 + 4 * random_sem, (learned, random_mean)


def test_checkpoint_restores_telemetry_state(trained):
    from ray.rllib.algorithms.algorithm import Algorithm

    _, outcome, _ = trained
    algo = Algorithm.from_checkpoint(outcome.checkpoint_path)
    try:
        # the learner reports in the module's (logits') order; only the display follows the declared order
        assert list(algo.learner_group._learner.head_names) == [*sorted(HEAD_NAMES), "value"]
        state = algo.learner_group._learner.telemetry_state()["default_policy"]
        assert state["iteration"] == 10 and state["latches"]["nan"] == {h: False for h in sorted(HEAD_NAMES)}
        result = algo.train()
        assert result["learners"]["default_policy"][mn.TELEMETRY_ITERATION] == 11
    finally:
        algo.stop()


def test_cli_train_on_embedded_defaults(tmp_path):
    """The README's run command, exactly, in a fresh directory: local Ray, built-in env, sqlite MLflow."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradmon_ray.app.cli", "train", "--iterations", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iter 3/3 | env steps 3072" in proc.stdout
    # Ray's and MLflow's start-up notices are filtered (never the hint to switch token auth off)
    assert "RAY_AUTH_MODE" not in proc.stderr and "new API stack" not in proc.stderr, proc.stderr[-3000:]
    assert "Creating initial MLflow database tables" not in proc.stderr
    assert (Path(tmp_path) / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    for head in ALL_HEADS:
        history = client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert len(history) == 3 and all(math.isfinite(m.value) for m in history)


def _train_until_then_ctrl_c(tmp_path, args: list[str], progress_prefix: str) -> tuple[int, str]:
    """Run ``gradmon-ray train ARGS`` in ``tmp_path``, send SIGINT (Ctrl-C) once a progress line
    starts with ``progress_prefix``; returns (exit code, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradmon_ray.app.cli", "train", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith(progress_prefix):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_ctrl_c_ends_the_run_as_killed(tmp_path):
    """Ctrl-C (SIGINT to the CLI) during training: exit 130, and the MLflow run is KILLED (what
    MLflow calls a run its user stopped), not FAILED, with what was trained so far logged."""
    returncode, err = _train_until_then_ctrl_c(
        tmp_path, ["--iterations", "200", "--num-env-runners", "0"], "iter 1/200"
    )
    assert returncode == 130, err[-3000:]
    assert "gradmon-ray: interrupted" in err
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradmon-ray").experiment_id])
    assert run.info.status == "KILLED"
    assert run.data.tags[mn.TAG_STATUS] == "killed"
    assert len(client.get_metric_history(run.info.run_id, mn.GLOBAL_GRAD_NORM)) >= 1


def test_plots_are_artifacts_of_the_real_run_and_match_its_metrics(trained, tmp_path):
    cfg, outcome, _ = trained
    client = MlflowClient(cfg.mlflow.tracking_uri)
    arts = sorted(a.path for a in client.list_artifacts(outcome.run_id, PLOTS_ARTIFACT_DIR))
    expected = (HEATMAP_FILE, LINES_FILE, ENTROPY_FILE)  # no probe ran
    assert arts == sorted(f"{PLOTS_ARTIFACT_DIR}/{name}" for name in expected)
    local = Path(client.download_artifacts(outcome.run_id, f"{PLOTS_ARTIFACT_DIR}/{HEATMAP_FILE}", str(tmp_path)))
    assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 10_000
    heads, steps, matrix = norm_matrix(load_history(client, outcome.run_id))
    assert heads == HEAD_ORDER and steps == list(range(1, 11))
    for i, head in enumerate(heads):
        logged = client.get_metric_history(outcome.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
        assert list(matrix[i]) == [m.value for m in sorted(logged, key=lambda m: m.step)]


def test_watch_once_shows_every_head_of_the_real_run(trained):
    cfg, outcome, _ = trained
    console = Console(record=True, width=220, color_system=None)
    snap = watch(MlflowClient(cfg.mlflow.tracking_uri), run_id=outcome.run_id, once=True, console=console)
    text = console.export_text()
    assert snap.iteration == 10 and snap.heads == HEAD_ORDER
    assert all(head in text for head in ALL_HEADS) and "missing" not in text
    assert "iteration 10" in text and "env steps 10000" in text


def test_an_interrupted_run_resumes_in_the_same_mlflow_run(tmp_path):
    """``checkpoint_every: 2``, Ctrl-C after iteration 3, then ``train --resume RUN_ID``: the
    same MLflow run continues from the iteration-2 checkpoint to the end, FINISHED, every
    iteration logged exactly once (iteration 3 is trained again, not logged again)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base = [sys.executable, "-m", "gradmon_ray.app.cli", "train"]
    args = ["--iterations", "5", "--num-env-runners", "0", "--set", "checkpoint_every=2"]
    returncode, _ = _train_until_then_ctrl_c(tmp_path, args, "iter 3/5")
    assert returncode == 130
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gradmon-ray").experiment_id
    (run,) = client.search_runs([experiment])
    assert run.info.status == "KILLED"
    assert (tmp_path / "gradmon-checkpoints" / run.info.run_id / "latest" / "gradmon_resume.json").is_file()

    resumed = subprocess.run(
        [*base, "--resume", run.info.run_id], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming run {run.info.run_id} after iteration 2 of 5" in resumed.stdout
    (again,) = client.search_runs([experiment])  # still one run
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert again.data.tags[mn.TAG_RESUMED_FROM] == "2"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, mn.GLOBAL_GRAD_NORM)]
    assert sorted(steps) == [1, 2, 3, 4, 5]
    bad = subprocess.run([*base, "--resume", "0" * 32], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("gradmon-ray: config error: --resume: no run")
