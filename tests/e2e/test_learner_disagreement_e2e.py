"""ray-project/ray#63819 on gloo: two RLlib learners whose shards hold different modules, stock
and under gradmon, in two real processes of one gloo world (``tests/distributed/two_ranks.py``:
RLlib's own DDP wrapping and gradmon's average run as in a learner actor; no Ray cluster).

- Stock RLlib (``PPOTorchLearner``, 2 learners, MultiAgentCartPole's ``p0``/``p1``, ``p1`` on
  learner 0's shard only): learner 0 joins ``p1``'s DDP all-reduce, which learner 1 never runs, and
  makes no progress (the issue's NCCL desync; torch's own timeout in RLlib is 30 minutes).
- gradmon's learners on the same kind of shards train through it, replicas identical.
- Learners that disagree on their modules stop, both, with one line: the same modules added in
  another order on each; a module removed from learner 0 only; a module added to learner 0
  only (RLlib's DDP wrapping of it is a collective the other never joins: the deadline names it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import pytest

from tests.distributed.two_ranks import STATE, TwoRanks

pytestmark = pytest.mark.e2e

PATIENCE_S = 2.0
"""How long stock RLlib's update may make no progress before the test calls it hung: twice what one
takes here (~1 s); the wait is the demonstration (RLlib's own timeout is 30 minutes)."""
GRADMON_PATIENCE_S = 60.0
"""gradmon's updates: its deadlines (``TIMEOUT_S``) end a hang with an error first, so this only
stops a broken build from stalling the job (a loaded box's update is not called a hang)."""
TIMEOUT_S = 2.0
"""gradmon's ``collective_timeout_s`` in these learners."""


def _build(rank: int, arm: str, agents: int) -> list[str]:
    """A learner of a 2-learner PPO config on MultiAgentCartPole (``agents`` policies ``p0``...),
    and a train batch sampled with its weights; kept in ``STATE``."""
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

    from gradmon_ray.rllib import with_gradmon
    from tests.peer.pairs import HEADS, cartpole_config, sample_batch, spaces_of

    # reduce_telemetry off: the telemetry's Ray collective group needs a Ray actor (tests/e2e has them)
    gradmon = {"heads": HEADS, "reduce_telemetry": False, "collective_timeout_s": TIMEOUT_S}
    learner_class = PPOTorchLearner if arm == "stock" else with_gradmon(PPOTorchLearner)
    config = cartpole_config("ppo", learner_class, agents=agents, gradmon=gradmon if arm == "gradmon" else None)
    config.learners(num_learners=2)
    learner = config.build_learner(spaces=spaces_of(config))
    STATE.update(learner=learner, batch=sample_batch(config, learner, 128))
    return sorted(STATE["batch"].policy_batches)


def _digests() -> dict[str, str]:
    learner = STATE["learner"]
    out = {}
    for mid in learner.module.keys():  # noqa: SIM118
        digest = hashlib.sha256()
        for p in learner.module[mid].unwrapped().parameters():
            digest.update(p.detach().numpy().tobytes())
        out[mid] = digest.hexdigest()
    return out


def _update(rank: int, drop: tuple[str, ...], patience_s: float = GRADMON_PATIENCE_S) -> tuple[str, Any]:
    """One update on this learner's batch less the modules in ``drop`` (rows its shard does not
    hold), in a helper thread: ("ok", weights digests), (error type, its message), or ("hung", ...)
    when it made no progress within ``patience_s``."""
    from ray.rllib.policy.sample_batch import MultiAgentBatch

    batch = STATE["batch"]
    shard = MultiAgentBatch({m: b for m, b in batch.policy_batches.items() if m not in drop}, batch.env_steps())
    outcome: list[tuple[str, Any]] = []

    def update() -> None:
        try:
            STATE["learner"].update(batch=shard, timesteps={}, num_epochs=1, minibatch_size=4096)
            outcome.append(("ok", _digests()))
        except Exception as exc:
            outcome.append((type(exc).__name__, str(exc)))

    worker = threading.Thread(target=update, daemon=True)
    worker.start()
    worker.join(patience_s)
    return outcome[0] if outcome else ("hung", f"no progress within {patience_s:g} s")


def _add(rank: int, module_ids: list[str]) -> tuple[str, Any]:
    """``add_module`` of each of ``module_ids`` (copies of ``p0``'s spec) on this learner, in order."""
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    learner = STATE["learner"]
    start = time.monotonic()
    try:
        for mid in module_ids:
            learner.add_module(module_id=mid, module_spec=RLModuleSpec.from_module(learner.module["p0"].unwrapped()))
    except Exception as exc:
        return (type(exc).__name__, (str(exc), time.monotonic() - start))
    return ("ok", list(learner.module.keys()))


def _remove(rank: int, module_ids: list[str]) -> list[str]:
    for mid in module_ids:
        STATE["learner"].remove_module(mid)
    return sorted(STATE["learner"].module.keys())


@pytest.fixture(scope="module")
def ranks():
    pair = TwoRanks(preload=["ray.rllib.algorithms.ppo"], timeout=120.0)
    yield pair
    pair.close()


def test_stock_rllib_hangs_on_a_module_one_learners_shard_lacks(ranks):
    """ray-project/ray#63819 on gloo: ``p1`` is on learner 0's shard only."""
    assert ranks.run(_build, ("stock", 2), ("stock", 2)) == [["p0", "p1"]] * 2
    try:
        outcomes = ranks.run(_update, ((), PATIENCE_S), (("p1",), PATIENCE_S))
    finally:
        ranks.close()  # a rank is stuck in DDP's all-reduce: the next test gets fresh processes
    assert ("hung", f"no progress within {PATIENCE_S:g} s") in outcomes, outcomes


def test_gradmon_trains_through_and_learners_that_disagree_stop_with_one_line(ranks):
    """One gradmon build, then in turn: sparse shards (train through); the same two modules added
    in another order on each learner; a module removed from learner 0 only; a module added to
    learner 0 only.  ``p2`` is in no shard (no agent plays it): never trained, never an error."""
    assert ranks.run(_build, ("gradmon", 3), ("gradmon", 3)) == [["p0", "p1", "p2"]] * 2
    (ok0, after0), (ok1, after1) = ranks.run(_update, (("p2",),), (("p1", "p2"),))
    assert ok0 == ok1 == "ok", (after0, after1)
    assert after0 == after1, "the replicas hold identical weights, module by module"

    orders = ranks.run(_add, (["p3", "p4"],), (["p4", "p3"],))
    assert [order[1][-2:] for order in orders] == [["p3", "p4"], ["p4", "p3"]]
    (kind0, line0), (kind1, line1) = ranks.run(_update, (("p2", "p3", "p4"),), (("p2", "p3", "p4"),))
    assert kind0 == kind1 == "LearnerDisagreementError", (line0, line1)
    assert "learner 1 has the same 5 modules in another order, or other shapes (5 modules, 60 parameter" in line0
    assert line0.endswith("modules added in different orders or with different specs") and kind1 == kind0

    ranks.run(_remove, (["p3", "p4"],), (["p3", "p4"],))  # agreed again
    assert ranks.run(_remove, (["p2"],), ([],)) == [["p0", "p1"], ["p0", "p1", "p2"]]
    (kind0, line0), (kind1, line1) = ranks.run(_update, (("p2",),), (("p2",),))
    assert kind0 == kind1 == "LearnerDisagreementError", (line0, line1)
    assert "update 3: learner 1 has 1 module not on learner 0 (3 modules, 36 parameter tensors); learner 0" in line0
    assert "learner 0 lacks ['p2'] (2 modules, 24 parameter tensors); learner 1 (this one): 3 modules" in line1
    for line in (line0, line1):
        assert "\n" not in line and line.endswith("(Algorithm.add_module/remove_module reach all)")

    try:
        (kind0, (line0, took)), (kind1, _) = ranks.run(_add, (["p5"],), ([],))
    finally:
        ranks.close()  # learner 0 is still in the DDP constructor's collective
    assert kind0 == "CollectiveTimeoutError" and kind1 == "ok", line0
    assert TIMEOUT_S <= took < TIMEOUT_S + 3
    assert line0.startswith(
        f"gradmon: learner 0 of 2 waited {TIMEOUT_S:g} s (learner_config_dict['gradmon']['collective_timeout_s']) "
        "for add_module('p5') to reach every learner (RLlib's DDP wrapping of the module is a collective)"
    )
