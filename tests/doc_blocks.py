"""What each fenced block of README.md and docs/*.md is, and what a test run of it changes (the kinds:
``tests/doc_block_kinds.py``).  ``KINDS`` is keyed by file and a hash of the block's text, so a block
added or changed fails ``tests/test_readme.py`` (fast lane) until it is classified here again; each
entry's comment is the block's first line.  ``tests/e2e/test_doc_commands_e2e.py`` runs the scripts
and commands (``plan``); the fast lane runs the scripts marked ``fast``, loads the configs and checks
the outputs a call without Ray makes.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.doc_block_kinds import RAY, ROOT, Commands, Config, Edit, Fence, Kind, NotRun, Output, Script, fences

__all__ = ["KINDS", "ROOT", "DocBlock", "classified", "drop_in_blocks", "plan", "working_copy"]

SMALL_PPO = ".training(train_batch_size=256, minibatch_size=128, num_epochs=1)"
"""PPO's CI-sized batches (its defaults: 4000 rows, 30 epochs) for blocks that train PPO."""
SMALL_TRAIN = "--iterations 1 --num-env-runners 0 --set ppo.train_batch_size=256 --set ppo.num_epochs=1"
"""``gradmon-ray train``'s CI size (the defaults: 20 iterations of 1024 steps, 4 epochs, one EnvRunner actor)."""
CONFIG_SHRINKS = {
    "tune_configs/default.yaml": {
        "train_batch_size: 1024": "train_batch_size: 256",
        "num_epochs: 4": "num_epochs: 1",
        "num_env_runners: 1": "num_env_runners: 0",
    },
}
"""The numbers of the shipped configs shrunk in the copy the blocks read (``working_copy``)."""
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
BAD_SWEEP = "search_space:\n  ppo.lrr: {choice: [0.001, 0.0003]}\n"
"""operations.md's ``bad.yaml``: "a bad file", a misspelled field in the search space."""
TRAIN = "README.md@8aff0e37"
"""The README's ``gradmon-ray train``: the run (``RUN_ID``) the later blocks read and resume."""
DIAGNOSIS = "docs/diagnosis.md@ee0cf009"
WITHOUT_RAY = "tests/test_readme.py::test_the_outputs_the_docs_show_without_ray_have_their_shape"

