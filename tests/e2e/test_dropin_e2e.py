"""The drop-in as a user runs it.

- Every drop-in block of the README and docs/*.md runs as a script, with the docs' other blocks:
  ``tests/e2e/test_doc_commands_e2e.py``.
- A settings mistake in the README's block: one ``ValueError`` line before Ray starts
  (``check_gradmon``); a head regex matching nothing: one line from the learner, built in the driver
  with the block's ``num_learners=0``; and with a remote learner the script still exits promptly
  (``gradmon_ray.rllib.dropin``'s exit hook).
- The README's block against two oracles (RLlib's own global norm, autograd hooks), and two remote
  APPO learners on RLlib's default modules of a two-policy run with no head settings: one packed
  reduction per step, the replica checksum.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.doc_blocks import ROOT, drop_in_blocks
from tests.e2e.processes import clean_env, kill_group
from tests.test_docs import README_TRAIN, _readme_drop_in_example

pytestmark = pytest.mark.e2e

GRAD_CLIP = 0.5
"""Small enough that RLlib's clip really scales CartPole's gradients (gradmon reports before it)."""


def _train_until_learner_results(algo, modules=("default_policy",), max_seconds: float = 150.0) -> dict:
    """``algo.train()`` until ``result["learners"]`` holds gradmon's metrics for every module.  APPO
    updates asynchronously: on a loaded machine stock RLlib's first iterations can carry no learner
    results at all (its EnvRunners are still starting)."""
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        result = algo.train()
        learners = result.get("learners", {})
        if all(mn.head_metric(mn.HEAD_GRAD_NORM, "pi") in learners.get(mid, {}) for mid in modules):
            return result
    raise AssertionError(f"no learner results within {max_seconds} s")


def test_appo_example_as_written(ray_session):
    """The README's block builds the config (its statements, not a copy); the test adds only what
    the oracles need: RLlib's own ``grad_clip`` and ``log_gradients``, so RLlib logs the global norm
    its ``clip_gradients`` computes (``compute_global_norm``), an independent path to gradmon's
    ``grad/global_norm``; and hooks on ``module.pi`` / ``module.vf`` on the learner, whose
    squared gradients give each head's norm.  The value is read by the README's own expression.
    APPO's update is one minibatch (``minibatch_size`` None, one epoch), so gradmon's mean over the
    step's minibatches and RLlib's last-minibatch value are the same gradient; the driver averages
    both over the same updates."""

    def record_submodule_gradients(learner) -> None:
        """On the learner (the block's ``num_learners=0``: in this process): tensor hooks on the parameters
        of the ``pi`` and ``vf`` submodules, fetched by attribute name, adding each backward's
        squared gradient (float64) under the telemetry step it belongs to."""
        from ray.rllib.core import DEFAULT_MODULE_ID

        module = learner.module[DEFAULT_MODULE_ID].unwrapped()
        learner.test_sq_by_step = {}

        def hook(head):
            def add(grad):
                step = learner.gradmon_iteration + 1  # the step being computed (its clock: steps done)
                sums = learner.test_sq_by_step.setdefault(step, {"pi": 0.0, "vf": 0.0})
                sums[head] += float(grad.detach().double().pow(2).sum())

            return add

        for head in ("pi", "vf"):
            for param in getattr(module, head).parameters():
                param.register_hook(hook(head))

    setup, train, read = _readme_drop_in_example()
    namespace: dict = {}
    exec(compile(ast.Module(body=setup, type_ignores=[]), "README.md", "exec"), namespace)
    assert [ast.unparse(stmt) for stmt in train] == README_TRAIN  # _train_until_learner_results: the same loop
    config = namespace["config"].training(grad_clip=GRAD_CLIP).reporting(log_gradients=True)
    assert config.grad_clip_by == "global_norm"
    algo = config.build_algo()
    try:
        algo.learner_group.foreach_learner(record_submodule_gradients)
        result = _train_until_learner_results(algo)
        logged = result["learners"]["default_policy"]
        (rllib_key,) = [k for k in logged if k.startswith("gradients_") and k.endswith("_global_norm")]
        assert logged[rllib_key] == pytest.approx(logged[mn.GLOBAL_GRAD_NORM], rel=1e-5)
        assert logged[mn.MINIBATCH_UPDATES] == 1.0

        # The driver's value is the mean over every step whose result it merged in this train()
        # call (RLlib's root MetricsLogger merges each update's window=1 value); the clock is reduced
        # by max, so it is the last of them: the first iteration with results holds steps 1..last.
        last = logged[mn.TELEMETRY_ITERATION]
        assert last == int(last) >= 1, logged[mn.TELEMETRY_ITERATION]
        steps = range(1, int(last) + 1)
        (sums,) = [
            r.get() for r in algo.learner_group.foreach_learner(lambda lr: [lr.test_sq_by_step.get(s) for s in steps])
        ]
        assert None not in sums, f"a step of 1..{int(last)} had no hooked backward: {sums}"
        readme_value = eval(compile(ast.Expression(read.value), "README.md", "eval"), {"result": result})
        for head, value in (("pi", readme_value), ("vf", logged[mn.head_metric(mn.HEAD_GRAD_NORM, "vf")])):
            expected = sum(math.sqrt(step[head]) for step in sums) / len(sums)
            assert value == pytest.approx(expected, rel=1e-5), (head, len(sums))
    finally:
        algo.stop()


def test_two_appo_learners_on_rllibs_default_multi_agent_modules(ray_session):
    """Two policies with RLlib's default APPO modules and no head settings (gradmon finds each
    module's ``pi`` and ``vf`` itself), two remote learners: per module, finite head norms and a
    replica checksum that agrees; on both learners, one collective call per telemetry step however
    many modules.  The only setting is the checksum's cadence (every step, to see it here)."""
    start = time.monotonic()
    config = (
        APPOConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": 2})
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda aid, *a, **k: f"p{aid}")
        .env_runners(num_env_runners=1, rollout_fragment_length=50)
        .learners(
            num_learners=2,
            learner_class=with_gradmon(APPOTorchLearner),
            learner_config_dict={"gradmon": {"replica_check_every": 1}},
        )
        .training(train_batch_size_per_learner=200)
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        learners = _train_until_learner_results(algo, modules=("p0", "p1"))["learners"]
        for mid in ("p0", "p1"):
            assert learners[mid][mn.REPLICA_CHECKSUM_OK] == 1.0, mid
            for head in ("pi", "vf"):
                assert math.isfinite(learners[mid][mn.head_metric(mn.HEAD_GRAD_NORM, head)]), (mid, head)

        def probe(learner):
            c = learner.collective
            return c.rank, c.world_size, c.calls, learner.gradmon_iteration, sorted(learner.gradmon_modules)

        states = [r.get() for r in algo.learner_group.foreach_learner(probe)]
        assert sorted(s[0] for s in states) == [0, 1] and all(s[1] == 2 for s in states)
        assert all(s[4] == ["p0", "p1"] for s in states), states
        # ONE collective call per telemetry step on every learner (read while the learner
        # thread may be inside a step: the call is counted before the clock advances).
        assert all(1 <= s[3] <= s[2] <= s[3] + 1 for s in states), states
    finally:
        algo.stop()
    assert time.monotonic() - start < 300


# --- the README's block as a script ------------------------------------------------------------
def _run_script(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, str, float]:
    """Run ``argv``; its return code, stderr and seconds.  A script that does not end is killed, and fails."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s=5)  # the script and the Ray it started
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not end within {timeout_s} s:\n{out[-2000:]}\n{err[-4000:]}")
    return proc.returncode, out + "\n" + err, time.monotonic() - start


def _shared_ray_env(address: str) -> dict[str, str]:
    """The suite's shared Ray for a script's own ``ray.init()`` (RLlib's auto-init reads RAY_ADDRESS)."""
    return {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(ROOT)}


README_HEADS = '{"heads": {"pi": r"^pi\\.", "vf": r"^vf\\."}}'
MISTAKES = {  # the README block's settings -> what the user wrote, and the start of the one line they get
    "misspelled key": (
        '{"heds": {"pi": r"^pi\\."}}',
        "learner_config_dict['gradmon']: unknown keys ['heds']; allowed:",
    ),
    "bad regex": ('{"heads": {"pi": r"(["}}', "learner_config_dict['gradmon']['heads']['pi']: invalid regular"),
    "band as a string": (
        '{"bands": {"action": "0.1"}}',
        "learner_config_dict['gradmon']['bands']['action'] must be a mapping (dict), got str '0.1'",
    ),
    # The module is built on the driver from the config (an EnvRunner made there gives the spaces): the
    # regex is checked before Ray too (it took a learner, 21-23 s and 42-45 lines, before).
    "head regex matching nothing": (
        '{"heads": {"pi": r"^nomatch\\."}}',
        "module 'default_policy': gradmon head 'pi' (regex '^nomatch\\\\.') matches no trainable parameter",
    ),
}


def _readme_script(tmp_path: Path, settings: str, *replace: tuple[str, str]) -> list[str]:
    """The README's drop-in block with other gradmon settings (and ``replace`` applied), as a script."""
    (block,) = [b for b in drop_in_blocks() if b.key == "README.md:APPOConfig"]
    code = block.code
    for old, new in ((README_HEADS, settings), *replace):
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    (tmp_path / "script.py").write_text(code)
    return [sys.executable, "script.py"]


def _last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_a_settings_mistake_is_one_value_error_line_before_ray_starts(tmp_path):
    """Run with RAY_ADDRESS naming a port nothing listens on: a script that reached Ray (an EnvRunner,
    a learner actor) would fail to connect instead.  What it gets is the ``ValueError``, in one line,
    raised by the block's own ``check_gradmon(...)`` line; the process has ended within seconds.
    (One mistake as a process of its own: the others, the same path, run in this one.)"""
    settings, message = MISTAKES["misspelled key"]
    argv = _readme_script(tmp_path, settings)
    rc, output, seconds = _run_script(argv, tmp_path, clean_env(RAY_ADDRESS="127.0.0.1:9"), 120)
    assert rc == 1 and _last_line(output).startswith(f"ValueError: {message}"), output[-3000:]
    printed = output[output.index("Traceback (most recent call last):") :]
    frames = re.findall(r'^  File "(.+?)", line \d+, in (\S+)', printed, re.M)
    assert [f[1] for f in frames] == ["<module>", "check_gradmon"], frames  # the user's line, then ours
    assert "Started a local Ray" not in output and "RayTaskError" not in output
    assert seconds < 60  # interpreter, torch and RLlib imports only (the learner's check took ~50 s)


@pytest.mark.parametrize("mistake", sorted(set(MISTAKES) - {"misspelled key"}))
def test_each_settings_mistake_is_raised_by_the_blocks_check_gradmon_line(mistake, tmp_path):
    """The README's block with each other mistake, run in this process (its imports are here already):
    ``check_gradmon(...)`` raises the one ``ValueError`` line, from the block's own line, before the
    block's ``build_algo()`` (which would reach Ray)."""
    settings, message = MISTAKES[mistake]
    _readme_script(tmp_path, settings)
    code = compile((tmp_path / "script.py").read_text(), "script.py", "exec")
    with pytest.raises(ValueError) as raised:
        exec(code, {"__name__": "__main__"})
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value), str(raised.value)
    frames = [(f.filename, f.name) for f in traceback.extract_tb(raised.tb)][1:]  # from the block's own frame
    assert [name for _, name in frames] == ["<module>", "check_gradmon"], frames
    assert frames[0][0] == "script.py", frames


ENV_NOT_YET = """\
import gymnasium as gym
import ray
from ray.tune.registry import register_env
def _cartpole_not_yet(cfg):  # as an env that needs the cluster (a simulator service, say)
    if not ray.is_initialized():
        raise RuntimeError("this env needs the Ray cluster")
    return gym.make("CartPole-v1")
register_env("CartPoleNotYet", _cartpole_not_yet)
"""


def test_a_learner_actor_that_fails_to_build_ends_the_script_promptly(tmp_path):
    """With a remote learner the regex error comes back as RLlib's ``RayTaskError`` (no gradmon code
    runs on the driver between), and the half-built ``LearnerGroup`` it holds used to start a second
    local Ray at interpreter exit and hang there.  The script starts its own Ray, as a user's does
    (the shared one would be reconnected to instead): it ends, and starts Ray once."""
    argv = _readme_script(
        tmp_path,
        '{"heads": {"pi": r"^nomatch\\."}}',
        ("num_learners=0", "num_learners=1"),
        ('.environment("CartPole-v1")', '.environment("CartPoleNotYet").env_runners(num_env_runners=0)'),
    )
    # An env the driver cannot make when check_gradmon runs (check_gradmon then leaves the modules to the
    # learner): the regex error is the remote learner's.
    script = tmp_path / "script.py"
    script.write_text(ENV_NOT_YET + script.read_text())
    rc, output, _ = _run_script(argv, tmp_path, clean_env(), 120)
    assert rc == 1 and "matches no trainable parameter" in _last_line(output), output[-3000:]
    assert output.count("Started a local Ray instance") == 1, output[-3000:]
