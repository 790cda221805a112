"""``ModuleTelemetry.record_latch_inputs`` / ``flush_latch_inputs``: the drop-in's latches see, once
per step, exactly the per-head log-probs and loss mask that a per-minibatch computation gives.

Oracle: numpy's log-softmax of each head's slice of each minibatch's logits at the taken action
(the heads' sizes from the action space), concatenated by hand; the mask likewise (all-True for a
minibatch without one).  Bugs this catches: minibatches concatenated in another order than the
actions (a Dict's leaves cat'ed out of step), a mask dropped or misaligned when only some
minibatches have one, a head's slice taken from the wrong columns, records not cleared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.rllib.arms import drop_in, small_config


@pytest.fixture(scope="module")
def monitor_and_module():
    learner = drop_in(small_config(1, minibatches=2))
    module_id = next(iter(learner.gradmon_modules))
    yield learner.gradmon_modules[module_id], learner.module[module_id].unwrapped()
    learner.shutdown()


def _numpy_logp(logits: np.ndarray, actions: dict[str, np.ndarray], sizes: dict[str, int]) -> np.ndarray:
    out, start = [], 0
    for head, size in sizes.items():  # the Dict space's keys, sorted (the logits' order)
        z = logits[:, start : start + size].astype(np.float64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        out.append(z[np.arange(len(z)), actions[head]] - lse)
        start += size
    return np.stack(out, axis=1)


def test_one_flush_gives_the_concatenated_per_minibatch_log_probs_and_masks(monitor_and_module, monkeypatch):
    monitor, module = monitor_and_module
    sizes = {head: int(module.action_space[head].n) for head in sorted(module.action_space.spaces)}
    gen = torch.Generator().manual_seed(7)
    rows = [5, 3, 4]
    masks = [None, torch.tensor([True, False, True]), None]
    logits = [torch.randn(n, sum(sizes.values()), generator=gen) for n in rows]
    actions = [{h: torch.randint(0, k, (n,), generator=gen) for h, k in sizes.items()} for n in rows]
    handed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    monkeypatch.setattr(monitor.accumulator, "add_logp", lambda logp, mask=None: handed.append((logp, mask)))
    for x, a, m in zip(logits, actions, masks, strict=True):
        monitor.record_latch_inputs(x, a, m)
    monitor.flush_latch_inputs()
    monitor.flush_latch_inputs()  # nothing recorded since: hands nothing
    assert len(handed) == 1
    logp, mask = handed[0]
    want = np.concatenate(
        [
            _numpy_logp(x.numpy(), {h: v.numpy() for h, v in a.items()}, sizes)
            for x, a in zip(logits, actions, strict=True)
        ]
    )
    np.testing.assert_allclose(logp.numpy(), want, rtol=1e-5, atol=1e-6)
    assert mask.tolist() == [True] * 5 + [True, False, True] + [True] * 4


def test_minibatches_without_masks_hand_no_mask(monitor_and_module, monkeypatch):
    monitor, module = monitor_and_module
    width = sum(int(module.action_space[h].n) for h in module.action_space.spaces)
    handed: list[torch.Tensor | None] = []
    monkeypatch.setattr(monitor.accumulator, "add_logp", lambda logp, mask=None: handed.append(mask))
    for n in (2, 3):
        acts = {h: torch.zeros(n, dtype=torch.long) for h in module.action_space.spaces}
        monitor.record_latch_inputs(torch.zeros(n, width), acts, None)
    monitor.flush_latch_inputs()
    assert handed == [None]