KINDS: dict[str, Kind] = {
    # python -m pip install "torch==2.13.0" -e ".[dev]"
    "README.md@c3f0ddcd": NotRun("installs into the environment: .ci/run runs it verbatim (tests/test_readme.py)"),
    # python -m pytest -q
    "README.md@a9dc6315": NotRun(
        "the whole suite, this test included: .ci/run runs it verbatim (tests/test_readme.py)"
    ),
    # gradmon-ray train  (checkpoint_every 5 -> 1: one iteration leaves a checkpoint to resume)
    TRAIN: Commands(
        Edit(replace={"gradmon-ray train": f"gradmon-ray train {SMALL_TRAIN} --set checkpoint_every=1"}),
        captures={"RUN_ID": r"MLflow run ([0-9a-f]{32})"},
    ),
    # gradmon-ray: training 20 iterations on gradmon/FactoredOps-v0; MLflow: sqlite:///mlflow.db
    "README.md@afda1ce1": Output(TRAIN, lines=(0, 1, 2, 5, 6)),  # one iteration here: the last line is the first's
    # gradmon-ray watch / report RUN_ID / train --set ... / tune tune_configs/vgs_sweep.yaml
    "README.md@f044f1c4": Commands(  # the sweep up to Ray (a trial: ~20 s; tests/e2e/test_sweep_e2e.py sweeps)
        Edit(replace={"model.trunk_hiddens=[256,256]": f"model.trunk_hiddens=[256,256] {SMALL_TRAIN}"}),
        rcs=(0, 0, 0, RAY),
    ),
    # from gradmon_ray.rllib import with_gradmon  (APPO)
    "README.md@52ad2451": Script(drop_in="README.md:APPOConfig"),
    # from ray import tune  (PPOTorchLearner, GradmonMLflowCallback)
    "README.md@33530b75": Script(
        Edit(
            replace={'PPOConfig().environment("CartPole-v1")': f'PPOConfig().environment("CartPole-v1"){SMALL_PPO}'},
            tune_dir=True,
        ),
        drop_in="README.md:Tuner",
    ),
    # ratio gradmon/off agents=2 median 1.036 min 1.025 max 1.051
    "docs/BENCHMARKS.md@4f73814d": NotRun("bench/telemetry_overhead.py's figures: minutes of timed training per arm"),
    # from ray import tune  (GradmonPPOTorchLearner, configured(...))
    "docs/callback.md@687fcf1b": Script(
        Edit(replace={'"training_iteration": 20': '"training_iteration": 1'}, prelude=USER_PPO_CONFIG, tune_dir=True),
        drop_in="docs/callback.md:Tuner",
    ),
    # gradmon-ray: training 20 iterations on gradmon/FactoredOps-v0; MLflow: sqlite:///mlflow.db
    "docs/checkpoints.md@0e02e4d0": Output(TRAIN),
    # iter 2/20 | ... ^C ... gradmon-ray: interrupted
    "docs/checkpoints.md@a9b2db0f": Output(
        "tests/e2e/test_console_script_e2e.py::test_ctrl_c_ends_the_run_killed_with_its_last_iteration_checkpointed"
    ),
    # gradmon-ray train --resume RUN_ID ... (after the README's run: refused as complete, then trained further)
    "docs/checkpoints.md@9830850c": Commands(
        Edit(replace={"--iterations 200": "--iterations 2", "/data/ckpts": "gradmon-checkpoints"}), rcs=(2, 0, 2, 2)
    ),
    # gradmon-ray: config error: --resume: run 1f0c...'s checkpoints are in /old/place/gradmon-checkpoints, ...
    "docs/checkpoints.md@0e4fac19": Output(
        "tests/app/test_resume_command.py::test_checkpoint_dir_flag_is_the_root_resume_loads_from"
    ),
    # python bench/checkpoint_cost.py
    "docs/checkpoints.md@42280365": NotRun(
        "a benchmark: a local Ray of its own (ray.init(num_cpus=...)) and minutes of default-config training"
    ),
    # <checkpoint_dir>/<run id>/ckpt-00000012-<nonce>/algo/
    "docs/checkpoints.md@0f007914": Output(TRAIN),
    # iterations: 2  (cfg.yaml)
    "docs/diagnosis.md@6d9b22c1": Config("gradmon"),
    # PYTHONPATH=. gradmon-ray train --config cfg.yaml
    DIAGNOSIS: Commands(Edit(files={"cfg.yaml": "docs/diagnosis.md@6d9b22c1"})),
    # iter 1/2 | env steps 256 | return inf | skipped 3/3: did not train | latched: none
    "docs/diagnosis.md@9b902bf0": Output(DIAGNOSIS),
    # {  (diagnosis/iter_1_default_policy.json)
    "docs/diagnosis.md@9b7c2852": Output(DIAGNOSIS),
    # ValueError: learner_config_dict['gradmon']: unknown keys ['heds']; ...
    "docs/dropin.md@766097e9": Output(WITHOUT_RAY),
    # from ray.rllib.algorithms.ppo import PPOConfig  (MyMultiDiscreteEnv)
    "docs/heads.md@850212f8": Script(
        Edit(replace={"PPOConfig()": f"PPOConfig(){SMALL_PPO}"}, prelude=USER_MULTI_DISCRETE_ENV),
        drop_in="docs/heads.md:MyMultiDiscreteEnv",
    ),
    # gradmon: LSTMContainingRLModule has no per-component heads ...
    "docs/heads.md@c47c0c3f": Output(WITHOUT_RAY),
    # from ray.rllib.core.rl_module.torch import TorchRLModule  (value_heads)
    "docs/heads.md@27e91bb6": Script(fast=True),
    # module 'default_policy': gradmon head 'value' (regex '^value_head\\.') matches no trainable parameter ...
    "docs/heads.md@e1b7f9c4": Output(WITHOUT_RAY),
    # EnvRunners --episodes--> GradmonPPOTorchLearner ...
    "docs/internals.md@625af180": NotRun("a diagram of the data flow"),
    # from gradmon_ray.telemetry import per_head_grad_norms, ...  (build_ppo_config(load_config(...)))
    "docs/internals.md@6b450285": Script(),
    # telemetry: bands: action/value
    "docs/internals.md@ebdf7692": Config("gradmon"),
    # gradmon-ray train --set probe.gradient_analysis_every=5  (up to Ray: tests/e2e/test_probe_e2e.py probes)
    "docs/internals.md@e5c886f3": Commands(rcs=(RAY,)),
    # gradmon_ray/  (the folders)
    "docs/internals.md@3d31afd1": NotRun("a drawing of the repository's folders (tests/test_readme.py: each exists)"),
    # git clone -q /work/main /tmp/mut-after && ...  mutmut run
    "docs/mutation.md@877f7595": NotRun("an hour of mutmut (not a project dependency) in a clone at 8f81be0"),
    # [tool.mutmut]
    "docs/mutation.md@c882fbc1": Config("toml"),
    # import os  (the stats shim)
    "docs/mutation.md@c4427a53": Script(fast=True),
    # $ gradmon-ray train --set ppo.minibatch_size=-3
    "docs/operations.md@1748d7f4": Commands(rcs=(2,)),
    # gradmon-ray watch / watch --run-id RUN_ID --once / watch --experiment my-exp ... / report RUN_ID
    "docs/operations.md@c46996c1": Commands(
        Edit(replace={"my-exp": "gradmon-ray", "http://10.0.0.5:5000": "sqlite:///mlflow.db"}), rcs=(0,) * 4
    ),
    # health_stop:
    "docs/operations.md@ea2ec99c": Config("gradmon"),
    # telemetry: bands: collapse
    "docs/operations.md@223d3eb6": Config("gradmon"),
    # telemetry: bands: update_ratio
    "docs/operations.md@696d8931": Config("gradmon"),
    # gradmon-ray train --resume RUN_ID ... (3 lines)
    "docs/operations.md@08c2f9f0": Commands(
        Edit(replace={"--iterations 200": "--iterations 3", "/data/ckpts": "gradmon-checkpoints"}), rcs=(2, 0, 2)
    ),
    # gradmon-ray tune tune_configs/vgs_sweep.yaml ...  (4 sweeps, up to Ray: a trial is ~20 s)
    "docs/operations.md@d72e0654": Commands(rcs=(RAY,) * 4),
    # $ gradmon-ray tune bad.yaml
    "docs/operations.md@504586d5": Commands(Edit(files={"bad.yaml": BAD_SWEEP}), rcs=(2,)),
    # gradmon-ray: sweep 'heads' over model.head_logit_scale: 4 trials of 2 iterations
    "docs/operations.md@42cba094": Output(
        "tests/e2e/test_sweep_e2e.py::test_progress_lines_arrive_while_the_sweep_runs_and_match_mlflow"
    ),
    # export RAY_AUTH_MODE=token / ray job submit ... --set resources.num_gpus_per_learner=1
    "docs/operations.md@da01a89a": NotRun("GPU learners on a cluster's job server (tests/e2e/test_job_submit_e2e.py)"),
    # set -a; . ~/.gradmon-ray/mlflow.env; set +a / RAY_AUTH_MODE=token MLFLOW_TRACKING_URI=... ray start --head
    "docs/operations.md@216cde35": NotRun("a node's ray start, MLflow at HOST (tests/e2e/test_job_submit_e2e.py)"),
    # ray get-auth-token --generate ... ray up cluster.yaml ...
    "docs/operations.md@7cce3a8a": NotRun("a cloud cluster: ray up cluster.yaml (tests/test_cluster_yaml.py)"),
    # resources: custom_resources_per_learner ...
    "docs/operations.md@eef8cc43": Config("gradmon"),
}


