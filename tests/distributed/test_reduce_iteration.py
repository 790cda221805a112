"""``reduce_iteration`` / ``reduce_modules`` with one learner (nothing reduced): every segment comes
back where it went in, through the one packed host copy.

Oracle: the values set here by hand (checksum digits, noise lanes, local values, head-health
lanes) and the lanes ``IterationAccumulator.drain`` gives for the same records (drain packs its
own copy; ``reduce_modules`` packs every segment with one ``cat`` and splits the health blocks per
module).  Bugs these catch: a segment read from the wrong offset, a health block split unevenly or
given to the wrong module, the single-module wrapper out of step with ``ModuleLanes``.
"""

from __future__ import annotations

import numpy as np
import torch

from gradmon_ray.distributed import LearnerCollective, reduce_iteration
from gradmon_ray.distributed.collective import ModuleLanes, reduce_modules
from gradmon_ray.telemetry import GradientNorms, IterationAccumulator
from gradmon_ray.telemetry.lane_layout import TelemetryLayout

LAYOUT = TelemetryLayout(num_reported=3, num_action_heads=2)


def _alone() -> LearnerCollective:
    return LearnerCollective("alone", 1, 0, "gloo", torch.device("cpu"))


def _fed(accumulator: IterationAccumulator) -> IterationAccumulator:
    for k in range(3):
        norms = GradientNorms(
            torch.tensor([1.0 + k, 2.0, float("nan")]), torch.tensor(3.0 + k), torch.tensor(float(k)), torch.tensor(0.0)
        )
        accumulator.add_minibatch(norms, torch.tensor([0.0, float(k == 2)]), torch.zeros(2), torch.tensor(float(k > 0)))
    return accumulator


def test_one_module_gets_back_its_lanes_noise_health_local_and_checksum():
    checksum = torch.tensor([7.0, -1.5], dtype=torch.float64)
    noise, local, health = torch.tensor([0.25, 4.0]), torch.tensor([9.0]), torch.tensor([0.5, 0.75, 1.0, 1.0])
    reduced = reduce_iteration(
        _fed(IterationAccumulator(LAYOUT)), _alone(), checksum=checksum, noise=noise, local=local, health=health
    )
    want_lanes, _, _ = _fed(IterationAccumulator(LAYOUT)).drain()
    np.testing.assert_array_equal(reduced.lanes, want_lanes)
    np.testing.assert_array_equal(reduced.checksum, [7.0, -1.5])
    np.testing.assert_array_equal(reduced.own_checksum, [7.0, -1.5])
    np.testing.assert_array_equal(reduced.noise, [0.25, 4.0])
    np.testing.assert_array_equal(reduced.local, [9.0])
    np.testing.assert_array_equal(reduced.health, [0.5, 0.75, 1.0, 1.0])


def test_health_blocks_are_split_per_module_out_of_module_order():
    layouts = [TelemetryLayout(1, 1), TelemetryLayout(2, 1), TelemetryLayout(1, 1)]
    lanes = torch.arange(sum(lay.size for lay in layouts), dtype=torch.float64)
    parts = [ModuleLanes(lay, torch.full((2,), float(k)), torch.full((k,), 10.0 + k)) for k, lay in enumerate(layouts)]
    blocks = [([2, 0], torch.tensor([20.0, 21.0, 22.0, 23.0, 0.0, 1.0, 2.0, 3.0])), ([1], torch.tensor([5.0] * 4))]
    reduced = reduce_modules(lanes, parts, _alone(), checksum=torch.zeros(2, dtype=torch.float64), health=blocks)
    np.testing.assert_array_equal(reduced[2].health, [20.0, 21.0, 22.0, 23.0])
    np.testing.assert_array_equal(reduced[0].health, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(reduced[1].health, [5.0] * 4)
    offsets = np.cumsum([0, *(lay.size for lay in layouts)])
    for k in range(len(layouts)):
        np.testing.assert_array_equal(reduced[k].lanes, np.arange(offsets[k], offsets[k + 1]), err_msg=str(k))
        np.testing.assert_array_equal(reduced[k].noise, [float(k)] * 2)
        np.testing.assert_array_equal(reduced[k].local, [10.0 + k] * k)
