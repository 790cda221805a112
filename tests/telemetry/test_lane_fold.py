"""``LaneFold``: every module's lanes of a step from the learner's records of all modules at once.

Oracle: numpy, lane by lane, through each module's own ``TelemetryLayout`` offsets (not the fold's
concatenation order): NaN-free sums and counts of that module's head and global norms, its
NaN/Inf/skip totals, the minibatches that trained it, and its own log-prob flags.  Three modules
with different head and latch counts, so a lane taken from the wrong module or block shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradmon_ray.telemetry.lane_fold import LaneFold
from gradmon_ray.telemetry.lane_layout import TelemetryLayout
from gradmon_ray.telemetry.norm_records import StackedNorms

LAYOUTS = [TelemetryLayout(2, 1), TelemetryLayout(4, 3), TelemetryLayout(3, 2)]


def _records(minibatches: int = 4) -> tuple[StackedNorms, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(7)
    heads, m = sum(lay.num_reported for lay in LAYOUTS), len(LAYOUTS)
    head_norms = torch.rand(minibatches, heads, generator=gen, dtype=torch.float64) + 0.5
    head_norms[1, 3] = float("nan")  # module 1's first head had no gradient in minibatch 1
    head_norms[2, 8] = float("inf")  # module 2's last head: Inf is kept in the sums
    scalars = torch.zeros(4, minibatches, m, dtype=torch.float64)
    scalars[0] = torch.rand(minibatches, m, generator=gen, dtype=torch.float64) + 1.0
    scalars[0, 3, 0] = float("nan")  # module 0 not trained in minibatch 3 (no NaN/Inf elements)
    scalars[0, 2, 2] = float("nan")  # module 2's global norm NaN with NaN elements: trained
    scalars[1, 2, 2], scalars[2, 2, 2], scalars[3, 2, 2] = 5.0, 2.0, 1.0
    scalars[2, 0, 1], scalars[3, 0, 1] = 3.0, 1.0  # module 1: Inf elements in minibatch 0
    flags = [
        (torch.tensor([False]), torch.tensor([True])),
        (torch.tensor([False, True, False]), torch.tensor([False, False, False])),
        (torch.tensor([True, False]), torch.tensor([False, True])),
    ]
    values = torch.cat([head_norms, scalars[0]], dim=1)
    return StackedNorms(values, scalars[1:], scalars[1] + scalars[2] > 0, heads), flags


def _oracle(norms: StackedNorms, flags: list[tuple[torch.Tensor, torch.Tensor]]) -> list[np.ndarray]:
    heads, scalars = norms.head_norms.numpy(), norms.scalars.numpy()
    out, offset = [], 0
    for k, lay in enumerate(LAYOUTS):
        own = np.concatenate([heads[:, offset : offset + lay.num_reported], scalars[0][:, k : k + 1]], axis=1)
        offset += lay.num_reported
        lanes = np.zeros(lay.size)
        known = ~np.isnan(own)
        sums = np.where(known, own, 0.0).sum(0)
        lanes[lay.norm_sum], lanes[lay.global_norm_sum] = sums[:-1], sums[-1]
        lanes[lay.norm_count], lanes[lay.global_norm_count] = known.sum(0)[:-1], known.sum(0)[-1]
        lanes[lay.nan_grad_count] = scalars[1][:, k].sum()
        lanes[lay.inf_grad_count] = scalars[2][:, k].sum()
        lanes[lay.skipped] = scalars[3][:, k].sum()
        lanes[lay.minibatches] = np.sum(known[:, -1] | (scalars[1][:, k] + scalars[2][:, k] > 0))
        lanes[lay.logp_nan], lanes[lay.logp_inf] = flags[k][0].numpy(), flags[k][1].numpy()
        out.append(lanes)
    return out


def test_each_module_gets_its_own_lanes_in_its_layouts_order():
    """The flags come in blocks out of module order (module 1 alone, then modules 0 and 2 together,
    as ``rllib.module_groups`` hands them): each module still reads its own."""
    norms, flags = _records()
    blocks = [([1], list(flags[1])), ([0, 2], [torch.cat([*flags[0], *flags[2]])])]
    lanes = LaneFold(LAYOUTS).fold(norms, blocks).numpy()
    assert lanes.shape == (sum(lay.size for lay in LAYOUTS),)
    got = np.split(lanes, np.cumsum([lay.size for lay in LAYOUTS])[:-1])
    for k, (mine, want) in enumerate(zip(got, _oracle(norms, flags), strict=True)):
        np.testing.assert_array_equal(mine, want, err_msg=f"module {k}")


def test_one_module_folds_without_reordering_and_matches_the_oracle():
    norms, flags = _records()
    lay = LAYOUTS[1]
    one = StackedNorms(  # module 1 alone
        torch.cat([norms.head_norms[:, 2:6], norms.values[:, 9 + 1 : 9 + 2]], dim=1),
        norms.counts[:, :, 1:2],
        norms.found[:, 1:2],
        4,
    )
    lanes = LaneFold([lay]).fold(one, [([0], list(flags[1]))]).numpy()
    np.testing.assert_array_equal(lanes, _oracle(norms, flags)[1])


def test_a_step_without_records_is_all_zeros():
    _, flags = _records()
    lanes = LaneFold(LAYOUTS).fold(None, [([k], list(pair)) for k, pair in enumerate(flags)])
    assert lanes.shape == (sum(lay.size for lay in LAYOUTS),) and not lanes.any()


def test_flag_blocks_that_miss_a_module_are_refused():
    norms, flags = _records()
    with pytest.raises(ValueError, match="must hold each of the 3 modules once"):
        LaneFold(LAYOUTS).fold(norms, [([0, 1], [torch.cat([*flags[0], *flags[1]])])])