def classified() -> list[tuple[Fence, Kind | None]]:
    """Every block of the docs with its kind (None: not classified)."""
    return [(fence, KINDS.get(fence.key)) for fence in fences()]


@dataclass(frozen=True)
class DocBlock:
    """A drop-in block (``with_gradmon`` or ``GradmonMLflowCallback``, training), by its old key."""

    key: str
    code: str  # as written in the docs
    edit: Edit

    def for_test(self, tune_dir: str) -> str:
        """The block as the test runs it: its ``Edit`` applied."""
        return self.edit.apply(self.key, self.code, tune_dir)


def drop_in_blocks() -> list[DocBlock]:
    """Every drop-in block of the README and docs/*.md, in file order."""
    return [
        DocBlock(kind.drop_in, fence.text, kind.edit)
        for fence, kind in classified()
        if isinstance(kind, Script) and kind.drop_in
    ]


def working_copy(directory: Path) -> None:
    """The shipped ``tune_configs/`` in ``directory``, its numbers shrunk (``CONFIG_SHRINKS``): the
    blocks read them from the directory they run in, as from the repository root."""
    shutil.copytree(ROOT / "tune_configs", directory / "tune_configs")
    for name, replace in CONFIG_SHRINKS.items():
        path = directory / name
        text = path.read_text()
        for old, new in replace.items():
            assert text.count(old) == 1, f"{name}: expected {old!r} once"
            text = text.replace(old, new)
        path.write_text(text)


def plan(tune_dir: str) -> dict[str, Any]:
    """What ``tests/e2e/doc_block_runner.py`` runs: the e2e scripts in file order, then the commands
    (file order; the blocks with a command run only up to Ray last: that command leaves Ray)."""
    by_key = {fence.key: fence for fence in fences()}
    scripts, commands = [], []
    for fence, kind in classified():
        if isinstance(kind, Script) and not kind.fast:
            scripts.append({"key": fence.key, "code": kind.edit.apply(fence.key, fence.text, tune_dir)})
        elif isinstance(kind, Commands):
            files = {name: by_key[text].text if text in by_key else text for name, text in kind.edit.files.items()}
            code = kind.edit.apply(fence.key, kind.script(fence.text))
            commands.append(
                {"key": fence.key, "code": code, "files": files, "rcs": list(kind.rcs), "captures": kind.captures}
            )
    commands.sort(key=lambda c: RAY in c["rcs"])
    return {"scripts": scripts, "commands": commands}
