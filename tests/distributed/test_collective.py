"""``distributed/collective.py``'s deadline: the learners' telemetry reduce on two real gloo
processes (``two_ranks.TwoRanks``) sums within ``timeout_s``, and stops the learner whose partner
never joins it with a line naming the step and the group.

The transport is gloo's own all-reduce on the processes' world, standing in for the Ray
collective group (a Ray actor's only: ``tests/e2e`` runs that one); the deadline around it is the
product's.
"""

from __future__ import annotations

import time

import pytest
import torch

from gradmon_ray.distributed import LearnerCollective
from tests.distributed.two_ranks import STATE, TwoRanks

pytestmark = pytest.mark.e2e


class _WorldGloo(LearnerCollective):
    """The reduce over the processes' gloo world instead of a Ray collective group."""

    def _allreduce(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(tensor)


def _collective(rank: int, timeout_s: float) -> None:
    STATE["collective"] = _WorldGloo("gradmon-test", 2, rank, "gloo", torch.device("cpu"), timeout_s)


def _reduce(rank: int, join: bool) -> tuple[str, object, float, int]:
    """Reduce ``[rank + 1]`` (``join`` False: stay away): the sum or the error, the seconds, the calls."""
    collective = STATE["collective"]
    start = time.monotonic()
    if not join:
        return ("stayed away", None, 0.0, collective.calls)
    try:
        out = collective.allreduce_sum(torch.tensor([rank + 1.0], dtype=torch.float64))
        return ("ok", out.tolist(), time.monotonic() - start, collective.calls)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start, collective.calls)


@pytest.fixture(scope="module")
def ranks():
    pair = TwoRanks()
    yield pair
    pair.close()


def test_the_telemetry_reduce_sums_within_the_deadline_and_names_the_step_it_waited_for(ranks):
    ranks.run(_collective, (1.5,), (1.5,))
    both = ranks.run(_reduce, (True,), (True,))
    assert [(kind, value, calls) for kind, value, _, calls in both] == [("ok", [3.0], 1)] * 2, "1 + 2"
    try:
        (kind, line, took, calls), away = ranks.run(_reduce, (True,), (False,))
    finally:
        ranks.close()  # learner 0's reduce is still pending in gloo
    assert away[0] == "stayed away"
    assert kind == "CollectiveTimeoutError" and calls == 1, line
    assert 1.5 <= took < 3.5
    assert line == (
        "gradmon: learner 0 of 2 waited 1.5 s (learner_config_dict['gradmon']['collective_timeout_s']) for the "
        "telemetry reduce of step 2 (group gradmon-test); another learner never joined it (stopped, stuck, or in "
        "a different collective)"
    )
