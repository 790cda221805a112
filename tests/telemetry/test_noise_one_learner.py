"""``telemetry.noise_one_learner``: B_simple with one learner, from the first epoch's minibatches.

Oracles: numpy sums of hand-set gradients (head by head, a row-split output layer included);
a synthetic stream of minibatch gradients ``G + noise`` with a known ``tr(Sigma) / |G|^2`` that
the one-learner estimator must recover, as the two-learner one (``telemetry.noise_scale``, each
learner a minibatch, their mean the big batch) does on the same stream; and in a real PPO update,
the first epoch's gradients captured by tensor hooks on the module's parameters, fed to
McCandlish's formulas written out in numpy here.

Bugs this catches: the sum not zeroed between steps, the second epoch's (reused) minibatches
added, the big batch taken as ``b`` instead of ``K * b``, the squared norms of the mean divided by
``K`` instead of ``K^2``, a head's rows sent to another head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from gradmon_ray.telemetry.head_norms import ParamRows
from gradmon_ray.telemetry.noise_one_learner import EpochGradientSum, one_learner_noise_inputs
from gradmon_ray.telemetry.noise_scale import NoiseScaleTracker


def test_the_sum_of_hand_set_gradients_head_by_head_and_zeroed_for_the_next_step():
    w = torch.nn.Parameter(torch.zeros(4, 2))
    trunk = torch.nn.Parameter(torch.zeros(3))
    groups = {"a": [ParamRows(w, slice(0, 1))], "b": [ParamRows(w, slice(1, 4))]}
    epoch = EpochGradientSum(groups, [trunk, w])
    rng = np.random.default_rng(0)
    grads = [(rng.normal(size=3), rng.normal(size=(4, 2))) for _ in range(3)]
    for i, (gt, gw) in enumerate(grads):
        trunk.grad, w.grad = torch.tensor(gt, dtype=torch.float32), torch.tensor(gw, dtype=torch.float32)
        assert epoch.add(i)
    sums = epoch.drain().numpy()
    total_t, total_w = sum(g[0] for g in grads), sum(g[1] for g in grads)
    expected = [np.sum(total_w[0] ** 2), np.sum(total_w[1:] ** 2), np.sum(total_t**2) + np.sum(total_w**2)]
    assert sums == pytest.approx(expected, rel=1e-5)
    assert epoch.minibatches == [0, 1, 2]
    trunk.grad, w.grad = torch.ones(3), torch.ones(4, 2)
    epoch.add(3)
    assert epoch.drain().numpy()[-1] == pytest.approx(11.0)  # only the new step's gradient
    w.grad = None
    assert epoch.add(4) is False


def _stream(rng, g: np.ndarray, sigma: float, b: int, n: int) -> np.ndarray:
    """``n`` minibatch gradients of ``b`` samples each: mean ``g``, per-sample covariance ``sigma^2 I``."""
    return g + rng.normal(scale=sigma / np.sqrt(b), size=(n, g.size))


def test_one_learner_and_two_learners_recover_the_same_known_noise_scale():
    rng = np.random.default_rng(1)
    g, sigma, b, k = np.full(20, 0.1), 1.0, 32, 8
    truth = 20 * sigma**2 / float(g @ g)  # tr(Sigma) / |G|^2 = 100
    one, two = NoiseScaleTracker(["x"], beta=0.99), NoiseScaleTracker(["x"], beta=0.99)
    for _ in range(3000):
        minibatches = _stream(rng, g, sigma, b, k)
        norms = np.linalg.norm(minibatches, axis=1, keepdims=True)
        sum_sq = np.array([np.sum(minibatches.sum(axis=0) ** 2)])
        small, big, b_small, b_big = one_learner_noise_inputs(sum_sq, norms, list(range(k)), b)
        one.update(list(small), list(big), b_small, b_big)
        pair = _stream(rng, g, sigma, b, 2)  # two learners, one minibatch each, averaged
        two.update([np.mean(np.sum(pair**2, axis=1))], [np.sum(pair.mean(axis=0) ** 2)], b, 2 * b)
    assert one.noise_scales()["x"] == pytest.approx(truth, rel=0.1)
    assert two.noise_scales()["x"] == pytest.approx(truth, rel=0.25)  # two learners: a noisier |G|^2


def test_a_non_finite_minibatch_or_a_single_one_gives_no_estimate():
    assert one_learner_noise_inputs(np.ones(2), np.array([[1.0, np.nan], [1.0, 1.0]]), [0, 1], 8) is None
    assert one_learner_noise_inputs(np.ones(2), np.ones((3, 2)), [0], 8) is None


def test_a_real_update_against_hook_captured_first_epoch_gradients():
    cfg = config_from_dict(
        {
            "seed": 5,
            "model": {"trunk_hiddens": [16]},
            "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2},
            "distributed": {"noise_scale_one_learner": True},
        }
    )
    learner = build_local_learner(cfg)
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    captured: list[float] = []
    squares: dict[int, float] = {}

    def hook(grad: torch.Tensor) -> None:
        squares.setdefault(len(captured), 0.0)
        squares[len(captured)] += float(grad.detach().double().pow(2).sum())

    sums: list[list[torch.Tensor]] = []
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.register_hook(hook)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    rows = int(batch.policy_batches[DEFAULT_MODULE_ID]["obs"].shape[0])
    first_epoch = rows // 64

    original = learner.compute_gradients

    def compute_gradients(*args, **kwargs):
        out = original(*args, **kwargs)
        if len(sums) < first_epoch:
            sums.append([p.grad.detach().double().clone() for p in params])
        captured.append(1.0)
        return out

    learner.compute_gradients = compute_gradients
    results = update(learner, batch, cfg)
    logged = float(results[DEFAULT_MODULE_ID][mn.GLOBAL_NOISE_SCALE].peek())
    small = np.mean([squares[i] for i in range(first_epoch)])
    mean = [sum(s[j] for s in sums) / first_epoch for j in range(len(params))]
    big = sum(float(m.pow(2).sum()) for m in mean)
    b_small, b_big = 64.0, 64.0 * first_epoch
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    assert logged == pytest.approx(trace / g2, rel=1e-4)  # the first EMA step: (1 - beta) cancels
