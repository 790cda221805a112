"""Every ``grad_norm/{bucket}/...`` metric of ``analyse_batch``, by its logged NAME, recomputed.

The batch has a designed episode/group/reward/mask layout; the test counts each bucket's
groups, episodes and unmasked steps and its group reward stds itself (numpy), writes the PPO
component losses with ``torch.distributions`` and the regularizers by hand (``weight_l2``'s
gradient is the closed form ``2 w p``), takes gradients with ``torch.autograd.grad`` on a fresh
copy of the module, and fetches head parameters by module attribute name.  Nothing here calls
``component_gradients``, ``ppo_loss_from_batch``, ``signed_shares`` or ``head_parameter_groups``.
"""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
import tree
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from torch.distributions import Categorical, kl_divergence

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.losses.regularizers import resolve_regularizer
from gradmon_ray.probe.analysis import LossSettings, analyse_batch
from gradmon_ray.probe.connectors import EPISODE_COLUMN, GROUP_ID_COLUMN
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

LOSS = LossSettings(
    clip_param=0.2, vf_clip_param=10.0, vf_loss_coeff=0.5, entropy_coeff=0.05, kl_coeff=0.3, use_kl_loss=True
)
WEIGHTS = {"wl2": 0.01, "logits": 0.5}

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


def _designed_columns() -> dict[str, np.ndarray]:
    mask = np.ones(60, dtype=bool)
    mask[list(MASKED_ROWS)] = False
    return {
        Columns.REWARDS: np.concatenate(EPISODE_REWARDS).astype(np.float32),
        Columns.LOSS_MASK: mask,
        EPISODE_COLUMN: np.repeat(np.arange(6), 10),
        GROUP_ID_COLUMN: np.repeat(EPISODE_GROUPS, 10),
    }


@pytest.fixture(scope="module")
def module_and_batch():
    cfg = config_from_dict(
        {"seed": 8, "ppo": {"train_batch_size": 128, "minibatch_size": 128}, "model": {"trunk_hiddens": [16]}}
    )
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 128))
    update(learner, batch, cfg)  # weights move off the sampling policy: the KL term has a real gradient
    real = batch.policy_batches[DEFAULT_MODULE_ID]
    host = {k: tree.map_structure(lambda t: t.cpu().numpy()[:60], v) for k, v in real.items() if k != "weights_seq_no"}
    host.update(_designed_columns())
    return copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped()), host


def _expected_buckets(columns) -> dict[str, dict]:
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


