"""The drop-in code blocks of README.md and docs/*.md, read at test time, and what a test run changes.

A drop-in block is a fenced ``python`` block that trains (``build_algo()`` or a ``Tuner``) with
``with_gradmon`` or ``GradmonMLflowCallback``.  ``tests/e2e/test_dropin_e2e.py`` runs every one of them
as a script (``tests/e2e/doc_block_runner.py``); ``tests/test_readme.py`` checks, without Ray, that
every block found has an entry in ``EDITS`` and that each edit applies exactly once (a block that
changed fails there, in the fast lane).  An edit only shrinks numbers (batch sizes, iterations) or
keeps a Tune directory out of the user's home; what a block leaves to the reader (``config``: "your
PPOConfig", ``"MyMultiDiscreteEnv"``: your env) the runner supplies in ``prelude``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SMALL_PPO = ".training(train_batch_size=256, minibatch_size=128, num_epochs=1)"
"""PPO's CI-sized batches (its defaults: 4000 rows, 30 epochs) for blocks that train PPO."""


@dataclass(frozen=True)
class Edit:
    """What a test run of one block changes: ``replace`` (each old text exactly once) and a ``prelude``."""

    replace: dict[str, str] = field(default_factory=dict)
    prelude: str = ""
    tune_dir: bool = False  # the block's RunConfig gets storage_path=<the test's directory>


USER_PPO_CONFIG = (
    f'from ray.rllib.algorithms.ppo import PPOConfig\nconfig = PPOConfig().environment("CartPole-v1"){SMALL_PPO}\n'
)
USER_MULTI_DISCRETE_ENV = """\
import gymnasium as gym
import numpy as np
from ray.tune.registry import register_env

class MyMultiDiscreteEnv(gym.Env):  # defined in the script: Ray ships it to the EnvRunners by value
    def __init__(self, config=None):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([3, 4])

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), float(action[0] == 1), self.t >= 20, False, {}

register_env("MyMultiDiscreteEnv", lambda cfg: MyMultiDiscreteEnv(cfg))
"""

EDITS: dict[str, Edit] = {
    # key: "<file>:<kind>", the kind by the first of APPOConfig, MyMultiDiscreteEnv, Tuner in the block
    "README.md:APPOConfig": Edit(),
    "README.md:Tuner": Edit(
        replace={'PPOConfig().environment("CartPole-v1")': f'PPOConfig().environment("CartPole-v1"){SMALL_PPO}'},
        tune_dir=True,
    ),
    "docs/callback.md:Tuner": Edit(
        replace={'"training_iteration": 20': '"training_iteration": 1'}, prelude=USER_PPO_CONFIG, tune_dir=True
    ),
    "docs/heads.md:MyMultiDiscreteEnv": Edit(
        replace={"PPOConfig()": f"PPOConfig(){SMALL_PPO}"}, prelude=USER_MULTI_DISCRETE_ENV
    ),
}
RUN_CONFIG = re.compile(r"tune\.RunConfig\(([^()]*)\)")


@dataclass(frozen=True)
class DocBlock:
    key: str
    code: str  # as written in the docs

    def for_test(self, tune_dir: str) -> str:
        """The block as the test runs it: ``EDITS[key]`` applied (each replacement exactly once)."""
        edit = EDITS[self.key]
        code = self.code
        for old, new in edit.replace.items():
            assert code.count(old) == 1, f"{self.key}: expected {old!r} once in the block"
            code = code.replace(old, new)
        if edit.tune_dir:
            assert len(RUN_CONFIG.findall(code)) == 1, f"{self.key}: expected one tune.RunConfig(...)"
            code = RUN_CONFIG.sub(lambda m: f"tune.RunConfig({m.group(1)}, storage_path={tune_dir!r}, verbose=0)", code)
        return edit.prelude + code


def _kind(code: str) -> str:
    for word in ("APPOConfig", "MyMultiDiscreteEnv", "Tuner"):
        if word in code:
            return word
    return "?"


def drop_in_blocks() -> list[DocBlock]:
    """Every drop-in block of the README and docs/*.md, in file order."""
    blocks = []
    for path in DOC_FILES:
        for code in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            uses_gradmon = "with_gradmon(" in code or "GradmonMLflowCallback" in code
            if uses_gradmon and ("build_algo()" in code or "Tuner(" in code):
                blocks.append(DocBlock(f"{path.relative_to(ROOT)}:{_kind(code)}", code))
    return blocks
