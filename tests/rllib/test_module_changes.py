"""``rllib/module_changes.py``: modules that join or leave mid-step (leagues, self-play snapshots), in-process.

``with_gradmon(PPOTorchLearner)`` on two-agent CartPole with ``report_every: 2`` (the IMPALA family's
cadence: one telemetry step spans two ``update`` calls), one minibatch an update, no KL loss and no
clipping.  The oracle of each module's global norm in each update is autograd of the STOCK learner's
loss on that update's batch at the weights of the moment (``stock_oracle``); the step reports the mean
over the minibatches it trained, and the number of those minibatches.  One observation of p1 in the
first update is NaN: p1's ``policy`` log-prob latch fires in step 1 (a construction whose answer is
known), and p1 has no rows in the update after the change.

Bugs these catch: ``add_module``/``remove_module`` dropping the step's pending norm records of every
module (a module trained only before the change is then not reported at all: its counts, norms and
latches of the step are gone; one trained before and after reports only the later minibatch), the
removed module's records kept in another module's place, the new module credited with minibatches
from before it existed.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch

from gradmon_ray import metric_names as mn
from gradmon_ray.head_labels import POLICY_LATCH
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.telemetry.blame import RESULT_KEY
from tests.peer.pairs import HEADS, build_pair, cartpole_config, sample_batch
from tests.rllib.stock_oracle import stock_head_norms
from tests.rllib.test_module_sync import _spec_like

TRAINING = {"grad_clip": None, "use_kl_loss": False}


def _only(batch: MultiAgentBatch, *mids: str) -> MultiAgentBatch:
    return MultiAgentBatch({m: batch.policy_batches[m] for m in mids}, batch.env_steps())


def _oracle_then_update(stock: Any, learner: Any, batch: MultiAgentBatch) -> tuple[dict[str, float], dict]:
    """Each module's stock global norm at the learner's weights of the moment, then the learner's update."""
    norms = {}
    for mid in batch.policy_batches:
        stock.module[mid].set_state(learner.module[mid].unwrapped().get_state())
        norms[mid] = stock_head_norms(stock, batch, mid, {"all": ""})["all"]
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    logged = {
        mid: {k: float(v.peek()) for k, v in res.items() if hasattr(v, "peek") and k != RESULT_KEY}
        for mid, res in results.items()
    }
    return norms, logged


def _check(logged: dict, mid: str, norms: list[float]) -> None:
    assert logged[mid][mn.MINIBATCH_UPDATES] == float(len(norms)), mid
    assert logged[mid][mn.GLOBAL_GRAD_NORM] == pytest.approx(sum(norms) / len(norms), rel=1e-4), mid


def test_add_and_remove_keep_the_other_modules_pending_records_of_the_step():
    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=2, training=TRAINING)
    gradmon = {"heads": HEADS, "report_every": 2}
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon=gradmon, training=TRAINING)
    stock, learner = build_pair(stock_config, config)
    try:
        batch = sample_batch(stock_config, stock, num_timesteps=128)
        # Step 1: p0 and p1 train, then p2 joins; the second update trains p0 and p2 (p1 has no rows).
        poisoned = copy.deepcopy(batch)
        poisoned.policy_batches["p1"][Columns.OBS][0] = float("nan")  # row 0 starts an episode: in the loss
        first, logged = _oracle_then_update(stock, learner, poisoned)
        assert not any(mn.GLOBAL_GRAD_NORM in values for values in logged.values())  # mid-step: nothing yet
        for owner in (stock, learner):
            owner.add_module(module_id="p2", module_spec=_spec_like(learner, "p0"))
        three = MultiAgentBatch({**batch.policy_batches, "p2": batch.policy_batches["p0"]}, batch.env_steps())
        second, logged = _oracle_then_update(stock, learner, _only(three, "p0", "p2"))
        _check(logged, "p0", [first["p0"], second["p0"]])
        assert logged["p1"][mn.MINIBATCH_UPDATES] == 1.0  # trained only before the change: still its step
        _check(logged, "p2", [second["p2"]])  # none of p0's or p1's minibatches from before it existed
        assert logged["p1"][mn.head_metric(mn.HEAD_NAN_LATCH, POLICY_LATCH)] == 1.0  # its NaN row of the 1st update
        assert logged["p1"][mn.head_metric(mn.HEAD_NAN_LATCH_FIRST_ITERATION, POLICY_LATCH)] == 1.0
        assert logged["p1"][mn.NAN_GRAD_COUNT] > 0 and logged["p0"][mn.NAN_GRAD_COUNT] == 0.0
        # Step 2: all three train, then p0 leaves; the second update trains p1 and p2.
        third, _ = _oracle_then_update(stock, learner, three)
        for owner in (stock, learner):
            owner.remove_module("p0")
        fourth, logged = _oracle_then_update(stock, learner, _only(three, "p1", "p2"))
        assert "p0" not in logged
        _check(logged, "p1", [third["p1"], fourth["p1"]])
        _check(logged, "p2", [third["p2"], fourth["p2"]])
        assert math.isnan(first["p1"]) and all(math.isfinite(v) for v in (*second.values(), *third.values()))
    finally:
        stock.shutdown()
        learner.shutdown()


