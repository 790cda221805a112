"""Observe-only: with VGS off, ``with_gradmon(L)`` trains bit for bit like ``L`` (issue 26, item 3).

Each case builds RLlib's stock learner and its ``with_gradmon`` twin from one config, copies the
stock module's initial state into the twin, samples ONE batch, and feeds both arms deep copies of
it for several multi-epoch updates with RLlib's per-epoch minibatch shuffle.  Before each arm's
update the global RNGs are seeded alike: RLlib shuffles with ``np.random.permutation``, so both
arms see the same permutations unless gradmon draws numbers of its own (asserted too).  After
every update, every module weight, optimizer state tensor and hyperparameter, KL coefficient and
torch lr scheduler state must be ``torch.equal`` (the oracle is the stock learner itself).

The one intended difference (``torch_skip_nan_gradients=True``: gradmon really skips a non-finite
minibatch, stock RLlib 2.60 steps on it) is shown with stock RLlib's behaviour beside it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID as MID
from ray.rllib.policy.sample_batch import MultiAgentBatch, concat_samples
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import ModuleID, ParamDict

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
    spaces_of,
    weights_and_optimizer,
)

LOSS_KEYS = ("total_loss", "policy_loss", "vf_loss", "entropy", "mean_kl_loss", "curr_kl_coeff")
"""RLlib's own per-module results that must match too (PPO and the IMPALA family log these)."""


@dataclass(frozen=True)
class Case:
    """One observe-only scenario: a config, and how many multi-epoch updates to compare."""

    name: str
    algo: str = "ppo"
    training: dict[str, Any] = field(default_factory=dict)
    experimental: dict[str, Any] = field(default_factory=dict)
    agents: int = 0
    updates: int = 3


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
    # IMPALA family: minibatches of two 32-step fragments; 2 updates (each waits for its thread).
    Case("appo global_norm", algo="appo", training={"grad_clip": 0.01, "grad_clip_by": "global_norm"}, updates=2),
    Case("impala global_norm", algo="impala", training={"grad_clip": 0.01, "grad_clip_by": "global_norm"}, updates=2),
]


def _update_kwargs(algo: str) -> dict[str, Any]:
    # IMPALA's loss cuts a minibatch into rollout fragments (32 steps): 64 rows = 2 fragments.
    return {**MINIBATCHES, "minibatch_size": 64} if algo in THREADED else dict(MINIBATCHES)


