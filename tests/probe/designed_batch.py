"""A designed probe batch for the probe's oracle tests (not a test module).

A real postprocessed batch of the built-in env, cut to 60 rows, whose episode, group, reward and
loss-mask columns are replaced by a designed layout, so that each bucket's groups, episodes,
unmasked steps and reward stds can be counted by hand (``expected_buckets``, numpy); the module's
weights have moved off the sampling policy by one update, so the KL term has a real gradient.
Also the PPO loss written out by hand (``hand_written_losses``, the probe oracles' loss) and a
regularizer that sleeps a known time per call (``sleepy_l2``).
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
import tree
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from torch.distributions import Categorical, kl_divergence

from gradmon_ray.config import config_from_dict
from gradmon_ray.probe.analysis import LossSettings
from gradmon_ray.probe.connectors import EPISODE_COLUMN, GROUP_ID_COLUMN
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

LOSS = LossSettings(
    clip_param=0.2, vf_clip_param=10.0, vf_loss_coeff=0.5, entropy_coeff=0.05, kl_coeff=0.3, use_kl_loss=True
)

# 60 rows, 6 episodes of 10 rows. Masked rows (RLlib's extra bootstrap step): 9, 29, 59.
EPISODE_GROUPS = [4, 4, -1, 9, 9, -1]  # -1: no group, the episode is a group of its own
EPISODE_REWARDS = [
    [0.1] * 10,
    [0.4] * 10,
    [0.0, 1.0] * 5,
    [2.0] * 10,
    [1.0] * 5 + [2.0] * 5,
    [0.5, 2.5] * 5,
]
MASKED_ROWS = (9, 29, 59)


def designed_columns() -> dict[str, np.ndarray]:
    mask = np.ones(60, dtype=bool)
    mask[list(MASKED_ROWS)] = False
    return {
        Columns.REWARDS: np.concatenate(EPISODE_REWARDS).astype(np.float32),
        Columns.LOSS_MASK: mask,
        EPISODE_COLUMN: np.repeat(np.arange(6), 10),
        GROUP_ID_COLUMN: np.repeat(EPISODE_GROUPS, 10),
    }


def designed_module_and_batch():
    """(a copy of the module after one update, the designed 60-row batch as numpy columns)."""
    cfg = config_from_dict(
        {"seed": 8, "ppo": {"train_batch_size": 128, "minibatch_size": 128}, "model": {"trunk_hiddens": [16]}}
    )
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 128))
    update(learner, batch, cfg)  # weights move off the sampling policy: the KL term has a real gradient
    real = batch.policy_batches[DEFAULT_MODULE_ID]
    host = {k: tree.map_structure(lambda t: t.cpu().numpy()[:60], v) for k, v in real.items() if k != "weights_seq_no"}
    host.update(designed_columns())
    return copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped()), host


def expected_buckets(columns) -> dict[str, dict]:
    """Groups by reward std, counted by hand: a group's std is the population std of its
    episodes' returns (unmasked rewards); a group of one episode uses its per-step rewards."""
    mask, rewards, episode = columns[Columns.LOSS_MASK], columns[Columns.REWARDS], columns[EPISODE_COLUMN]
    groups: dict[object, list[int]] = {}
    for e, gid in enumerate(EPISODE_GROUPS):
        groups.setdefault(("alone", e) if gid == -1 else gid, []).append(e)

    def valid_rewards(e):
        return rewards[(episode == e) & mask].astype(np.float64)

    stds = {}
    for key, members in groups.items():
        if len(members) == 1:
            stds[key] = float(np.std(valid_rewards(members[0])))
        else:
            stds[key] = float(np.std([valid_rewards(e).sum() for e in members]))
    order = sorted(groups, key=lambda k: stds[k])  # 4 groups (stds all distinct), 2 buckets: 2 + 2
    assert len(set(stds.values())) == len(stds)
    split = {"bucket_1": order[:2], "bucket_2": order[2:]}
    out = {}
    for bucket, keys in split.items():
        episodes = sorted(e for k in keys for e in groups[k])
        rows = np.flatnonzero(np.isin(episode, episodes))
        out[bucket] = {
            "groups": len(keys),
            "episodes": len(episodes),
            "steps": int(mask[rows].sum()),
            "reward_std_mean": float(np.mean([stds[k] for k in keys])),
            "rows": rows,
        }
    return out