def _hand_written_losses(module, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weighted components as they enter the loss, unweighted terms as RLlib logs them)."""
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
    policy = -mmean(torch.min(adv * ratio, adv * ratio.clamp(1 - LOSS.clip_param, 1 + LOSS.clip_param)))
    values = module.value_head(out[Columns.EMBEDDINGS]).squeeze(-1)
    value = mmean((values - batch[Postprocessing.VALUE_TARGETS]).pow(2).clamp(0, LOSS.vf_clip_param))
    ent, kl_mean = mmean(entropy), mmean(kl)
    weighted = {
        "task": policy,
        "entropy": -LOSS.entropy_coeff * ent,
        "kl": LOSS.kl_coeff * kl_mean,
        "value": LOSS.vf_loss_coeff * value,
    }
    regs = {
        "wl2": WEIGHTS["wl2"] * sum(p.pow(2).sum() for p in module.parameters()),
        "logits": WEIGHTS["logits"] * mmean(logits.pow(2).mean(-1)),
    }
    terms = {"policy": policy, "entropy": ent, "kl": kl_mean, "value": value, "total": sum(weighted.values())}
    return {**weighted, **regs}, terms


def _flat(grads) -> np.ndarray:
    return np.concatenate([g.detach().double().numpy().ravel() for g in grads])


def test_every_bucket_metric_by_name_equals_an_independent_recomputation(module_and_batch):
    module, batch = module_and_batch
    specs = [
        resolve_regularizer("wl2", "weight_l2", weight=WEIGHTS["wl2"]),
        resolve_regularizer("logits", "logit_l2", weight=WEIGHTS["logits"]),
    ]
    m = analyse_batch(module, batch, num_buckets=2, loss=LOSS, regularizers=specs)
    buckets = _expected_buckets(batch)
    assert m[mn.PROBE_NUM_BUCKETS] == 2 and m[mn.PROBE_NUM_GROUPS_TOTAL] == 4
    assert [b["episodes"] for b in buckets.values()] != [3, 3]  # the buckets differ: a swap would show
    for bucket, want in buckets.items():

        def name(template, bucket=bucket, **parts):
            return mn.probe_metric(template, bucket, **parts)

        assert m[name(mn.PROBE_NUM_GROUPS)] == want["groups"], bucket
        assert m[name(mn.PROBE_NUM_EPISODES)] == want["episodes"], bucket
        assert m[name(mn.PROBE_NUM_STEPS)] == want["steps"], bucket
        assert m[name(mn.PROBE_REWARD_STD_MEAN)] == pytest.approx(want["reward_std_mean"], rel=1e-9), bucket

        fresh = copy.deepcopy(module)
        rows = {k: tree.map_structure(lambda a, r=want["rows"]: torch.as_tensor(a[r]), v) for k, v in batch.items()}
        losses, terms = _hand_written_losses(fresh, rows)
        params = list(fresh.parameters())
        owners = {h: {id(p) for p in fresh.heads[h].parameters()} for h in fresh.heads}
        owners["value"] = {id(p) for p in fresh.value_head.parameters()}
        grads = {}
        for component, loss in losses.items():
            raw = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            grads[component] = [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw, strict=True)]
        # weight_l2's gradient in closed form: 2 * w * p
        np.testing.assert_allclose(_flat(grads["wl2"]), _flat([2 * WEIGHTS["wl2"] * p for p in params]), rtol=1e-6)
        flats = {c: _flat(g) for c, g in grads.items()}

        for component, g in flats.items():
            norm = float(np.linalg.norm(g))
            assert m[name(mn.PROBE_COMPONENT_NORM, component=component)] == pytest.approx(norm, rel=1e-4), component
            per_sample = m[name(mn.PROBE_PER_SAMPLE_NORM, component=component)]
            assert per_sample == pytest.approx(norm / want["episodes"], rel=1e-4), component
            per_token = m[name(mn.PROBE_PER_TOKEN_NORM, component=component)]
            assert per_token == pytest.approx(norm / want["steps"], rel=1e-4), component
        for loss_name, value in terms.items():
            assert m[name(mn.PROBE_LOSS, loss=loss_name)] == pytest.approx(float(value.detach()), rel=1e-4, abs=1e-7), (
                loss_name
            )

        ppo = ("task", "entropy", "kl", "value")
        total = sum(flats[c] for c in ppo)
        for component in ppo:
            share = float(flats[component] @ total / (total @ total))
            assert m[name(mn.PROBE_SHARE, component=component)] == pytest.approx(share, rel=1e-4, abs=1e-7)
            for head, ids in owners.items():
                want_norm = math.sqrt(
                    sum(
                        float(g.double().pow(2).sum())
                        for p, g in zip(params, grads[component], strict=True)
                        if id(p) in ids
                    )
                )
                got = m[name(mn.PROBE_HEAD_NORM, head=head, component=component)]
                assert got == pytest.approx(want_norm, rel=1e-4, abs=1e-9), (component, head)
        for a, b in itertools.combinations(ppo, 2):
            cosine = float(flats[a] @ flats[b] / (np.linalg.norm(flats[a]) * np.linalg.norm(flats[b])))
            assert m[name(mn.PROBE_COSINE, pair=f"{a}_vs_{b}")] == pytest.approx(cosine, rel=1e-4, abs=1e-7), (a, b)

        reg_total = flats["wl2"] + flats["logits"]
        assert m[name(mn.PROBE_REGULARIZER_TOTAL)] == pytest.approx(float(np.linalg.norm(reg_total)), rel=1e-4)
        for reg in WEIGHTS:
            got_norm = m[name(mn.PROBE_REGULARIZER_GRAD_NORM, regularizer=reg)]
            assert got_norm == pytest.approx(float(np.linalg.norm(flats[reg])), rel=1e-4), reg
            share = float(flats[reg] @ reg_total / (reg_total @ reg_total))
            assert m[name(mn.PROBE_REGULARIZER_SHARE, regularizer=reg)] == pytest.approx(share, rel=1e-4), reg
            assert m[name(mn.PROBE_REGULARIZER_ERROR, regularizer=reg)] == 0.0


# --- probe/duration_s and probe/skipped ------------------------------------------------------

SLEEP_S = 0.2
SLEEPS: list[float] = []


def sleepy_l2(module, batch, fwd_out):
    """A regularizer that sleeps a known time per call and counts its calls."""
    import time

    SLEEPS.append(SLEEP_S)
    time.sleep(SLEEP_S)
    return fwd_out[Columns.ACTION_DIST_INPUTS].pow(2).mean()


def _request(module, batch, iteration: int):
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from gradmon_ray.probe import ProbeRequest

    return ProbeRequest(
        iteration=iteration,
        module_spec=RLModuleSpec(
            module_class=type(module),
            observation_space=module.observation_space,
            action_space=module.action_space,
            model_config=module.model_config,
        ),
        weights={k: v.detach().numpy().copy() for k, v in module.state_dict().items()},
        batch=batch,
        loss=LOSS,
    )


def test_duration_is_bracketed_by_the_known_sleep_and_the_callers_wall_clock(module_and_batch):
    """The sleeping regularizer's calls (at least one per bucket) x SLEEP_S <= duration <= wall time."""
    import time

    from gradmon_ray.probe.actor import GradientProbe

    module, batch = module_and_batch
    regs = [{"name": "sleepy", "fn": "tests.probe.test_metric_oracles:sleepy_l2", "weight": 1.0, "enabled": True}]
    probe = GradientProbe(num_buckets=2, regularizers=regs, track_grad_norms=True, device="cpu")
    request = _request(module, batch, iteration=3)
    SLEEPS.clear()
    start = time.perf_counter()
    outcome = probe.analyse(request)
    wall = time.perf_counter() - start
    assert outcome.status == "ok", outcome
    assert len(SLEEPS) >= 2  # once per bucket at least
    assert sum(SLEEPS) <= probe.last_metrics[mn.PROBE_DURATION_S] <= wall


def test_a_batch_with_fewer_groups_than_buckets_counts_one_skip(ray_session, module_and_batch):
    """4 groups (counted in ``_expected_buckets``) for 5 buckets: sent 1, skipped 1, nothing else."""
    import time
    import uuid

    import ray

    from gradmon_ray.probe import ProbeClient, start_probe_actor

    module, batch = module_and_batch
    assert sum(b["groups"] for b in _expected_buckets(batch).values()) == 4
    name = f"gradmon-probe-oracle-{uuid.uuid4().hex[:8]}"
    actor = start_probe_actor(name, tracking_uri=None, run_id=None, num_buckets=5, num_cpus=1)
    try:
        client = ProbeClient(name, every=1)
        assert client.reserve()
        client.submit(_request(module, batch, iteration=1))
        deadline = time.monotonic() + 60
        while client.busy and time.monotonic() < deadline:
            client.poll()
            time.sleep(0.05)
        assert client.counters == {
            mn.PROBE_REQUESTS_SENT: 1,
            mn.PROBE_REQUESTS_DROPPED: 0,
            mn.PROBE_COMPLETED: 0,
            mn.PROBE_SKIPPED: 1,
            mn.PROBE_FAILURES: 0,
        }
    finally:
        ray.kill(actor)
