"""``telemetry.param_movement``: how far each head moved and its exactly-zero gradient elements.

Oracles: a hand-made step (known weights, a known change, gradients with zeros at known places)
measured with numpy head by head, over row-split parameters too; in a real PPO update, each head's
ratio from the module's own submodules by attribute name (``module.heads[h]``, ``module.vf``), and
the module's ratio from every ``named_parameters()`` tensor, before and after, in float64.

Bugs this catches: the start not swapped (the ratio of the first step forever), a piece sent to the
wrong slot (a row-split output layer), the counts of zero gradients off, the band judged on the
iteration's ratio instead of per update, a restore that leaves the start at the old weights.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from gradmon_ray.telemetry.head_assignment import HeadSlots
from gradmon_ray.telemetry.head_norms import ParamRows
from gradmon_ray.telemetry.param_movement import ParameterMovement, movement_metrics


def _hand_made():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3))  # rows 0-1: head x, rows 2-5: head y
    b = torch.nn.Parameter(torch.randn(6))  # whole: head y
    trunk = torch.nn.Parameter(torch.randn(4, 4))
    groups = {"x": [ParamRows(w, slice(0, 2))], "y": [ParamRows(w, slice(2, 6)), b]}
    return groups, [trunk, w, b], w, b, trunk


def test_a_hand_made_step_head_by_head_against_numpy():
    groups, params, w, b, trunk = _hand_made()
    slots = HeadSlots([(groups, params)])
    movement = ParameterMovement(slots)
    movement.prime()
    start = {name: p.detach().double().numpy().copy() for name, p in zip("twb", params, strict=True)}
    with torch.no_grad():
        w[0] += 0.5
        w[3, 1] -= 2.0
        trunk.mul_(1.1)
    for p in params:
        p.grad = torch.ones_like(p)
    w.grad[1, :] = 0.0  # head x: 3 of its 6 elements
    b.grad[5] = 0.0  # head y: 1 of its 12 + 6
    trunk.grad[0, 0] = 0.0
    flat, complete = movement.measure()
    assert complete
    end = {name: p.detach().double().numpy() for name, p in zip("twb", params, strict=True)}
    values = flat.numpy().reshape(4, slots.num_slots)
    columns = slots.norm_columns(0)  # x, y, module total
    head_x = (start["w"][0:2], end["w"][0:2])
    head_y = (np.concatenate([start["w"][2:].ravel(), start["b"]]), np.concatenate([end["w"][2:].ravel(), end["b"]]))
    whole = (np.concatenate([v.ravel() for v in start.values()]), np.concatenate([v.ravel() for v in end.values()]))
    for column, (before, after) in zip(columns, (head_x, head_y, whole), strict=True):
        assert values[0, column] == pytest.approx(np.sum(before**2), rel=1e-6)
        assert values[1, column] == pytest.approx(np.sum((after - before) ** 2), rel=1e-6)
        assert values[2, column] == pytest.approx(np.sum(after**2), rel=1e-6)
    assert [round(values[3, c]) for c in columns] == [3, 1, 5]
    metrics = movement_metrics(values[:, columns], movement.numel[columns], ["x", "y"], updates=4, band=(1e-4, 1e-2))
    ratio_x = np.linalg.norm(head_x[1] - head_x[0]) / np.linalg.norm(head_x[0])
    assert metrics[mn.head_metric(mn.HEAD_UPDATE_RATIO, "x")] == pytest.approx(ratio_x, rel=1e-6)
    assert metrics[mn.head_metric(mn.HEAD_ZERO_GRAD_FRACTION, "y")] == 1 / 18
    assert metrics[mn.UPDATE_RATIO] == pytest.approx(
        np.linalg.norm(whole[1] - whole[0]) / np.linalg.norm(whole[0]), rel=1e-6
    )
    assert metrics[mn.head_metric(mn.HEAD_UPDATE_BAND, "x")] == (1.0 if ratio_x / 4 > 1e-2 else 0.0)
    # The end is the next step's start: no change since, a ratio of 0 (band -1: below 1e-4 an update).
    flat, _ = movement.measure()
    again = movement_metrics(
        flat.numpy().reshape(4, -1)[:, columns], movement.numel[columns], ["x", "y"], updates=4, band=(1e-4, 1e-2)
    )
    assert again[mn.head_metric(mn.HEAD_UPDATE_RATIO, "x")] == 0.0
    assert again[mn.head_metric(mn.HEAD_UPDATE_BAND, "x")] == -1.0


def test_a_parameter_without_gradient_makes_the_zero_counts_unknown_not_wrong():
    groups, params, w, _, _ = _hand_made()
    movement = ParameterMovement(HeadSlots([(groups, params)]))
    movement.prime()
    w.grad = torch.zeros_like(w)
    _, complete = movement.measure()
    assert complete is False


def _learner():
    cfg = config_from_dict(
        {"seed": 2, "model": {"trunk_hiddens": [16]}, "ppo": {"train_batch_size": 200, "minibatch_size": 50}}
    )
    learner = build_local_learner(cfg)
    return cfg, learner, learner.module[DEFAULT_MODULE_ID].unwrapped()


def _numbers(results) -> dict[str, float]:
    return {k: float(v.peek()) for k, v in results[DEFAULT_MODULE_ID].items() if isinstance(k, str) and "/" in k}


def _ratio(before: dict, after: dict, names) -> float:
    delta = sum(float((after[n] - before[n]).double().pow(2).sum()) for n in names)
    return float(np.sqrt(delta / sum(float(before[n].double().pow(2).sum()) for n in names)))


def test_a_real_update_each_head_against_the_modules_own_submodules_and_a_restore_restarts_the_count():
    cfg, learner, module = _learner()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    logged = _numbers(update(learner, train_batch(learner, sample_episodes(cfg, learner, 200)), cfg))
    after = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert logged[mn.UPDATE_RATIO] == pytest.approx(_ratio(before, after, list(after)), rel=1e-5)
    for head in ("op", "slot"):
        names = [f"heads.{head}.{n}" for n, _ in module.heads[head].named_parameters()]
        assert logged[mn.head_metric(mn.HEAD_UPDATE_RATIO, head)] == pytest.approx(
            _ratio(before, after, names), rel=1e-5
        ), head
        norm = np.sqrt(sum(float(after[n].double().pow(2).sum()) for n in names))
        assert logged[mn.head_metric(mn.HEAD_PARAM_NORM, head)] == pytest.approx(norm, rel=1e-5)
    # A restore: the next step's ratio is measured from the restored weights, not the old end.
    state = copy.deepcopy(learner.get_state())  # on CPU the state shares the live tensors' memory
    state["weights_seq_no"] = 0  # RLlib keeps newer weights than a state's: 0 always restores
    restored_from = {n: p.detach().clone() for n, p in module.named_parameters()}
    update(learner, train_batch(learner, sample_episodes(cfg, learner, 200)), cfg)
    learner.set_state(state)
    logged = _numbers(update(learner, train_batch(learner, sample_episodes(cfg, learner, 200)), cfg))
    now = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert logged[mn.UPDATE_RATIO] == pytest.approx(_ratio(restored_from, now, list(now)), rel=1e-5)
