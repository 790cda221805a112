"""Default run names (issue #28): distinct for runs with the same seed, saying what ran and when.

MLflow's own generator draws from the global ``random`` module, which every run seeds (``seed: 0`` by
default): the premise test shows it names two seeded runs alike.  The expected time stamp is
computed with ``datetime``, not with the product's ``time.strftime`` format.
"""

from __future__ import annotations

import random
import re
from datetime import datetime

import pytest

from gradmon_ray.app.run_names import SUFFIX_ALPHABET, default_run_name, env_label
from gradmon_ray.app.train.mlflow_run import named
from gradmon_ray.config import config_from_dict

NOON = datetime(2025, 3, 4, 12, 5, 9).timestamp()  # local time, as the name shows it


def test_two_default_names_after_the_same_seed_differ():
    names = set()
    for _ in range(50):
        random.seed(0)
        names.add(default_run_name("gradmon/FactoredOps-v0", now=NOON))
    assert len(names) == 50, names


def test_the_name_is_the_env_then_the_local_start_time_then_a_suffix():
    name = default_run_name("gradmon/FactoredOps-v0", now=NOON)
    label, date, clock, suffix = name.rsplit("-", 3)
    assert label == "FactoredOps-v0"
    assert f"{date}-{clock}" == datetime.fromtimestamp(NOON).strftime("%Y%m%d-%H%M%S") == "20250304-120509"
    assert len(suffix) == 4 and set(suffix) <= set(SUFFIX_ALPHABET)


def test_a_given_generator_makes_the_suffix_reproducible():
    assert default_run_name("CartPole-v1", now=NOON, rng=random.Random(7)) == default_run_name(
        "CartPole-v1", now=NOON, rng=random.Random(7)
    )


@pytest.mark.parametrize(
    ("env_id", "label"),
    [
        ("gradmon/FactoredOps-v0", "FactoredOps-v0"),
        ("gradmon/FactoredOpsMultiAgent-v0", "FactoredOpsMultiAgent-v0"),
        ("CartPole-v1", "CartPole-v1"),
        ("my_pkg.envs:GridEnv", "GridEnv"),
        ("weird name!/x y", "x_y"),
        ("///", "run"),
    ],
)
def test_env_label(env_id: str, label: str):
    assert env_label(env_id) == label
    assert re.fullmatch(r"[A-Za-z0-9._-]+", env_label(env_id))  # safe in a file name (the spill file's)


def test_a_config_without_a_name_gets_a_named_copy_and_a_named_one_is_kept():
    cfg = config_from_dict({"env": {"id": "CartPole-v1"}})
    copy = named(cfg)
    assert cfg.mlflow.run_name is None  # the caller's config is left alone
    assert re.fullmatch(r"CartPole-v1-\d{8}-\d{6}-[a-z0-9]{4}", copy.mlflow.run_name)
    assert copy.model_dump(exclude={"mlflow"}) == cfg.model_dump(exclude={"mlflow"})
    given = config_from_dict({"mlflow": {"run_name": "mine"}})
    assert named(given) is given
