"""Audit oracles for the learner: loss-masked rows and latches, the replica-check cadence, and
the probe's iteration count across a checkpoint restore.

Expected values come from constructions (a -inf logit on chosen rows), the replica checksum
recomputed here in exact integers, and the test's own iteration counter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.distributed import ReplicaDivergenceError
from gradmon_ray.rllib.learner import PROBE_STATE_KEY, TELEMETRY_STATE_KEY
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch

MID = DEFAULT_MODULE_ID


def _cfg(**over):
    data = {
        "seed": 11,
        "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 1},
        "model": {"trunk_hiddens": [16, 16]},
    }
    data.update(over)
    return config_from_dict(data)


@pytest.fixture(scope="module")
def batch():
    cfg = _cfg()
    learner = build_local_learner(cfg)
    return train_batch(learner, sample_episodes(cfg, learner, 256))


def test_probe_iteration_count_survives_a_checkpoint_restore(batch):
    """The learner's own iteration count (what probe requests are numbered and scheduled by)
    continues across ``get_state`` / ``set_state``: the test counts 2, then 3."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    for _ in range(2):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    state = learner.get_state(components=[PROBE_STATE_KEY, TELEMETRY_STATE_KEY])
    assert state[PROBE_STATE_KEY]["iterations_done"] == 2
    restored = build_local_learner(cfg)
    restored.set_state(state)
    assert restored.get_state(components=[PROBE_STATE_KEY])[PROBE_STATE_KEY]["iterations_done"] == 2
    restored.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    assert restored.get_state(components=[PROBE_STATE_KEY])[PROBE_STATE_KEY]["iterations_done"] == 3
    assert restored.last_telemetry.iteration == 3


def test_a_minus_inf_log_prob_on_a_loss_masked_row_never_latches(batch):
    """RLlib's bootstrap rows are loss-masked.  A -inf logit on the taken ``slot`` action of
    masked rows only must not latch (and costs no gradient); on one valid row it must."""
    cfg = _cfg()
    learner = build_local_learner(cfg)
    module = learner.module[MID].unwrapped()
    space = module.action_space  # a Dict of Discrete heads: logits are concatenated in sorted-key order
    names = sorted(space.spaces)
    start = sum(space[h].n for h in names[: names.index("slot")])
    original = module.forward_train
    target = {"rows": "masked"}

    def forward_train(b, **kw):
        out = dict(original(b, **kw))
        logits = out[Columns.ACTION_DIST_INPUTS]
        mask = b[Columns.LOSS_MASK].bool()
        rows = ~mask if target["rows"] == "masked" else (mask & (mask.cumsum(0) == 1))
        col = start + b[Columns.ACTIONS]["slot"].long()
        hit = torch.zeros_like(logits, dtype=torch.bool)
        hit[torch.arange(logits.shape[0]), col] = True
        out[Columns.ACTION_DIST_INPUTS] = torch.where(hit & rows.unsqueeze(-1), float("-inf"), logits)
        return out

    module.forward_train = forward_train
    mask = np.asarray(batch.policy_batches[MID][Columns.LOSS_MASK], dtype=bool)
    assert (~mask).sum() > 0 and mask.sum() > 0  # the batch has masked (bootstrap) rows

    def logged():
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        return {k: float(v.peek()) for k, v in results[MID].items() if isinstance(k, str) and "/" in k}

    first = logged()
    assert first[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] == 0.0
    assert first[mn.head_metric(mn.HEAD_NAN_LATCH, "slot")] == 0.0
    assert first[mn.SKIPPED_UPDATES] == 0.0 and first[mn.INF_GRAD_COUNT] == 0.0 and first[mn.NAN_GRAD_COUNT] == 0.0
    target["rows"] = "one valid row"
    second = logged()
    assert second[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] == 1.0
    assert second[mn.head_metric(mn.HEAD_INF_LATCH_FIRST_ITERATION, "slot")] == 2.0
    assert all(second[mn.head_metric(mn.HEAD_INF_LATCH, h)] == 0.0 for h in names if h != "slot")


def _python_checksum(params) -> tuple[float, float]:
    """The replica checksum in exact integers: sum_i bits_i * ((i * 2654435761 + 1) | 1) mod 2^48."""
    bits = np.concatenate([p.detach().float().numpy().reshape(-1) for p in params]).view(np.int32)
    total = sum(int(b) * ((i * 2654435761 + 1) | 1) for i, b in enumerate(bits.tolist())) % (1 << 48)
    return float(total >> 24), float(total & ((1 << 24) - 1))


def _pair_at(values: np.ndarray, pair: tuple[float, float]) -> list[int]:
    return [i for i in range(len(values) - 1) if (values[i], values[i + 1]) == pair]


class _TwinReplicaCollective:
    """Stands in for a 2-learner collective whose other replica is bitwise identical: the
    SUM all-reduce of identical inputs is 2x this learner's own tensor.  ``perturb`` (a digit
    pair) makes the twin's checksum differ by one in its low digit."""

    world_size, rank, active, backend = 2, 0, True, "gloo"

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []
        self.perturb: tuple[float, float] | None = None

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        own = tensor.detach().double().numpy().copy()
        self.seen.append(own)
        tensor.mul_(2)
        if self.perturb is not None:
            (at,) = _pair_at(own, self.perturb)
            tensor[at + 1] += 1
        return tensor

    def destroy(self) -> None:
        pass


def test_replica_check_runs_every_nth_iteration_and_a_diverged_twin_stops_the_run(batch):
    """``replica_check_every: 2``: this learner's parameter checksum (exact integers, computed
    here) rides in the reduction at iterations 2 and 4 only (the test's own counter); an
    identical twin reads 1, a twin one off in the checksum raises ``ReplicaDivergenceError``."""
    cfg = _cfg(distributed={"replica_check_every": 2})
    learner = build_local_learner(cfg)
    params = [p for p in learner.module[MID].unwrapped().parameters() if p.requires_grad]
    learner._collective = twin = _TwinReplicaCollective()
    for iteration in range(1, 5):
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        logged = {k: float(v.peek()) for k, v in results[MID].items() if isinstance(k, str) and "/" in k}
        assert len(twin.seen) == iteration  # one reduction per iteration
        digits = _python_checksum(params)
        assert bool(_pair_at(twin.seen[-1], digits)) == (iteration % 2 == 0), iteration
        assert logged[mn.MINIBATCH_UPDATES] == 1.0 and logged[mn.SKIPPED_UPDATES] == 0.0  # not 2x
        assert logged[mn.TELEMETRY_ITERATION] == iteration
        if iteration % 2 == 0:
            assert logged[mn.REPLICA_CHECKSUM_OK] == 1.0, iteration
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)  # 5: no check
    # iteration 6 is a check: the twin's checksum is one off
    original = twin.allreduce_sum

    def perturbing(tensor: torch.Tensor) -> torch.Tensor:
        twin.perturb = _python_checksum(params)
        return original(tensor)

    twin.allreduce_sum = perturbing
    with pytest.raises(ReplicaDivergenceError):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
