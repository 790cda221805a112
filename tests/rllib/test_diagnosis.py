"""The blame for a non-finite event (``rllib.diagnosis``), each cause seeded into a real update.

Oracles: the place each fault was seeded (episode, timestep, observation column, parameter,
regularizer, head) is known before training; the train-batch row of an episode's step is counted
from the sampled episodes' lengths (rows follow the episodes in order), and the poisoned fields
are read off the batch with numpy.  A seeded one-off fault (NaN logits or a NaN gradient element
in one iteration) must read "not reproduced"; data and weights must read "reproduced".
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import (
    build_local_learner,
    local_ppo_config,
    module_spaces,
    sample_episodes,
    train_batch,
    update,
)
from gradmon_ray.telemetry.blame import RESULT_KEY, Diagnosis, blame_line
from tests.rllib.fault_injection import with_faults

BASE = {
    "seed": 3,
    "model": {"trunk_hiddens": [16]},
    "ppo": {"train_batch_size": 200, "minibatch_size": 50, "num_epochs": 2},
}


def _setup(faults=None, **extra):
    cfg = config_from_dict({**BASE, **extra})
    if faults is None:
        learner = build_local_learner(cfg)
    else:
        learner = with_faults(local_ppo_config(cfg), faults).build_learner(spaces=module_spaces(cfg))
    return cfg, learner, sample_episodes(cfg, learner, 200)


def _value(results, key):
    value = results[DEFAULT_MODULE_ID][key]
    return value.peek() if hasattr(value, "peek") else value  # an in-process learner's results are Stats


def _diagnosis(results) -> Diagnosis:
    (text,) = _value(results, RESULT_KEY)
    return Diagnosis.from_json(text)


def _row_of(episodes, k: int, i: int) -> int:
    """The train-batch row of step ``i`` of episode ``k`` (each episode's rows follow the previous')."""
    return sum(len(e) for e in episodes[:k]) + i


def test_a_nan_reward_is_blamed_on_its_row_and_said_to_spread_through_gae_and_the_standardization():
    cfg, learner, episodes = _setup()
    k, i = 2, 3
    episode_id, t0 = episodes[k].id_, episodes[k].t_started
    episodes[k].rewards.data[i] = float("nan")
    batch = train_batch(learner, episodes)
    data = {c: np.asarray(v) for c, v in batch.policy_batches[DEFAULT_MODULE_ID].items()}
    results = update(learner, batch, cfg)
    d = _diagnosis(results)
    minibatches = int(_value(results, mn.MINIBATCH_UPDATES))
    assert d.iteration == 1 and d.minibatch == 0 and d.minibatches == d.skipped == minibatches
    assert d.rows["first_field"] == "rewards"
    assert d.rows["first"] == {"episode_id": episode_id, "agent_id": None, "t": t0 + i, "row": _row_of(episodes, k, i)}
    assert np.flatnonzero(np.isnan(data["rewards"])).tolist() == [_row_of(episodes, k, i)]
    # Every advantage is NaN (the standardization); every value target up to the reward's row, earlier
    # episodes too (RLlib's GAE: one backward discounted sum over the concatenated episodes).
    assert np.isnan(data["advantages"]).all()
    assert np.flatnonzero(np.isnan(data["value_targets"])).tolist() == list(range(_row_of(episodes, k, i) + 1))
    assert d.rows["fields"] == ["rewards", "value_targets", "advantages"]
    assert d.rows["count"] == 50  # every row of the minibatch: its advantages
    assert len(d.rows["spread_by"]) == 2 and d.rows["obs_columns"] == []
    assert d.loss_terms == ["policy", "value"]  # advantages -> policy, value targets -> value; entropy is clean
    assert d.reproduced is True
    assert _value(results, mn.DIAGNOSIS_REPRODUCED) == 1.0
    assert f"first: rewards of episode_id {episode_id} t={t0 + i}" in blame_line(d)
    assert f"reproduced on re-run; skipped {minibatches}/{minibatches}: did not train" in blame_line(d)


def test_a_nan_observation_column_is_blamed_on_its_column_and_row():
    cfg, learner, episodes = _setup()
    k, i, column = 1, 4, 11
    episodes[k].observations.data[i][column] = float("nan")
    batch = train_batch(learner, episodes)
    results = update(learner, batch, cfg)
    d = _diagnosis(results)
    assert d.rows["first_field"] == "obs"
    assert d.rows["obs_columns"] == [column]
    assert d.rows["first"]["row"] == _row_of(episodes, k, i) and d.rows["first"]["t"] == episodes[k].t_started + i
    assert d.reproduced is True


def test_a_poisoned_weight_is_named_and_reproduces():
    cfg, learner, episodes = _setup()
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    weight = module.heads["op"][-1].weight
    name = next(n for n, p in module.named_parameters() if p is weight)
    batch = train_batch(learner, episodes)  # the batch is clean: GAE ran before the poison
    with torch.no_grad():
        weight[0, 0] = float("nan")
    d = _diagnosis(update(learner, batch, cfg))
    assert d.parameter == name
    assert d.reproduced is True and d.rerun["weights_finite"] is False
    assert d.rows["first_field"] in ("module_logits", "module_logp")  # the data is clean: the weights
    assert "obs" not in d.rows["fields"] and "rewards" not in d.rows["fields"]


def test_a_regularizer_that_returns_nan_is_the_only_term_blamed_and_its_parameter_named():
    reg = [{"name": "slot_pen", "fn": "tests.fixtures.user_envs:nan_slot_penalty", "weight": 1.0}]
    cfg, learner, episodes = _setup(regularizers=reg)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    weight = module.heads["slot"][-1].weight
    name = next(n for n, p in module.named_parameters() if p is weight)
    d = _diagnosis(update(learner, train_batch(learner, episodes), cfg))
    assert d.loss_terms == ["slot_pen"]
    assert d.parameter == name
    assert d.heads == ["slot"]  # only its parameter's gradient is NaN
    assert d.rows["count"] == 0 and d.rows["first_field"] is None
    assert d.reproduced is True


def test_a_one_off_nan_gradient_in_one_head_is_blamed_on_that_head_and_not_reproduced():
    cfg, learner, episodes = _setup({"grad": [{"rank": 0, "head": "tempo", "iteration": 1, "value": "nan"}]})
    d = _diagnosis(update(learner, train_batch(learner, episodes), cfg))
    assert d.heads == ["tempo"]
    assert d.reproduced is False and d.loss_terms == [] and d.parameter is None
    assert "not reproduced on re-run (transient)" in blame_line(d)


def test_one_off_nan_logits_are_not_reproduced_and_a_clean_iteration_has_no_diagnosis():
    cfg, learner, episodes = _setup({"nan_logits": {"rank": 0, "head": "op", "iteration": 1}})
    results = update(learner, train_batch(learner, episodes), cfg)
    d = _diagnosis(results)
    assert d.reproduced is False and d.rows["count"] == 0
    results = update(learner, train_batch(learner, sample_episodes(cfg, learner, 200)), cfg)
    assert _value(results, mn.DIAGNOSIS_REPRODUCED) != _value(results, mn.DIAGNOSIS_REPRODUCED)  # NaN: not logged
    assert _value(results, RESULT_KEY) != _value(results, RESULT_KEY)


def test_the_diagnosis_json_keeps_the_documented_keys():
    d = Diagnosis(1, "p1", 7, 34, 34, ["slot"], ["entropy"], "pi.slot.weight", {"count": 3}, True)
    data = json.loads(d.to_json())
    for key in (
        "iteration",
        "module",
        "minibatch",
        "minibatches",
        "heads",
        "loss_terms",
        "parameter",
        "rows",
        "reproduced",
    ):
        assert key in data
    assert Diagnosis.from_json(d.to_json()) == d


@pytest.mark.parametrize(
    "skipped, minibatches, text", [(34, 34, "skipped 34/34: did not train"), (3, 34, "skipped 3/34")]
)
def test_skipped_text(skipped, minibatches, text):
    from gradmon_ray.telemetry.blame import skipped_text

    assert skipped_text(skipped, minibatches) == text


def test_a_module_absent_from_a_minibatch_is_not_blamed_for_its_no_gradient_nans():
    """A sparse agent's module has NaN norms ("no gradient") in the minibatches it was not in: only
    those it was in count."""
    from gradmon_ray.rllib.diagnosis import first_nonfinite_minibatch

    norms = np.array([[np.nan, np.nan], [1.0, 2.0], [1.0, np.inf], [np.nan, np.nan]])
    assert first_nonfinite_minibatch(norms) == 0
    assert first_nonfinite_minibatch(norms, [1, 2]) == 2
    assert first_nonfinite_minibatch(norms, [1]) is None