def _run_case(case: Case) -> None:
    """Assert ``case`` is bit for bit, naming the case, the update and the first differing entry."""
    config = cartpole_config(
        case.algo,
        ALGOS[case.algo][1],
        agents=case.agents,
        training={"train_batch_size_per_learner": 64, **case.training},
        experimental=case.experimental,
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
    assert all(c.updates >= 2 for c in CASES) and MINIBATCHES["num_epochs"] >= 2


def test_first_difference_sees_one_ulp() -> None:
    """The comparison itself: one float32 ULP in one element, and a differing lr, are reported by name."""
    a = {"w": torch.ones(3), "lr": 1e-3}
    b = {"w": torch.tensor([1.0, float(np.nextafter(np.float32(1), np.float32(2))), 1.0]), "lr": 1e-3}
    assert first_difference(a, a) is None
    assert first_difference(a, b).startswith("w: max |stock - wrapped| = 1.192e-07 over 1 of 3")
    assert first_difference(a, {**a, "lr": 2e-3}) == "lr: stock 0.001 vs wrapped 0.002"


# --- a user's own overrides still run ---------------------------------------------------------


class UserPPOLearner(PPOTorchLearner):
    """A user's learner: both gradient hooks call super and record that they ran; its
    postprocessing halves the gradients, so the twin matches only if its result is applied."""

    @property
    def calls(self) -> dict[str, int]:
        """How often each override ran."""
        if not hasattr(self, "_calls"):
            self._calls = {"postprocess_gradients_for_module": 0, "apply_gradients": 0}
        return self._calls

    @override(PPOTorchLearner)
    def postprocess_gradients_for_module(
        self, *, module_id: ModuleID, config: Any = None, module_gradients_dict: ParamDict
    ) -> ParamDict:
        self.calls["postprocess_gradients_for_module"] += 1
        grads = super().postprocess_gradients_for_module(
            module_id=module_id, config=config, module_gradients_dict=module_gradients_dict
        )
        return {ref: grad * 0.5 for ref, grad in grads.items()}

    @override(PPOTorchLearner)
    def apply_gradients(self, gradients_dict: ParamDict) -> None:
        self.calls["apply_gradients"] += 1
        super().apply_gradients(gradients_dict)


def test_users_own_gradient_overrides_run_under_gradmon() -> None:
    config = cartpole_config("ppo", UserPPOLearner, training={"train_batch_size_per_learner": 64, "grad_clip": 0.01})
    stock = wrapped = None
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        assert isinstance(wrapped, UserPPOLearner) and type(wrapped) is with_gradmon(UserPPOLearner)
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


# --- the one intended difference --------------------------------------------------------------


def _poison(learner: Any, name: str, minibatch: int) -> Any:
    """A tensor hook writing NaN into element 0 of ``name``'s gradient in the ``minibatch``-th backward."""
    param = dict(learner.module[MID].unwrapped().named_parameters())[name]
    calls = itertools.count(1)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if next(calls) != minibatch:
            return grad
        poisoned = grad.clone()
        poisoned.view(-1)[0] = float("nan")
        return poisoned

    return param.register_hook(hook)


def _rows_of(batch: MultiAgentBatch, *spans: tuple[int, int]) -> MultiAgentBatch:
    rows = concat_samples([batch.policy_batches[MID][a:b] for a, b in spans])
    return MultiAgentBatch({MID: rows}, len(rows))


def test_torch_skip_nan_gradients_skips_where_stock_rllib_steps() -> None:
    """``torch_skip_nan_gradients=True``, one NaN gradient element in minibatch 2 of 3.

    Stock RLlib 2.60 neither zeroes it nor skips: Adam steps and the element's weight turns NaN.
    gradmon skips that minibatch: the twin ends exactly where a stock learner ends that trained
    on minibatches 1 and 3 only (same Adam step count and moments), and a single poisoned
    minibatch leaves its weights and optimizer state exactly as they were.
    """
    config = cartpole_config(
        "ppo",
        PPOTorchLearner,
        training={"train_batch_size_per_learner": 96, "grad_clip": 0.5},
        framework={"torch_skip_nan_gradients": True},
    )
    learners = []
    try:
        stock, wrapped = build_pair(config, gradmon_twin(config))
        reference = config.build_learner(spaces=spaces_of(config))
        reference.module.set_state(stock.module.get_state())
        learners = [stock, wrapped, reference]
        full = sample_batch(config, stock, num_timesteps=96)
        m = len(full) // 3
        batch = _rows_of(full, (0, 3 * m))
        name = next(n for n, _ in stock.module[MID].unwrapped().named_parameters() if n.startswith("pi."))
        one_epoch = {"num_epochs": 1, "minibatch_size": m, "shuffle_batch_per_epoch": False}

        handles = [_poison(learner, name, minibatch=2) for learner in (stock, wrapped)]
        stock_results = seeded_update(stock, "ppo", batch, seed=1, step=1, **one_epoch)
        wrapped_results = seeded_update(wrapped, "ppo", batch, seed=1, step=1, **one_epoch)
        seeded_update(reference, "ppo", _rows_of(batch, (0, m), (2 * m, 3 * m)), seed=1, step=1, **one_epoch)
        for handle in handles:
            handle.remove()

        # Stock RLlib stepped on the NaN: the poisoned weight is NaN and later minibatches spread it.
        stock_weight = dict(stock.module[MID].unwrapped().named_parameters())[name]
        assert torch.isnan(stock_weight.view(-1)[0])
        assert peek(stock_results, MID)["num_module_steps_trained"] == 3 * m
        # gradmon skipped exactly that minibatch and counted it.
        diff = first_difference(learner_tensors(reference), learner_tensors(wrapped))
        assert diff is None, f"gradmon's skip != training on minibatches 1 and 3: {diff}"
        logged = peek(wrapped_results, MID)
        assert (logged["update/skipped"], logged["grad/nan_count"], logged["update/minibatches"]) == (1.0, 1.0, 3.0)

        # One poisoned minibatch alone: no weight and no optimizer state moves (Adam's moments and
        # step count); RLlib's KL-coefficient rule still runs after the update, as it should.
        before = weights_and_optimizer(wrapped, clone=True)
        handle = _poison(wrapped, name, minibatch=1)
        seeded_update(wrapped, "ppo", batch, seed=2, step=2, num_epochs=1, minibatch_size=None)
        handle.remove()
        diff = first_difference(before, weights_and_optimizer(wrapped))
        assert diff is None, f"a skipped minibatch moved: {diff}"
    finally:
        shutdown_all(learners)
