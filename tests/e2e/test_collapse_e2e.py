"""The collapse latch and its stop rule in a real ``gradmon-ray train`` run, read back from MLflow.

``telemetry.bands.collapse.threshold: 1.01`` is above any normalised entropy (at most 1), so
every head is "low" every iteration and, with ``iterations: 2``, every head's latch must fire at
iteration 2 exactly, and ``health_stop.collapse`` must stop the 4-iteration run there with
reason code 5.  The same run checks gradmon's own learner path for the head entropy (the sum over
heads is the ``loss/entropy`` its PPO loss logs for the same last minibatch; that loss is checked
against RLlib's in ``tests/losses/test_ppo.py``) and that RLlib's ``vf_explained_var`` reaches MLflow.

Bugs this catches: the latch firing at the first low step or one late (counter off by one),
first_iteration off the learner clock, the stop rule not wired into ``run_training``, the wrong
stop code, per-head entropies of another minibatch than the loss's last one.
"""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.envs import FactoredOpsEnv
from gradmon_ray.rllib.module import resolve_heads
from gradmon_ray.telemetry.health_stop import STOP_REASON_CODES

pytestmark = pytest.mark.e2e


def test_collapse_latch_fires_at_iteration_2_and_stops_the_run(ray_session, tmp_path):
    layout = resolve_heads(FactoredOpsEnv().action_space)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict(
        {
            "iterations": 4,
            "seed": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"),  # the stop is checkpointed: not into the repository
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 1},
            "resources": {"num_env_runners": 0},
            "telemetry": {"bands": {"collapse": {"threshold": 1.01, "iterations": 2}}},
            "health_stop": {"collapse": True},
            "mlflow": {"tracking_uri": uri, "experiment": "collapse", "plots_every": 0},
        }
    )
    outcome = run_training(cfg)
    assert outcome.iterations_done == 2 and outcome.stop_reason is not None
    assert "collapsed" in outcome.stop_reason

    client = MlflowClient(uri)
    run = client.get_run(outcome.run_id)
    assert run.data.tags[mn.TAG_STATUS] == "stopped"

    def history(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(outcome.run_id, name)}

    assert history(mn.HEALTH_STOP_REASON) == {2: float(STOP_REASON_CODES["collapse"])} == {2: 5.0}
    for head, size in zip(layout.names, layout.sizes, strict=True):
        assert history(mn.head_metric(mn.HEAD_COLLAPSE_LATCH, head)) == {1: 0.0, 2: 1.0}, head
        assert history(mn.head_metric(mn.HEAD_COLLAPSE_LATCH_FIRST_ITERATION, head)) == {2: 2.0}, head
        entropy, norm = (
            history(mn.head_metric(mn.HEAD_ENTROPY, head)),
            history(mn.head_metric(mn.HEAD_ENTROPY_NORM, head)),
        )
        assert norm == pytest.approx({s: e / math.log(size) for s, e in entropy.items()}, rel=1e-12)
    loss_entropy = history(mn.ENTROPY)
    for step in (1, 2):
        heads_sum = sum(history(mn.head_metric(mn.HEAD_ENTROPY, h))[step] for h in layout.names)
        assert heads_sum == pytest.approx(loss_entropy[step], rel=1e-5)
    explained = history(mn.VF_EXPLAINED_VAR)
    assert sorted(explained) == [1, 2] and all(-1.0 <= v <= 1.0 for v in explained.values())
    assert explained[2] == outcome.last_metrics[mn.VF_EXPLAINED_VAR]
