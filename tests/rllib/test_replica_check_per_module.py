"""The replica check per module, in-process: each module's checksum (recomputed here in exact Python
integers) rides in the one reduction, every module reads its own ``update/replica_checksum_ok``,
and a twin learner whose copy of ONE module differs stops the run naming that module only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray import metric_names as mn
from gradmon_ray.distributed import ReplicaDivergenceError
from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import cartpole_config, sample_batch, spaces_of
from tests.rllib.test_monitor_step import _python_checksum

MODULES = ("p0", "p1", "p2")


class _Twin:
    """A 2-learner collective whose other replica is identical (SUM = 2x), except that its copy of
    module ``diverged`` (an index) is one off in its checksum's low digit."""

    world_size, rank, active, backend = 2, 0, True, "gloo"

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []
        self.diverged: int | None = None

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.seen.append(tensor.detach().double().numpy().copy())
        tensor.mul_(2)
        if self.diverged is not None:
            tensor[2 * self.diverged + 1] += 1  # the checksum digits lead the packed buffer
        return tensor

    def destroy(self) -> None:
        pass


@pytest.fixture(scope="module")
def three_modules():
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=3, gradmon={"replica_check_every": 1})
    learner = config.build_learner(spaces=spaces_of(config))
    batch = sample_batch(config, learner, num_timesteps=96)
    yield learner, batch
    learner.shutdown()


def test_each_module_checksum_rides_the_reduction_and_reads_its_own_verdict(three_modules):
    learner, batch = three_modules
    learner._collective = twin = _Twin()
    results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
    params = {mid: [p for p in learner.module[mid].unwrapped().parameters() if p.requires_grad] for mid in MODULES}
    digits = [d for mid in learner.gradmon_modules for d in _python_checksum(params[mid])]
    assert list(twin.seen[-1][: len(digits)]) == digits, "one checksum per module, in module order"
    assert len(set(digits[1::2])) == 3, "three modules, three different checksums"
    for mid in MODULES:
        assert float(results[mid][mn.REPLICA_CHECKSUM_OK].peek()) == 1.0, mid


def test_a_replica_that_differs_in_one_module_stops_the_run_naming_that_module(three_modules):
    learner, batch = three_modules
    learner._collective = twin = _Twin()
    order = list(learner.gradmon_modules)
    twin.diverged = order.index("p1")
    with pytest.raises(ReplicaDivergenceError, match=r"module\(s\) \['p1'\] after"):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
