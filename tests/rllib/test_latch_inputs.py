"""The drop-in's latches and head health at the drain (``rllib.module_groups``): per module, exactly
the flags and lanes that a per-minibatch, per-module computation gives, also when modules with the
same action distribution are measured together.

Oracles: numpy's log-softmax of each head's slice of each minibatch's logits at the taken action
(the heads' sizes from the action space), NaN/Inf flags over the rows the loss mask keeps; numpy's
entropy and KL(sampling || current) per head, masked means over the last minibatch's rows.  Bugs
these catch: minibatches or modules concatenated out of step with their actions, a mask dropped or
misaligned when only some minibatches have one, a module's rows counted in another module's
segment, a head's slice taken from the wrong columns, records not cleared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradmon_ray.rllib.module_groups import health_blocks, latch_flag_blocks
from tests.rllib.arms import drop_in, small_config


@pytest.fixture(scope="module")
def three_modules():
    learner = drop_in(small_config(3, minibatches=2))
    monitors = list(learner.gradmon_modules.values())
    assert len(monitors) == 3
    yield monitors
    learner.shutdown()


def _sizes(monitor) -> dict[str, int]:
    space = monitor.rl_module.action_space
    return {head: int(space[head].n) for head in sorted(space.spaces)}  # the Dict's keys, sorted (the logits' order)


def _numpy_logp(logits: np.ndarray, actions: dict[str, np.ndarray], sizes: dict[str, int]) -> np.ndarray:
    out, start = [], 0
    with np.errstate(invalid="ignore", over="ignore"):
        for head, size in sizes.items():
            z = logits[:, start : start + size].astype(np.float64)
            top = z.max(1, keepdims=True)
            lse = np.log(np.exp(z - top).sum(1)) + top[:, 0]
            out.append(z[np.arange(len(z)), actions[head]] - lse)
            start += size
    return np.stack(out, axis=1)


def _record(monitor, rows: list[int], masks: list[torch.Tensor | None], seed: int, poison=None):
    """Record minibatches of random logits and actions; ``poison(minibatch, logits, actions)`` edits them."""
    sizes = _sizes(monitor)
    gen = torch.Generator().manual_seed(seed)
    kept = []
    for k, (n, mask) in enumerate(zip(rows, masks, strict=True)):
        logits = torch.randn(n, sum(sizes.values()), generator=gen)
        actions = {h: torch.randint(0, size, (n,), generator=gen) for h, size in sizes.items()}
        if poison is not None:
            poison(k, logits, actions)
        monitor.record_latch_inputs(logits, actions, mask)
        kept.append((logits.numpy().copy(), {h: a.numpy() for h, a in actions.items()}, mask))
    return kept


def _oracle_flags(kept, sizes) -> np.ndarray:
    logp = np.concatenate([_numpy_logp(x, a, sizes) for x, a, _ in kept])
    keep = np.concatenate([np.ones(len(x), bool) if m is None else m.numpy() for x, _, m in kept])
    logp = logp[keep]
    return np.concatenate([np.isnan(logp).any(0), np.isinf(logp).any(0)])


def _poison(head: str, column: int, kind: str, minibatch: int, row: int):
    """In ``minibatch``, ``row``: a NaN logit of ``head`` (``nan``; the test's mask drops the row for
    ``masked-nan``), or a ``-inf`` logit at the taken action (``taken-minus-inf``: log-prob -inf)."""

    def poison(k: int, logits: torch.Tensor, actions: dict[str, torch.Tensor]) -> None:
        if k != minibatch:
            return
        if kind == "taken-minus-inf":
            actions[head][row] = 0
            logits[row, column] = float("-inf")
        else:
            logits[row, column] = float("nan")

    return poison


def test_modules_with_one_distribution_are_measured_together_each_with_its_own_flags(three_modules):
    monitors = three_modules
    sizes = _sizes(monitors[0])
    assert all(_sizes(m) == sizes for m in monitors)
    heads = list(sizes)
    column = {head: sum(list(sizes.values())[:k]) for k, head in enumerate(heads)}  # each head's first column
    mask = torch.tensor([True, False, True, True])
    # At the modules' boundaries (module 0's last row, module 2's first): a segment off by a row shows.
    poisons = [
        _poison(heads[0], column[heads[0]], "nan", minibatch=1, row=3),
        _poison(heads[1], column[heads[1]], "masked-nan", minibatch=1, row=1),
        _poison(heads[2], column[heads[2]], "taken-minus-inf", minibatch=0, row=0),
    ]
    recorded = [
        _record(monitors[0], [3, 4], [None, None], seed=1, poison=poisons[0]),
        _record(monitors[1], [2, 4, 5], [None, mask, None], seed=2, poison=poisons[1]),
        _record(monitors[2], [4, 4], [None, None], seed=3, poison=poisons[2]),
    ]
    blocks = latch_flag_blocks(monitors)
    assert [indices for indices, _ in blocks] == [[0, 1, 2]]  # one group: one log-softmax for all
    got = torch.cat(blocks[0][1]).reshape(3, -1).numpy()
    for k, kept in enumerate(recorded):
        np.testing.assert_array_equal(got[k], _oracle_flags(kept, sizes), err_msg=f"module {k}")
    assert got[0, 0] and not got[1].any() and got[2, len(heads) + 2]  # the poisons above, by hand
    assert [indices for indices, _ in latch_flag_blocks(monitors)] == [[0], [1], [2]]  # records cleared


def test_a_module_alone_gets_the_single_module_flags(three_modules):
    monitors = three_modules
    sizes = _sizes(monitors[1])
    kept = _record(monitors[1], [5, 3], [None, torch.tensor([True, False, True])], seed=4)
    kept[1][0][1, 0] = float("nan")  # the oracle's copy only: row 1 is masked out anyway
    blocks = latch_flag_blocks(monitors)
    alone = [tensors for indices, tensors in blocks if indices == [1]]
    assert len(alone) == 1
    np.testing.assert_array_equal(torch.cat(alone[0]).numpy(), _oracle_flags(kept, sizes))


def _np_softmax_parts(logits: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, start = [], 0
    for size in sizes:
        z = logits[:, start : start + size].astype(np.float64)
        z = z - z.max(1, keepdims=True)
        out.append(z - np.log(np.exp(z).sum(1, keepdims=True)))
        start += size
    return out


def test_the_head_health_of_modules_measured_together_is_each_ones_masked_means(three_modules):
    monitors = three_modules
    sizes = list(_sizes(monitors[0]).values())
    gen = torch.Generator().manual_seed(9)
    masks = [None, torch.tensor([True, False, True, True, False]), torch.tensor([True, True, False])]
    last = []
    for monitor, rows, mask in zip(monitors, [4, 5, 3], masks, strict=True):
        logits, sampling = torch.randn(rows, sum(sizes), generator=gen), torch.randn(rows, sum(sizes), generator=gen)
        monitor.record_head_inputs(logits, sampling, mask)
        last.append((logits.numpy(), sampling.numpy(), np.ones(rows, bool) if mask is None else mask.numpy()))
    blocks = health_blocks(monitors)
    assert [indices for indices, _ in blocks] == [[0, 1, 2]]
    got = blocks[0][1].reshape(3, -1).numpy()
    for k, (logits, sampling, keep) in enumerate(last):
        current, before = _np_softmax_parts(logits, sizes), _np_softmax_parts(sampling, sizes)
        entropy = [-(np.exp(lp) * lp).sum(1)[keep].mean() for lp in current]
        kl = [(np.exp(lq) * (lq - lp)).sum(1)[keep].mean() for lp, lq in zip(current, before, strict=True)]
        np.testing.assert_allclose(got[k], [*entropy, *kl, 1.0, 1.0], rtol=1e-5, atol=1e-6, err_msg=f"module {k}")
