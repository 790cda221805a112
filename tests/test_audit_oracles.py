"""Audit oracles for config validation edges: the boundary values the docs allow."""

from __future__ import annotations

import pytest

from gradmon_ray.config import ConfigError, config_from_dict


def test_a_minibatch_as_large_as_the_train_batch_is_allowed():
    cfg = config_from_dict({"ppo": {"train_batch_size": 256, "minibatch_size": 256}})
    assert cfg.ppo.minibatch_size == cfg.ppo.train_batch_size == 256
    with pytest.raises(ConfigError, match=r"ppo\.minibatch_size"):
        config_from_dict({"ppo": {"train_batch_size": 256, "minibatch_size": 257}})


@pytest.mark.parametrize(
    ("data", "ok"),
    [
        ({"vgs": {"beta": 0.0}}, True),  # min=0 is inclusive
        ({"vgs": {"beta": 0.999999}}, True),
        ({"vgs": {"beta": 1.0}}, False),  # exclusive max
        ({"ppo": {"gamma": 1.0}}, True),  # max=1 inclusive
        ({"ppo": {"gamma": 1.0000001}}, False),
        ({"ppo": {"clip_param": 0.0}}, False),  # exclusive min
        ({"ppo": {"entropy_coeff": 0.0}}, True),
        ({"ppo": {"minibatch_size": 1}}, True),
        ({"ppo": {"minibatch_size": 0}}, False),
    ],
)
def test_range_edges_are_inclusive_or_exclusive_as_documented(data, ok):
    if ok:
        config_from_dict(data)
    else:
        with pytest.raises(ConfigError):
            config_from_dict(data)
