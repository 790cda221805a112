"""Default MLflow run names: ``<env>-<YYYYmmdd-HHMMSS>-<4 random characters>``.

MLflow's own generator draws from the global ``random`` module, which a run seeds (``seed: 0`` by
default): every run got the same name.  Here the time says when the run started, the environment
what it trained on, and a suffix drawn from the operating system's randomness (never a seeded
generator) keeps runs started in the same second apart.  ``gradmon-ray train`` and sweeps name their
runs with ``default_run_name`` when no ``mlflow.run_name`` is given.
"""

from __future__ import annotations

import random
import re
import time

SUFFIX_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
SUFFIX_LENGTH = 4
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_PRIVATE_RNG = random.SystemRandom()
"""The suffix's source: ``os.urandom``, which no ``random.seed``/``np.random.seed`` touches."""


def env_label(env_id: str) -> str:
    """A short, filename-safe label of an env id: ``gradmon/FactoredOps-v0`` -> ``FactoredOps-v0``,
    ``my_pkg.envs:GridEnv`` -> ``GridEnv``, ``CartPole-v1`` unchanged."""
    tail = re.split(r"[/:]", env_id.strip())[-1]
    label = _UNSAFE.sub("_", tail).strip("._-")
    return label or "run"


def default_run_name(env_id: str, *, now: float | None = None, rng: random.Random | None = None) -> str:
    """``<env label>-<YYYYmmdd-HHMMSS>-<suffix>`` in local time (``now``: seconds since the epoch,
    default the current time; ``rng``: the suffix's generator, default the OS's randomness)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    chooser = rng if rng is not None else _PRIVATE_RNG
    suffix = "".join(chooser.choice(SUFFIX_ALPHABET) for _ in range(SUFFIX_LENGTH))
    return f"{env_label(env_id)}-{stamp}-{suffix}"
