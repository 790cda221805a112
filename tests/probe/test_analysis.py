"""``probe/analysis.py``: ``analyse_batch``, episodes, groups and buckets from the batch columns, checked by hand.

Every ``grad_norm/{bucket}/...`` metric by its logged NAME is recomputed on a designed batch
(``designed_batch.py``): the test counts each bucket's groups, episodes and unmasked steps and its
group reward stds itself (numpy), writes the PPO component losses with ``torch.distributions`` and
the regularizers by hand (``weight_l2``'s gradient is the closed form ``2 w p``), takes gradients
with ``torch.autograd.grad`` on a fresh copy of the module, and fetches head parameters by module
attribute name.  That test calls none of ``component_gradients``, ``ppo_loss_from_batch``,
``signed_shares`` or ``head_parameter_groups``.
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

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.losses.ppo import ppo_loss_from_batch
from gradmon_ray.losses.regularizers import RegularizerSpec, resolve_regularizer
from gradmon_ray.probe.analysis import LossSettings, TooFewGroupsError, analyse_batch, episodes_from_batch
from gradmon_ray.probe.connectors import EPISODE_COLUMN, GROUP_ID_COLUMN
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch
from tests.probe.designed_batch import designed_module_and_batch, expected_buckets, flat, hand_written_losses

LOSS = LossSettings(
    clip_param=0.2, vf_clip_param=10.0, vf_loss_coeff=0.5, entropy_coeff=0.05, kl_coeff=0.3, use_kl_loss=True
)


def _designed_columns() -> dict[str, np.ndarray]:
    """40 rows, 4 episodes of 10 rows; see the worked answer in the tests below.

    ep0 rows 0-9 (group 5): 0.1 per step, row 9 is RLlib's masked extra step with reward 100 -> return 0.9
    ep1 rows 10-19 (group 5): 0.3 per step -> return 3.0            group 5: std([0.9, 3.0]) = 1.05
    ep2 rows 20-29 (no group): rewards 0,1,0,1,... -> alone, per-step std 0.5
    ep3 rows 30-39 (group 7): 2.0 per step -> alone, per-step std 0.0
    """
    rewards = np.concatenate([[0.1] * 9 + [100.0], [0.3] * 10, [0.0, 1.0] * 5, [2.0] * 10]).astype(np.float32)
    mask = np.ones(40, dtype=bool)
    mask[9] = False
    return {
        Columns.REWARDS: rewards,
        Columns.LOSS_MASK: mask,
        EPISODE_COLUMN: np.repeat(np.arange(4), 10),
        GROUP_ID_COLUMN: np.repeat([5, 5, -1, 7], 10),
    }


@pytest.fixture(scope="module")
def module_and_batch():
    cfg = config_from_dict(
        {"seed": 3, "ppo": {"train_batch_size": 64, "minibatch_size": 64}, "model": {"trunk_hiddens": [16]}}
    )
    learner = build_local_learner(cfg)
    real = train_batch(learner, sample_episodes(cfg, learner, 64)).policy_batches[DEFAULT_MODULE_ID]
    host = {k: tree.map_structure(lambda t: t.cpu().numpy()[:40], v) for k, v in real.items() if k != "weights_seq_no"}
    host.update(_designed_columns())
    return copy.deepcopy(learner.module[DEFAULT_MODULE_ID].unwrapped()), host


def test_episodes_from_batch_worked_answer():
    table = episodes_from_batch(_designed_columns())
    assert table.group_keys == [5, 5, ("episode", 2), 7]
    assert table.returns == pytest.approx([0.9, 3.0, 5.0, 20.0])  # the masked reward of 100 counts for nothing
    assert table.valid_steps == [9, 10, 10, 10]
    assert [r.tolist() for r in table.rows] == [list(range(10 * e, 10 * e + 10)) for e in range(4)]


def test_episodes_need_the_connector_columns():
    with pytest.raises(KeyError, match=r"gradmon_episode.*build_ppo_config"):
        episodes_from_batch({Columns.REWARDS: np.zeros(3)})


def test_analyse_batch_buckets_worked_answer(module_and_batch):
    module, batch = module_and_batch
    m = analyse_batch(module, batch, num_buckets=2, loss=LOSS)
    # group stds: {7: 0.0, ep2: 0.5, 5: 1.05}; 3 groups // 2 buckets = 1 each, remainder to bucket_2
    assert m[mn.PROBE_NUM_GROUPS_TOTAL] == 3 and m[mn.PROBE_NUM_BUCKETS] == 2
    b1, b2 = "bucket_1", "bucket_2"
    assert m[mn.probe_metric(mn.PROBE_NUM_GROUPS, b1)] == 1 and m[mn.probe_metric(mn.PROBE_NUM_GROUPS, b2)] == 2
    assert m[mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, b1)] == pytest.approx(0.0)
    assert m[mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, b2)] == pytest.approx((0.5 + 1.05) / 2)
    assert m[mn.probe_metric(mn.PROBE_NUM_EPISODES, b1)] == 1 and m[mn.probe_metric(mn.PROBE_NUM_EPISODES, b2)] == 3
    assert m[mn.probe_metric(mn.PROBE_NUM_STEPS, b1)] == 10 and m[mn.probe_metric(mn.PROBE_NUM_STEPS, b2)] == 29

    # bucket_2 is rows 0-29: its task gradient, taken independently on a fresh copy
    fresh = copy.deepcopy(module)
    rows = {k: tree.map_structure(lambda a: torch.as_tensor(a[:30]), v) for k, v in batch.items()}
    terms = ppo_loss_from_batch(fresh, rows, fresh.forward_train(rows), **vars(LOSS))
    params = [p for p in fresh.parameters() if p.requires_grad]
    grads = torch.autograd.grad(terms.policy, params, allow_unused=True)
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    task = m[mn.probe_metric(mn.PROBE_COMPONENT_NORM, b2, component="task")]
    assert task == pytest.approx(expected, rel=1e-5)
    assert m[mn.probe_metric(mn.PROBE_PER_SAMPLE_NORM, b2, component="task")] == pytest.approx(expected / 3)
    assert m[mn.probe_metric(mn.PROBE_PER_TOKEN_NORM, b2, component="task")] == pytest.approx(expected / 29)
    assert m[mn.probe_metric(mn.PROBE_LOSS, b2, loss="policy")] == pytest.approx(float(terms.policy.detach()), rel=1e-5)
    for bucket in (b1, b2):
        shares = [m[mn.probe_metric(mn.PROBE_SHARE, bucket, component=c)] for c in ("task", "entropy", "kl", "value")]
        assert sum(shares) == pytest.approx(1.0, abs=1e-6)
        assert m[mn.probe_metric(mn.PROBE_HEAD_NORM, bucket, head="value", component="task")] == 0.0
        assert m[mn.probe_metric(mn.PROBE_HEAD_NORM, bucket, head="op", component="task")] > 0.0
        assert -1.0 <= m[mn.probe_metric(mn.PROBE_COSINE, bucket, pair="task_vs_entropy")] <= 1.0


def test_analyse_batch_without_kl_loss_has_no_kl_component(module_and_batch):
    module, batch = module_and_batch
    m = analyse_batch(module, batch, num_buckets=1, loss=LossSettings(**{**vars(LOSS), "use_kl_loss": False}))
    assert mn.probe_metric(mn.PROBE_COMPONENT_NORM, "bucket_1", component="task") in m
    assert not any(k.endswith("/kl") or "kl_vs" in k or "_vs_kl" in k for k in m if "/loss/" not in k)


def test_analyse_batch_too_few_groups(module_and_batch):
    module, batch = module_and_batch
    with pytest.raises(TooFewGroupsError, match="3 groups for 4 buckets"):
        analyse_batch(module, batch, num_buckets=4, loss=LOSS)


def test_analyse_batch_regularizers_and_a_broken_one(module_and_batch):
    module, batch = module_and_batch

    def broken(m, b, f):
        raise RuntimeError("nope")

    specs = [resolve_regularizer("logit_l2", weight=0.5), RegularizerSpec("broken", broken)]
    with pytest.warns(UserWarning, match="'broken'"):
        m = analyse_batch(module, batch, num_buckets=2, loss=LOSS, regularizers=specs)
    for bucket in ("bucket_1", "bucket_2"):
        assert m[mn.probe_metric(mn.PROBE_REGULARIZER_ERROR, bucket, regularizer="broken")] == 1.0
        assert m[mn.probe_metric(mn.PROBE_REGULARIZER_ERROR, bucket, regularizer="logit_l2")] == 0.0
        norm = m[mn.probe_metric(mn.PROBE_REGULARIZER_GRAD_NORM, bucket, regularizer="logit_l2")]
        assert norm > 0 and m[mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component="logit_l2")] == norm
        assert m[mn.probe_metric(mn.PROBE_REGULARIZER_SHARE, bucket, regularizer="logit_l2")] == pytest.approx(1.0)
        assert m[mn.probe_metric(mn.PROBE_REGULARIZER_TOTAL, bucket)] == pytest.approx(norm)
        # everything else is still there
        assert m[mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component="task")] > 0


# --- every bucket metric by name, on the designed batch ------------------------------------------

WEIGHTS = {"wl2": 0.01, "logits": 0.5}


@pytest.fixture(scope="module")
def designed():
    return designed_module_and_batch()


def _hand_written_losses(module, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weighted components and regularizers as they enter the loss, unweighted terms as RLlib logs them)."""
    weighted, terms, logits, mask = hand_written_losses(module, batch, LOSS)
    regs = {
        "wl2": WEIGHTS["wl2"] * sum(p.pow(2).sum() for p in module.parameters()),
        "logits": WEIGHTS["logits"] * (logits.pow(2).mean(-1) * mask).sum() / mask.sum(),
    }
    return {**weighted, **regs}, terms


def test_every_bucket_metric_by_name_equals_an_independent_recomputation(designed):
    module, batch = designed
    specs = [
        resolve_regularizer("wl2", "weight_l2", weight=WEIGHTS["wl2"]),
        resolve_regularizer("logits", "logit_l2", weight=WEIGHTS["logits"]),
    ]
    m = analyse_batch(module, batch, num_buckets=2, loss=LOSS, regularizers=specs)
    buckets = expected_buckets(batch)
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
        np.testing.assert_allclose(flat(grads["wl2"]), flat([2 * WEIGHTS["wl2"] * p for p in params]), rtol=1e-6)
        flats = {c: flat(g) for c, g in grads.items()}

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
