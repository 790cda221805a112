"""``connector_frames.py``: RLlib's connector pieces record the same constructor arguments with the
frames-only stack as with ``inspect.stack()`` (the oracle: RLlib's own ``get_ctor_args_and_kwargs``
under the real ``inspect``), for a piece with its own ``__init__`` built directly and inside a
learner's real pipeline."""

from __future__ import annotations

import inspect

from ray.rllib.connectors import connector_v2
from ray.rllib.connectors.learner import GeneralAdvantageEstimation

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.local_learner import build_local_learner
from tests.connector_frames import _FramesOnly, connector_frames_only


def _pieces(learner) -> list[tuple[str, tuple, dict]]:
    return [(type(p).__name__, *p.get_ctor_args_and_kwargs()) for p in learner._learner_connector.connectors]


def test_the_frames_only_stack_records_the_same_constructor_arguments() -> None:
    cfg = config_from_dict({"seed": 0, "model": {"trunk_hiddens": [8]}})
    assert connector_v2.inspect is not inspect  # tests/conftest.py: the frames-only stack
    fast_gae = GeneralAdvantageEstimation(gamma=0.9, lambda_=0.8)
    fast = _pieces(build_local_learner(cfg))
    connector_v2.inspect = inspect  # RLlib as shipped
    try:
        real_gae = GeneralAdvantageEstimation(gamma=0.9, lambda_=0.8)
        real = _pieces(build_local_learner(cfg))
    finally:
        connector_v2.inspect = _FramesOnly("inspect")
    assert fast_gae.get_ctor_args_and_kwargs() == real_gae.get_ctor_args_and_kwargs()
    assert fast_gae.get_ctor_args_and_kwargs()[1]["lambda_"] == 0.8  # the caller's own argument
    assert any(kwargs for _, _, kwargs in real) and fast == real


def test_it_puts_rllibs_inspect_back() -> None:
    patched = connector_v2.inspect
    connector_v2.inspect = inspect  # RLlib as shipped
    try:
        with connector_frames_only():
            assert isinstance(connector_v2.inspect, _FramesOnly)
        assert connector_v2.inspect is inspect
    finally:
        connector_v2.inspect = patched
