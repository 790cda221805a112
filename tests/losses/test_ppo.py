"""``losses/ppo.py``: our PPO loss equals RLlib's PPOTorchLearner loss, evaluated with RLlib's own distributions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.core.distribution.torch.torch_distribution import TorchMultiCategorical
from ray.rllib.evaluation.postprocessing import Postprocessing

from gradmon_ray.losses.ppo import masked_mean, ppo_loss_terms
from gradmon_ray.rllib import FactoredCategorical

SIZES = (3, 2, 4)
B = 16


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, sum(SIZES), generator=g, requires_grad=True)
    old_logits = logits.detach() + 0.3 * torch.randn(B, sum(SIZES), generator=g)
    actions = torch.stack([torch.randint(0, s, (B,), generator=g) for s in SIZES], dim=-1)
    old_dist = TorchMultiCategorical.from_logits(old_logits, input_lens=list(SIZES))
    mask = torch.rand(B, generator=g) > 0.2
    batch = {
        Columns.ACTIONS: actions,
        Columns.ACTION_LOGP: old_dist.logp(actions),
        Columns.ACTION_DIST_INPUTS: old_logits,
        Postprocessing.ADVANTAGES: torch.randn(B, generator=g),
        Postprocessing.VALUE_TARGETS: torch.randn(B, generator=g) * 5,
        Columns.LOSS_MASK: mask,
    }
    values = torch.randn(B, generator=g, requires_grad=True)
    return logits, values, batch


def _rllib_loss(logits, values, batch, config):
    """RLlib's own compute_loss_for_module on a stand-in learner with RLlib distributions."""
    dist_cls = TorchMultiCategorical.get_partial_dist_cls(input_lens=list(SIZES))
    module = SimpleNamespace(
        get_train_action_dist_cls=lambda: dist_cls,
        get_exploration_action_dist_cls=lambda: dist_cls,
        compute_values=lambda batch, embeddings=None: values,
    )
    stand_in = SimpleNamespace(
        module={"p": SimpleNamespace(unwrapped=lambda: module)},
        entropy_coeff_schedulers_per_module={"p": SimpleNamespace(get_current_value=lambda: config.entropy_coeff)},
        curr_kl_coeffs_per_module={"p": torch.tensor(config.kl_coeff)},
        metrics=SimpleNamespace(log_dict=lambda *a, **k: None),
    )
    return PPOTorchLearner.compute_loss_for_module(
        stand_in, module_id="p", config=config, batch=batch, fwd_out={Columns.ACTION_DIST_INPUTS: logits}
    )


@pytest.mark.parametrize("use_kl_loss", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("use_critic", "masked"), [(True, True), (False, True), (True, False)])
def test_total_loss_and_gradients_equal_rllib(use_kl_loss, seed, use_critic, masked):
    """Also without a critic (RLlib's ``use_critic=False``: the value terms are zero) and without a
    loss mask (RLlib's plain means): every branch of the one-pass masked means."""
    config = PPOConfig().training(
        clip_param=0.2,
        vf_clip_param=3.0,
        vf_loss_coeff=0.7,
        entropy_coeff=0.05,
        use_kl_loss=use_kl_loss,
        kl_coeff=0.3,
        use_critic=use_critic,
    )
    logits, values, batch = _batch(seed)
    if not masked:
        del batch[Columns.LOSS_MASK]
    expected = _rllib_loss(logits, values, batch, config)
    wrt = [logits, values] if use_critic else [logits]
    g_expected = torch.autograd.grad(expected, wrt)
    cls = FactoredCategorical.for_heads(("x", "y", "z"), SIZES, "multi_discrete")
    terms = ppo_loss_terms(
        dist=cls.from_logits(logits),
        prev_dist=cls.from_logits(batch[Columns.ACTION_DIST_INPUTS]),
        actions=batch[Columns.ACTIONS],
        old_logp=batch[Columns.ACTION_LOGP],
        advantages=batch[Postprocessing.ADVANTAGES],
        values=values if use_critic else None,
        value_targets=batch[Postprocessing.VALUE_TARGETS],
        mask=batch.get(Columns.LOSS_MASK),
        clip_param=config.clip_param,
        vf_clip_param=config.vf_clip_param,
        vf_loss_coeff=config.vf_loss_coeff,
        entropy_coeff=config.entropy_coeff,
        kl_coeff=torch.tensor(config.kl_coeff),
        use_kl_loss=use_kl_loss,
    )
    torch.testing.assert_close(terms.total, expected)
    for got, want in zip(torch.autograd.grad(terms.total, wrt), g_expected, strict=True):
        torch.testing.assert_close(got, want)
    assert terms.per_head_logp.shape == (B, 3)
    assert terms.per_head_entropy.shape == (3,)


def test_masked_mean_worked_answer():
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    mask = torch.tensor([True, True, False, True])
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3.0)  # NaN in a masked row is ignored
    assert masked_mean(torch.tensor([1.0, 3.0]), None).item() == 2.0
    rows = masked_mean(torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]), torch.tensor([True, True, False]))
    assert rows.tolist() == [2.0, 3.0]


def test_explained_variance_matches_rllib():
    from ray.rllib.utils.torch_utils import explained_variance as rllib_ev

    from gradmon_ray.losses.ppo import explained_variance

    g = torch.Generator().manual_seed(3)
    y = torch.randn(32, generator=g)
    for pred in (y + 0.1 * torch.randn(32, generator=g), torch.zeros(32), -5 * y):
        torch.testing.assert_close(explained_variance(y, pred), rllib_ev(y, pred))
    small = 1e-3 * y  # Var ~1e-6: the epsilon matters, so it must be RLlib's
    torch.testing.assert_close(explained_variance(small, 0.5 * small), rllib_ev(small, 0.5 * small))
    assert explained_variance(y, y).item() == pytest.approx(1.0)
    assert explained_variance(y, -10 * y).item() == -1.0  # clamped
