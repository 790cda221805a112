"""Observe-only: with VGS off, ``with_gradmon(L)`` trains bit for bit like ``L`` (issue 26, item 3).

Each case builds RLlib's stock learner and its ``with_gradmon`` twin from one config, copies the
stock module's initial state into the twin, samples ONE batch, and feeds both arms deep copies of
it for several multi-epoch updates with RLlib's per-epoch minibatch shuffle.  Before each arm's
update the global RNGs are seeded alike: RLlib shuffles with ``np.random.permutation``, so both
arms see the same permutations unless gradmon draws numbers of its own (asserted too).  After
every update, every module weight, optimizer state tensor and hyperparameter, KL coefficient and
torch lr scheduler state must be ``torch.equal`` (the oracle is the stock learner itself).

The one intended difference, and the differences by design, are in
``test_observe_only_differences.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from gradmon_ray.rllib import with_gradmon
from tests.peer.pairs import (
    ALGOS,
    THREADED,
    build_pair,
    cartpole_config,
    first_difference,
    gradmon_twin,
    learner_tensors,
    peek,
    sample_batch,
    seeded_update,
    shutdown_all,
)
from tests.peer.user_learners import FusedAdamPPOLearner, RecordingPPOLearner

LOSS_KEYS = ("total_loss", "policy_loss", "vf_loss", "entropy", "mean_kl_loss", "curr_kl_coeff")
"""RLlib's own per-module results that must match too (PPO and the IMPALA family log these)."""


@dataclass(frozen=True)
class Case:
    """One observe-only scenario: a config, and how many multi-epoch updates to compare."""

    name: str
    algo: str = "ppo"
    training: dict[str, Any] = field(default_factory=dict)
    experimental: dict[str, Any] = field(default_factory=dict)
    framework: dict[str, Any] = field(default_factory=dict)
    agents: int = 0
    updates: int = 3
    learner: type | None = None
    """A user's learner class (default: RLlib's for ``algo``)."""


MINIBATCHES = {"num_epochs": 2, "minibatch_size": 32, "shuffle_batch_per_epoch": True}
"""Every update: 2 epochs of 32-row minibatches, reshuffled per epoch (RLlib's PPO default shape)."""

CASES = [
    Case("ppo grad_clip=None", training={"grad_clip": None}),
    # Clip values far below CartPole's gradient norms (0.1 to 5), so every clip mode binds.
    Case("ppo grad_clip_by=value", training={"grad_clip": 0.002, "grad_clip_by": "value"}),
    Case("ppo grad_clip_by=norm", training={"grad_clip": 0.01, "grad_clip_by": "norm"}),
    Case("ppo grad_clip_by=global_norm", training={"grad_clip": 0.01, "grad_clip_by": "global_norm"}),
    # Timesteps passed to update: 1, 2, 3 x the batch (~70 each): the lr moves every update.
    Case("ppo lr schedule", training={"lr": [[0, 1e-3], [400, 1e-4]], "grad_clip": 0.5}),
    Case(
        "ppo _torch_lr_scheduler_classes",
        training={"lr": 1e-3},
        experimental={
            "_torch_lr_scheduler_classes": [functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)]
        },
    ),
    Case("ppo two modules", agents=2, training={"grad_clip": 0.5, "grad_clip_by": "global_norm"}),
    # No NaN here: the skip machinery (one host check; fused Adam's found_inf) must not change a step.
    Case("ppo torch_skip_nan_gradients", training={"grad_clip": 0.01}, framework={"torch_skip_nan_gradients": True}),
    Case(
        "ppo fused Adam, torch_skip_nan_gradients",
        training={"grad_clip": 0.01},
        framework={"torch_skip_nan_gradients": True},
        learner=FusedAdamPPOLearner,
    ),
    # IMPALA family: minibatches of two 32-step rollout fragments.
    Case("appo global_norm", algo="appo", training={"grad_clip": 0.01, "grad_clip_by": "global_norm"}),
    Case("impala global_norm", algo="impala", training={"grad_clip": 0.01, "grad_clip_by": "global_norm"}),
]


def _update_kwargs(algo: str) -> dict[str, Any]:
    # IMPALA's loss cuts a minibatch into rollout fragments (32 steps): 64 rows = 2 fragments.
    return {**MINIBATCHES, "minibatch_size": 64} if algo in THREADED else dict(MINIBATCHES)