def test_a_league_module_named_by_a_pattern_is_monitored_from_its_first_update_with_its_own_settings(caplog):
    """``modules: [p0, league_*, agnet_9]`` and a ``per_module`` entry for ``league_1``, neither of which
    the learner has at build (a league adds its modules later; ``agnet_9`` is a typo): the build takes
    them.  ``league_1``, added after the first update, reports from its first update, at the learner's
    clock, with its own heads (``actor``/``critic``), their norms autograd's of the stock loss;
    ``other``, added too, is not monitored; one log line, once, names what matched no module yet."""
    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=2, training=TRAINING)
    gradmon = {
        "heads": HEADS,
        "modules": ["p0", "league_*", "agnet_9"],
        "per_module": {"league_1": {"heads": {"actor": r"^pi\.", "critic": r"^vf\."}}},
    }
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon=gradmon, training=TRAINING)
    stock, learner = build_pair(stock_config, config)
    try:
        batch = sample_batch(stock_config, stock, num_timesteps=128)
        with caplog.at_level("WARNING"):
            _, logged = _oracle_then_update(stock, learner, batch)
            assert sorted(learner.gradmon_modules) == ["p0"] and mn.GLOBAL_GRAD_NORM not in logged["p1"]
            for mid in ("league_1", "other"):
                for owner in (stock, learner):
                    owner.add_module(module_id=mid, module_spec=_spec_like(learner, "p0"))
            league = MultiAgentBatch(
                {
                    "p0": batch.policy_batches["p0"],
                    "league_1": batch.policy_batches["p1"],
                    "other": batch.policy_batches["p1"],
                },
                batch.env_steps(),
            )
            for mid in ("league_1", "other"):
                stock.module[mid].set_state(learner.module[mid].unwrapped().get_state())
            expected = stock_head_norms(stock, league, "league_1", {"actor": "pi.", "critic": "vf."})
            _, logged = _oracle_then_update(stock, learner, league)
        assert sorted(learner.gradmon_modules) == ["league_1", "p0"]
        assert logged["league_1"][mn.TELEMETRY_ITERATION] == 2.0 == logged["p0"][mn.TELEMETRY_ITERATION]
        for head, norm in expected.items():
            assert logged["league_1"][mn.head_metric(mn.HEAD_GRAD_NORM, head)] == pytest.approx(norm, rel=1e-4), head
        assert not [k for k in logged["other"] if k.startswith(("grad/", "latch/"))], "other is not monitored"
    finally:
        stock.shutdown()
        learner.shutdown()
    notes = [r.getMessage() for r in caplog.records if "matching no module" in r.getMessage()]
    assert notes == [
        "gradmon: learner_config_dict['gradmon']['modules'] names ['league_*', 'agnet_9']; "
        "learner_config_dict['gradmon']['per_module'] names ['league_1'], matching no module this learner has "
        "had (['p0', 'p1']); a module added later under such an id is monitored from its first update, a typo never is"
    ]
