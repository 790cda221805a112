"""The drop-in on APPO and IMPALA adds no host read to a minibatch (their learner thread runs
``_update``; ``counting_calls`` counts it in whatever thread calls it).  The same check as
``tests/rllib/test_host_reads.py`` for PPO, on RLlib's default modules with a fused-Adam stock
learner as the baseline, 1 and 2 modules, VGS off and on.  Needs Ray (the learner thread
``ray.put``s its weights).
"""

from __future__ import annotations

from typing import Any

import pytest

from gradmon_ray.rllib import with_gradmon
from gradmon_ray.telemetry.op_counts import OpCounter, counting_calls
from tests.peer.pairs import ALGOS, HEADS, build_pair, cartpole_config, fused_adam, sample_batch, seeded_update


def _minibatch_reads(learner: Any, algo: str, batch: Any) -> OpCounter:
    seeded_update(learner, algo, batch, seed=0, step=1)  # builds the plan's cached index tensors
    counter = OpCounter()
    with counting_calls(learner, "_update", counter):
        seeded_update(learner, algo, batch, seed=1, step=2)
    return counter


@pytest.mark.parametrize("algo", ["appo", "impala"])
@pytest.mark.parametrize(
    ("agents", "vgs"), [(0, False), (2, False), (2, True)], ids=["1-module", "2-modules", "2-modules-vgs"]
)
def test_the_drop_in_reads_the_host_as_often_as_stock_per_minibatch(ray_session, algo, agents, vgs):
    stock_cls = fused_adam(ALGOS[algo][1])
    gradmon = {"heads": HEADS, "vgs": {"enabled": vgs, "warmup_steps": 0}}
    stock_config = cartpole_config(algo, stock_cls, agents=agents)
    wrapped_config = cartpole_config(algo, with_gradmon(stock_cls), agents=agents, gradmon=gradmon)
    stock, wrapped = build_pair(stock_config, wrapped_config)
    batch = sample_batch(stock_config, stock)
    try:
        stock_reads, wrapped_reads = _minibatch_reads(stock, algo, batch), _minibatch_reads(wrapped, algo, batch)
    finally:
        stock.shutdown()
        wrapped.shutdown()
    assert wrapped_reads.calls == stock_reads.calls >= 1
    assert wrapped_reads.host_reads == stock_reads.host_reads, (
        dict(stock_reads.host_reads),
        dict(wrapped_reads.host_reads),
    )
    assert wrapped.gradmon_modules and all(m.last_telemetry is not None for m in wrapped.gradmon_modules.values())