def _run_case(case: Case) -> None:
    """Assert ``case`` is bit for bit, naming the case, the update and the first differing entry."""
    config = cartpole_config(
        case.algo,
        case.learner or ALGOS[case.algo][1],
        agents=case.agents,
        training={"train_batch_size_per_learner": 64, **case.training},
        experimental=case.experimental,
        framework=case.framework,
    )
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        assert first_difference(learner_tensors(stock), learner_tensors(wrapped)) is None, case.name
        batch = sample_batch(config, stock, num_timesteps=64)
        for step in range(1, case.updates + 1):
            results = {}
            rng_after = {}
            for arm, learner in (("stock", stock), ("wrapped", wrapped)):
                results[arm] = seeded_update(
                    learner, case.algo, batch, seed=1000 + step, step=step, **_update_kwargs(case.algo)
                )
                rng_after[arm] = np.random.get_state()[2]  # how far the shuffle RNG moved
            diff = first_difference(learner_tensors(stock), learner_tensors(wrapped))
            assert diff is None, f"{case.name}, after update {step}: {diff}"
            assert rng_after["stock"] == rng_after["wrapped"], f"{case.name}: gradmon drew from np.random"
            for mid in stock.module.keys():  # noqa: SIM118
                ours, theirs = peek(results["wrapped"], mid), peek(results["stock"], mid)
                assert ours["update/minibatches"] == theirs["num_module_steps_trained"] / _rows(case)
                for key in LOSS_KEYS:
                    if key in theirs:
                        assert ours[key] == theirs[key], f"{case.name}, update {step}, {mid}: {key}"
    finally:
        shutdown_all([stock, wrapped])


def _rows(case: Case) -> int:
    return _update_kwargs(case.algo)["minibatch_size"]


def test_observe_only_ppo_bit_for_bit() -> None:
    """Every PPO case (in-process, no Ray): weights and optimizer state equal after each update."""
    for case in CASES:
        if case.algo not in THREADED:
            _run_case(case)


@pytest.mark.e2e
def test_observe_only_impala_family_bit_for_bit(ray_session) -> None:
    """APPO and IMPALA cases (their learner thread ``ray.put``s the weights: needs Ray)."""
    for case in CASES:
        if case.algo in THREADED:
            _run_case(case)


def test_case_list_covers_the_issue() -> None:
    """The list holds what issue 26 item 3 names (a case removed by mistake fails here)."""
    clip_modes = {c.training.get("grad_clip_by") for c in CASES if c.algo == "ppo" and c.training.get("grad_clip")}
    assert clip_modes >= {"value", "norm", "global_norm"}
    assert any(c.training.get("grad_clip", 0.3) is None for c in CASES)
    assert any(isinstance(c.training.get("lr"), list) for c in CASES)
    assert any("_torch_lr_scheduler_classes" in c.experimental for c in CASES)
    assert any(c.agents >= 2 for c in CASES)
    assert {c.algo for c in CASES} == {"ppo", "appo", "impala"}
    assert any(c.framework.get("torch_skip_nan_gradients") for c in CASES)
    assert all(c.updates >= 3 for c in CASES) and MINIBATCHES["num_epochs"] >= 2


def test_first_difference_sees_one_ulp() -> None:
    """The comparison itself: one float32 ULP in one element, and a differing lr, are reported by name."""
    a = {"w": torch.ones(3), "lr": 1e-3}
    b = {"w": torch.tensor([1.0, float(np.nextafter(np.float32(1), np.float32(2))), 1.0]), "lr": 1e-3}
    assert first_difference(a, a) is None
    assert first_difference(a, b).startswith("w: max |stock - wrapped| = 1.192e-07 over 1 of 3")
    assert first_difference(a, {**a, "lr": 2e-3}) == "lr: stock 0.001 vs wrapped 0.002"


# --- a user's own overrides still run ---------------------------------------------------------


def test_users_own_gradient_overrides_run_under_gradmon() -> None:
    """``with_gradmon(RecordingPPOLearner)``: gradmon calls super() where RLlib expects it, so the
    user's ``postprocess_gradients_for_module`` (which halves the gradients) and ``apply_gradients``
    run as often as under the stock user learner, and training stays bit for bit."""
    config = cartpole_config(
        "ppo", RecordingPPOLearner, training={"train_batch_size_per_learner": 64, "grad_clip": 0.01}
    )
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        assert isinstance(wrapped, RecordingPPOLearner) and type(wrapped) is with_gradmon(RecordingPPOLearner)
        batch = sample_batch(config, stock, num_timesteps=64)
        for step in (1, 2, 3):
            for learner in (stock, wrapped):
                seeded_update(learner, "ppo", batch, seed=step, step=step, **MINIBATCHES)
            diff = first_difference(learner_tensors(stock), learner_tensors(wrapped))
            assert diff is None, f"user learner, after update {step}: {diff}"
        assert wrapped.calls == stock.calls
        # RLlib's own count: one postprocess and one apply per minibatch (one module).
        assert stock.calls["apply_gradients"] == stock.calls["postprocess_gradients_for_module"] >= 3 * 2 * 2
    finally:
        shutdown_all([stock, wrapped])
