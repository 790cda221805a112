"""Probe cadence in a real learner, in-process: with ``every = N`` the learner hands a probe
request over on iterations N, 2N, 3N (not N-1), carrying the weights the update started from."""

from __future__ import annotations

import numpy as np
from ray.rllib.core import DEFAULT_MODULE_ID

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.probe import ProbeClient
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update

EVERY = 2


def test_due_is_every_nth_one_based_iteration():
    client = ProbeClient("unused", every=3)
    assert [i for i in range(1, 10) if client.due(i)] == [3, 6, 9]
    assert [i for i in range(1, 4) if ProbeClient("unused", every=1).due(i)] == [1, 2, 3]


def test_learner_probes_iterations_n_2n_3n_with_the_pre_update_weights():
    cfg = config_from_dict(
        {
            "seed": 4,
            "ppo": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
            "model": {"trunk_hiddens": [16]},
            "probe": {"gradient_analysis_every": EVERY, "num_buckets": 2},
        }
    )
    learner = build_local_learner(cfg)
    # A recording client: the learner's hand-off is what is tested, no probe actor is needed.
    sent = []
    learner._probe.submit = sent.append
    module = learner.module[DEFAULT_MODULE_ID].unwrapped()
    probed = []
    for iteration in range(1, 3 * EVERY + 1):
        before = {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}
        batch = train_batch(learner, sample_episodes(cfg, learner, 128))
        update(learner, batch, cfg)
        after = {k: v.detach().numpy() for k, v in module.state_dict().items()}
        assert any(not np.array_equal(before[k], after[k]) for k in after), "the update changed nothing"
        if len(sent) == len(probed):
            continue
        (request,) = sent[len(probed) :]
        probed.append(iteration)
        assert request.iteration == iteration
        (part,) = request.modules
        assert part.weights.keys() == before.keys()
        for key, value in before.items():  # exactly the weights the update started from ...
            np.testing.assert_array_equal(part.weights[key], value, err_msg=f"iteration {iteration}: {key}")
        # ... not the weights it produced
        assert any(not np.array_equal(part.weights[k], after[k]) for k in after), iteration
    assert probed == [EVERY, 2 * EVERY, 3 * EVERY]
    assert learner._probe.counters[mn.PROBE_REQUESTS_DROPPED] == 0
