"""The blame for a non-finite event in real runs, read back from MLflow field by field (docs/diagnosis.md).

Causes seeded where they happen in practice: the env (an Inf reward, a NaN in the observation it
ends an episode with: ``tests.fixtures.user_envs.NonFiniteFactoredOps``), the config (a regularizer
that returns NaN), the learner's weights (one element poisoned between two iterations of a drop-in
run) and a one-off fault (a NaN gradient element in one head in one iteration,
``tests/rllib/fault_injection.py``).  Oracles: where each was seeded (episode, timestep, column,
regularizer, parameter, head), known before the run; the env's ``t`` is the step that returned the
value, so the blamed row's timestep is ``t - 1`` for a reward (the reward of the action taken at
``t - 1``) and ``t`` for an observation.

Bugs this catches: a blame computed but not carried to the driver (item_series), tags and
artifacts out of step (a spill or a batch of iterations keeps only the last event), the skipped
line missing from the console, the stop rule not wired, the rows of another minibatch or another
iteration's train batch, the episode id with RLlib's ``_<index>`` suffix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.train.run import run_training
from gradmon_ray.config import config_from_dict
from gradmon_ray.telemetry.health_stop import STOP_REASON_CODES
from gradmon_ray.tracking.diagnosis_tags import DIAGNOSIS_ARTIFACT, diagnoses_from_tag

pytestmark = pytest.mark.e2e

ENV = "tests.fixtures.user_envs:NonFiniteFactoredOps"
EPISODE_LEN = 16  # the built-in env's default: 256 steps a train batch are 16 whole episodes


def _config(tmp_path: Path, iterations: int, faults: list[dict], **extra) -> tuple:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict(
        {
            "iterations": iterations,
            "seed": 1,
            "env": {"id": ENV, "config": {"seed_faults": faults}},
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "model": {"trunk_hiddens": [32]},
            "ppo": {"train_batch_size": 256, "minibatch_size": 128, "num_epochs": 1},
            "resources": {"num_env_runners": 0},
            "mlflow": {"tracking_uri": uri, "experiment": "diagnosis", "plots_every": 0},
            **extra,
        }
    )
    return cfg, MlflowClient(uri)


def _history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def _artifact(client, run_id: str, iteration: int, tmp_path: Path) -> dict:
    path = DIAGNOSIS_ARTIFACT.format(iteration=iteration, module="default_policy")
    return json.loads(Path(client.download_artifacts(run_id, path, str(tmp_path))).read_text())


def test_an_inf_reward_then_a_nan_final_observation_are_each_blamed_on_their_row(ray_session, tmp_path):
    faults = [
        {"field": "reward", "value": "inf", "episode": 2, "t": 5},  # iteration 1 (episodes 0-15)
        {"field": "obs", "value": "nan", "episode": 18, "t": EPISODE_LEN, "column": 7},  # iteration 2
    ]
    cfg, client = _config(tmp_path, 3, faults)
    lines: list[str] = []
    outcome = run_training(cfg, progress=lines.append)
    run_id = outcome.run_id
    minibatches = _history(client, run_id, mn.MINIBATCH_UPDATES)
    assert minibatches[1] == minibatches[2] == 3.0  # 256 + 16 rows (one masked step an episode), 128 a minibatch
    first = _artifact(client, run_id, 1, tmp_path / "a1")
    assert first["iteration"] == 1 and first["module"] == "default_policy"
    assert first["minibatch"] == 0 and first["minibatches"] == first["skipped"] == minibatches[1]
    assert first["rows"]["first_field"] == "rewards"
    assert first["rows"]["first"]["t"] == 5 - 1  # the reward of the action at t=4
    assert re.fullmatch(r"[0-9a-f]{32}", first["rows"]["first"]["episode_id"])  # no "_<index>" suffix
    assert first["rows"]["first"]["row"] == 2 * (EPISODE_LEN + 1) + 4  # two whole episodes (+1 masked step) before
    assert first["rows"]["fields"] == ["rewards", "value_targets", "advantages"]
    assert first["loss_terms"] == ["policy", "value"]
    assert first["reproduced"] is True and first["parameter"] is not None
    second = _artifact(client, run_id, 2, tmp_path / "a2")
    assert second["rows"]["first_field"] == "obs" and second["rows"]["obs_columns"] == [7]
    assert second["rows"]["first"]["t"] == EPISODE_LEN
    assert second["rows"]["first"]["row"] == (18 - 16) * (EPISODE_LEN + 1) + EPISODE_LEN  # its masked last row
    assert second["reproduced"] is True
    # The tag holds the last event's; the metrics each event's; iteration 3 is clean (left out, not NaN).
    tagged = diagnoses_from_tag(client.get_run(run_id).data.tags[mn.TAG_DIAGNOSIS])
    assert [json.loads(d.to_json()) for d in tagged] == [second]
    assert _history(client, run_id, mn.DIAGNOSIS_REPRODUCED) == {1: 1.0, 2: 1.0}
    assert _history(client, run_id, mn.DIAGNOSIS_MINIBATCH) == {1: 0.0, 2: 0.0}
    skipped = int(minibatches[2])
    assert (
        client.get_run(run_id).data.tags[mn.TAG_SKIPPED] == f"iteration 2: skipped {skipped}/{skipped}: did not train"
    )
    # The console: the iteration says it did not train, and the blame line follows it.
    iteration_lines = [i for i, line in enumerate(lines) if line.startswith("iter ")]
    assert f"skipped {skipped}/{skipped}: did not train" in lines[iteration_lines[0]]
    assert lines[iteration_lines[0] + 1].startswith("  diagnosis: NaN/Inf in")
    assert "first: rewards of episode_id" in lines[iteration_lines[0] + 1]
    assert "reproduced on re-run" in lines[iteration_lines[0] + 1]
    assert not lines[iteration_lines[2] + 1 :] or not lines[iteration_lines[2] + 1].startswith("  diagnosis")


def test_a_regularizer_returning_nan_is_the_term_blamed_and_the_reproduced_rule_stops_the_run(ray_session, tmp_path):
    regularizer = {"name": "slot_pen", "fn": "tests.fixtures.user_envs:nan_slot_penalty", "weight": 1.0}
    cfg, client = _config(tmp_path, 3, [], regularizers=[regularizer], health_stop={"reproduced_nonfinite": True})
    outcome = run_training(cfg, progress=None)
    assert outcome.iterations_done == 1
    run = client.get_run(outcome.run_id)
    assert run.data.tags[mn.TAG_STATUS] == "stopped"
    assert _history(client, outcome.run_id, mn.HEALTH_STOP_REASON) == {
        1: float(STOP_REASON_CODES["reproduced_nonfinite"])
    }
    (diagnosis,) = diagnoses_from_tag(run.data.tags[mn.TAG_DIAGNOSIS])
    assert diagnosis.loss_terms == ["slot_pen"]
    assert diagnosis.heads == ["slot"]
    assert diagnosis.parameter is not None and diagnosis.parameter.startswith("heads.slot.")
    assert diagnosis.rows["count"] == 0 and diagnosis.reproduced is True


def test_the_drop_in_and_the_callback_tell_a_one_off_fault_from_a_poisoned_weight(ray_session, tmp_path):
    """RLlib's own PPO learner and default CartPole module under ``with_gradmon``, logged by the MLflow
    callback: iteration 1 gets a NaN in one element of the ``pi`` head's gradient (once: not reproduced),
    iteration 2 a NaN weight of the value head, put there between the iterations (reproduced, named)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    from gradmon_ray.rllib import with_gradmon
    from gradmon_ray.tracking.callback import GradmonMLflowCallback
    from tests.rllib.fault_injection import with_faults

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .learners(num_learners=0, learner_class=with_gradmon(PPOTorchLearner))
        .training(train_batch_size=256, minibatch_size=128, num_epochs=1, learner_config_dict={"gradmon": {}})
        .framework("torch", torch_skip_nan_gradients=True)
        .callbacks(GradmonMLflowCallback.configured(tracking_uri=uri, experiment="dropin", spill_dir=None))
        .debugging(seed=0)
    )
    config = with_faults(config, {"grad": [{"rank": 0, "head": "pi", "iteration": 1, "value": "nan"}]})
    algo = config.build_algo()
    try:
        algo.train()

        def poison(learner) -> str:
            import torch

            module = learner.module["default_policy"].unwrapped()
            name, weight = next((n, p) for n, p in module.named_parameters() if n.startswith("vf."))
            with torch.no_grad():
                weight.view(-1)[0] = float("nan")
            return name

        (poisoned,) = algo.learner_group.foreach_learner(poison)
        algo.train()
    finally:
        algo.stop()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dropin").experiment_id])
    one_off = _artifact(client, run.info.run_id, 1, tmp_path / "a1")
    assert one_off["heads"] == ["pi"] and one_off["reproduced"] is False
    assert one_off["loss_terms"] == [] and one_off["parameter"] is None and one_off["rows"]["count"] == 0
    weight = _artifact(client, run.info.run_id, 2, tmp_path / "a2")
    poisoned = poisoned.get() if hasattr(poisoned, "get") else poisoned  # a local learner's result is the value
    assert weight["parameter"] == poisoned and poisoned.startswith("vf.")
    assert weight["reproduced"] is True and weight["rerun"]["weights_finite"] is False
    assert weight["loss_terms"] == ["total"]  # RLlib's own loss: one term
    assert _history(client, run.info.run_id, mn.DIAGNOSIS_REPRODUCED) == {1: 0.0, 2: 1.0}