def hand_written_losses(module, batch, loss: LossSettings):
    """The PPO loss written out with ``torch.distributions`` (no gradmon loss code): ``(weighted
    components as they enter the total loss, unweighted terms as RLlib logs them, the current
    logits, the float loss mask)``.  ``module`` is a ``FactoredActorCritic``; heads by attribute."""
    out = module.forward_train(batch)
    logits = out[Columns.ACTION_DIST_INPUTS]
    names = sorted(module.heads)  # the Dict action space's keys, as dm-tree flattens them
    sizes = [module.heads[n][-1].out_features for n in names]
    heads = torch.split(logits, sizes, dim=-1)
    old_heads = torch.split(batch[Columns.ACTION_DIST_INPUTS], sizes, dim=-1)
    actions = batch[Columns.ACTIONS]
    logp = sum(Categorical(logits=h).log_prob(actions[n]) for h, n in zip(heads, names, strict=True))
    entropy = sum(Categorical(logits=h).entropy() for h in heads)
    kl = sum(kl_divergence(Categorical(logits=o), Categorical(logits=h)) for o, h in zip(old_heads, heads, strict=True))
    mask = batch[Columns.LOSS_MASK].float()

    def mmean(x):
        return (x * mask).sum() / mask.sum()

    ratio = torch.exp(logp - batch[Columns.ACTION_LOGP])
    adv = batch[Postprocessing.ADVANTAGES]
    policy = -mmean(torch.min(adv * ratio, adv * ratio.clamp(1 - loss.clip_param, 1 + loss.clip_param)))
    values = module.value_head(out[Columns.EMBEDDINGS]).squeeze(-1)
    value = mmean((values - batch[Postprocessing.VALUE_TARGETS]).pow(2).clamp(0, loss.vf_clip_param))
    ent, kl_mean = mmean(entropy), mmean(kl)
    weighted = {
        "task": policy,
        "entropy": -loss.entropy_coeff * ent,
        **({"kl": loss.kl_coeff * kl_mean} if loss.use_kl_loss else {}),
        "value": loss.vf_loss_coeff * value,
    }
    total = sum(weighted.values())
    terms = {"policy": policy, "entropy": ent, "kl": kl_mean, "value": value, "total": total}
    return weighted, terms, logits, mask


def flat(grads) -> np.ndarray:
    """Gradients as one float64 vector."""
    return np.concatenate([g.detach().double().numpy().ravel() for g in grads])


SLEEP_S = 0.2
SLEEPS: list[float] = []


def sleepy_l2(module, batch, fwd_out):
    """A regularizer that sleeps ``SLEEP_S`` per call and counts its calls in ``SLEEPS``."""
    SLEEPS.append(SLEEP_S)
    time.sleep(SLEEP_S)
    return fwd_out[Columns.ACTION_DIST_INPUTS].pow(2).mean()


def module_probe(module, batch, *, module_id: str = DEFAULT_MODULE_ID, loss: LossSettings = LOSS):
    """One module's share of a probe request: a spec that builds ``module``, its weights, ``batch``."""
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from gradmon_ray.probe import ModuleProbe

    return ModuleProbe(
        module_id=module_id,
        module_spec=RLModuleSpec(
            module_class=type(module),
            observation_space=module.observation_space,
            action_space=module.action_space,
            model_config=module.model_config,
        ),
        weights={k: v.detach().numpy().copy() for k, v in module.state_dict().items()},
        batch=batch,
        loss=loss,
    )


def probe_request(module, batch, iteration: int):
    """A one-module probe request (plain metric names) for ``module`` on ``batch``."""
    from gradmon_ray.probe import ProbeRequest

    return ProbeRequest(iteration=iteration, modules=[module_probe(module, batch)])
