"""``UpdateScaler``: an optimizer step scaled by a device-side factor, for each optimizer route.

Oracle: a twin optimizer with identical parameters and state, stepped without the factor;
the scaled step must move the parameters by exactly ``factor`` times the twin's move, leave
the optimizer's own state (moments, utilities) identical to the twin's, and hand back the
float learning rate.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradmon_ray import compat
from gradmon_ray.optim import UPGD
from gradmon_ray.optim.scaled_step import UpdateScaler, takes_tensor_lr

OPTIMIZERS = {
    "adam-fused": (lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), "lr"),
    "adam-foreach": (lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True), "snapshot"),
    "adam-single": (lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False), "lr"),
    "adamw-fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), "lr"),
    "adamw-foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), "snapshot"),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), "lr"),
    "upgd": (
        lambda ps: UPGD(ps, lr=1e-2, weight_decay=0.01, sigma=0.1, generator=torch.Generator().manual_seed(3)),
        "lr",
    ),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2), "snapshot"),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # float64: the check is then not blurred by float32 rounding of theta + delta
    shapes = [(7, 5), (5,), (3, 7)]
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)) for shape in shapes]


def _grads(params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_scaled_step_is_factor_times_the_plain_step(name):
    make, route = OPTIMIZERS[name]
    scaled_params, plain_params = _params(0), _params(0)
    scaled_opt, plain_opt = make(scaled_params), make(plain_params)
    scaler = UpdateScaler([scaled_opt])
    assert scaler.routes == {"lr": int(route == "lr"), "snapshot": int(route == "snapshot")}
    assert takes_tensor_lr(scaled_opt) == (route == "lr")
    for step in range(4):
        grads = _grads(scaled_params, seed=10 + step)
        # Both start the step from the same point: the twin copies the scaled side's state.
        plain_opt.load_state_dict(copy.deepcopy(scaled_opt.state_dict()))
        with torch.no_grad():
            for p, q in zip(plain_params, scaled_params, strict=True):
                p.copy_(q)
        before = [p.detach().clone() for p in scaled_params]
        for ps in (scaled_params, plain_params):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
        factor = torch.tensor(0.25 + 0.2 * step)
        with scaler.scaled(factor):
            scaled_opt.step()
        plain_opt.step()
        for p, q, b in zip(scaled_params, plain_params, before, strict=True):
            torch.testing.assert_close(
                p.detach() - b, float(factor) * (q.detach() - b), rtol=1e-6, atol=1e-12
            )  # the factor is float32
        assert all(isinstance(g["lr"], float) for g in scaled_opt.param_groups)
        for state_s, state_p in zip(scaled_opt.state.values(), plain_opt.state.values(), strict=True):
            for key, value in state_s.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(value, state_p[key], rtol=1e-6, atol=1e-8, msg=key)


def test_a_skipped_fused_step_stays_skipped():
    params = _params(1)
    opt = torch.optim.Adam(params, lr=1e-2, fused=True)
    for p, g in zip(params, _grads(params, 5), strict=True):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with UpdateScaler([opt]).scaled(torch.tensor(0.5)):
        compat.step_unless_found_inf(opt, torch.ones(()))  # what the learner does on a non-finite minibatch
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_factor_one_is_the_plain_step_bitwise_on_the_lr_route():
    a, b = _params(2), _params(2)
    opt_a, opt_b = torch.optim.Adam(a, lr=1e-2, fused=True), torch.optim.Adam(b, lr=1e-2, fused=True)
    for ps in (a, b):
        for p, g in zip(ps, _grads(ps, 9), strict=True):
            p.grad = g
    with UpdateScaler([opt_a]).scaled(torch.ones(())):
        opt_a.step()
    opt_b.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(a, b, strict=True))


def test_a_capturable_adam_takes_a_tensor_lr_even_with_foreach():
    """``capturable`` (like ``fused``) Adam/AdamW steps accept a tensor ``lr``; a plain foreach one does not."""
    w = torch.nn.Parameter(torch.zeros(2))
    assert takes_tensor_lr(torch.optim.Adam([w], lr=0.1, capturable=True, foreach=True)) is True
    assert takes_tensor_lr(torch.optim.AdamW([w], lr=0.1, capturable=True, foreach=True)) is True
    assert takes_tensor_lr(torch.optim.Adam([w], lr=0.1, foreach=True)) is False
    assert takes_tensor_lr(torch.optim.Adam([w], lr=0.1, foreach=False)) is True
