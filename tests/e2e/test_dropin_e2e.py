"""The README's drop-in example (APPO, CartPole, RLlib's default module and learner settings), run
from the README's own block; and two remote APPO learners on RLlib's default modules of a
two-policy run with no head settings: one packed reduction per step, the replica checksum."""

from __future__ import annotations

import ast
import math
import time

import pytest
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib import with_gradmon
from tests.test_docs import _readme_drop_in_example

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
    ``grad/global_norm``; and hooks on ``module.pi`` / ``module.vf`` on the remote learner, whose
    squared gradients give each head's norm.  The value is read by the README's own expression.
    APPO's update is one minibatch (``minibatch_size`` None, one epoch), so gradmon's mean over the
    step's minibatches and RLlib's last-minibatch value are the same gradient; the driver averages
    both over the same updates."""

    def record_submodule_gradients(learner) -> None:
        """On the remote learner (defined here: pickled by value): tensor hooks on the parameters
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
    assert ast.unparse(train) == "result = config.build_algo().train()"
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
        # call (RLlib's root MetricsLogger merges each update's window=1 value), the clock too: the
        # first iteration with results holds steps 1..last, so the clock's mean says which last.
        last = 2 * logged[mn.TELEMETRY_ITERATION] - 1
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
