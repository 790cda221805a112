"""``distributed/gradient_average.py`` on a real one-process gloo world: presence marks, the
divisor per module (numpy oracle), missing gradients filled and returned, one all-reduce per
device and dtype, and the local gradients ``before_reduce`` sees.

With one process the SUM all-reduce is the identity, so after ``average`` every gradient is
exactly what this learner contributes: its local gradient (zeros where it has none) divided by
the number of learners that trained its module.  Where a test needs other learners, it sets the
``Presence`` those learners' marks would have produced (``exchange_presence`` itself is tested
on its own).  The last test runs two real processes (``two_ranks.py``) with different local
gradients and partial presence, every expected value written out; RLlib learners on two
processes: tests/rllib/test_module_sync.py, on Ray: tests/e2e/test_sparse_agents_e2e.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradmon_ray.distributed.gradient_average import ModuleGradientAverage, Presence
from tests.distributed.two_ranks import TwoRanks


def _param(n: int, grad: list[float] | None, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    if grad is not None:
        p.grad = torch.tensor(grad, dtype=dtype)
    return p


def _count_all_reduces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Every ``torch.distributed.all_reduce`` (dtype, size), calling through to the real one."""
    calls: list[tuple[torch.dtype, int]] = []
    real = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    return calls


def test_presence_marks_per_parameter_and_module_and_untrained_stay_none(world):
    """Module 0 has a gradient on one of its two parameters, module 1 on none, module 2 on its
    only one: the module counts are 1, 0, 1 (a module counts as trained when ANY of its
    parameters got a gradient), nothing is filled (no learner gave b or c a gradient), and the
    trained gradients are unchanged (divided by 1 learner, summed over 1)."""
    a, b, c, d = _param(2, [1.0, -2.0]), _param(3, None), _param(1, None), _param(2, [0.5, 4.0])
    average = ModuleGradientAverage([[a, b], [c], [d]])
    assert average.presence is None
    assert average.exchange_presence() == Presence((1, 0, 0, 1), (1, 0, 1))
    assert average.average() == []
    assert b.grad is None and c.grad is None
    assert a.grad.tolist() == [1.0, -2.0] and d.grad.tolist() == [0.5, 4.0]


def test_each_module_divided_by_its_own_learner_count_missing_filled_and_returned(world):
    """Five modules trained by 2, 2, 3, 1 and 3 learners (the presence 3 learners' marks give),
    several parameters each (so equal divisors of neighbouring modules merge into one run):
    every gradient is this learner's local one / its module's count (numpy), a parameter with
    no local gradient that another learner trained is filled (zeros / count, the parameter's
    shape and dtype) and returned; one no learner trained stays None and is not returned."""
    rng = np.random.default_rng(0)
    sizes = [[3, 2], [4], [1, 5, 2], [2, 2], [3]]
    counts = [2, 2, 3, 1, 3]
    missing = {(1, 0), (2, 1), (4, 0)}  # (module, param) with no local gradient
    params, local = [], {}
    for m, shape in enumerate(sizes):
        params.append([])
        for j, n in enumerate(shape):
            values = None if (m, j) in missing else rng.normal(size=n).astype(np.float32)
            params[m].append(_param(n, None if values is None else values.tolist()))
            local[(m, j)] = values
    untrained = _param(2, None)
    params[3].append(untrained)  # module 3: trained by 1 learner, this parameter by none
    average = ModuleGradientAverage(params)
    param_counts = tuple(0 if p is untrained else counts[m] for m, ps in enumerate(params) for p in ps)
    average.presence = Presence(param_counts, tuple(counts))
    filled = average.average()
    assert [id(p) for p in filled] == [id(params[m][j]) for m, j in sorted(missing)]
    for (m, j), values in local.items():
        p = params[m][j]
        expected = (np.zeros(sizes[m][j], np.float32) if values is None else values) / np.float32(counts[m])
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
        np.testing.assert_array_equal(p.grad.numpy(), expected, err_msg=str((m, j)))
    assert untrained.grad is None


def test_the_presence_lasts_the_update_and_new_update_exchanges_it_again(world, monkeypatch):
    """``average`` exchanges the presence once per update (the minibatches after the first reuse
    it: one small SUM, not one per minibatch); ``new_update`` forgets it, so the next update
    exchanges again and sees that the module it trained before is missing now."""
    a, b = _param(2, [1.0, 2.0]), _param(1, [3.0])
    average = ModuleGradientAverage([[a], [b]])
    calls = _count_all_reduces(monkeypatch)
    average.average()
    average.average()
    assert [n for _, n in calls] == [2, 3, 3], "presence (2 marks) once, then one reduce per minibatch"
    average.new_update()
    assert average.presence is None
    b.grad = None  # the next update's shard has no sample of b's module
    assert average.average() == [] and average.presence == Presence((1, 0), (1, 0))
    assert b.grad is None, "not filled: nobody trained it this update"


def test_one_all_reduce_per_dtype_and_filled_gradients_keep_their_dtype(world, monkeypatch):
    """A float64 module and a float32 one: two all-reduces (one per dtype), each gradient keeps
    its parameter's dtype and its exact value / count; a filled float64 gradient is float64."""
    wide = [_param(2, [1.0, 3.0], torch.float64), _param(3, None, torch.float64)]
    narrow = [_param(2, [0.1, 0.2])]
    average = ModuleGradientAverage([wide, narrow])
    average.presence = Presence((2, 1, 1), (2, 1))
    calls = _count_all_reduces(monkeypatch)
    filled = average.average()
    assert sorted(calls, key=str) == sorted([(torch.float64, 5), (torch.float32, 2)], key=str)
    assert filled == [wide[1]]
    assert wide[0].grad.dtype == wide[1].grad.dtype == torch.float64 and narrow[0].grad.dtype == torch.float32
    assert wide[0].grad.tolist() == [0.5, 1.5] and wide[1].grad.tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(narrow[0].grad.numpy(), np.array([0.1, 0.2], np.float32))


def test_before_reduce_sees_each_modules_local_gradients_before_the_average(world):
    """The gradient noise scale needs every learner's LOCAL gradient: ``before_reduce`` gets, per
    module with a local gradient, its index, the parameters that have one and their gradients as
    backward left them (not yet divided by the learner count)."""
    a, b, c, d = _param(2, [2.0, 4.0]), _param(1, None), _param(1, [6.0]), _param(2, None)
    average = ModuleGradientAverage([[a, b], [c], [d]])
    average.presence = Presence((2, 1, 3, 0), (2, 3, 0))
    seen = []
    average.average(lambda m, ps, gs: seen.append((m, [id(p) for p in ps], [g.tolist() for g in gs])))
    assert seen == [(0, [id(a)], [[2.0, 4.0]]), (1, [id(c)], [[6.0]])]
    assert a.grad.tolist() == [1.0, 2.0] and c.grad.tolist() == [2.0]


def test_the_cached_presence_marks_survive_the_in_place_sum(world, monkeypatch):
    """The presence marks are built once per pattern and summed in place every update: the sum
    must act on a copy.  Two learners that both trained every parameter (the all-reduce stood in
    by doubling: a one-process SUM changes nothing) report 2 in the second update as in the first.
    Oracle: world size x local presence."""
    a, b = _param(2, [1.0, 2.0]), _param(1, [3.0])
    average = ModuleGradientAverage([[a], [b]])
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: tensor.mul_(2))
    first = average.exchange_presence()
    average.new_update()
    second = average.exchange_presence()
    assert first == second == Presence((2, 2), (2, 2))


# --- two real processes ------------------------------------------------------------------------
# Ranks 0 and 1 of one gloo world (tests/distributed/two_ranks.py) hold DIFFERENT local gradients
# and only partly the same modules; every expected value below is written out by hand.

LOCAL = {
    # name: (module, size, rank 0's local gradient, rank 1's; None: no gradient on that rank)
    "a1": (0, 2, [1.0, -2.0], [3.0, 6.0]),
    "a2": (0, 1, [4.0], None),
    "b": (1, 2, [5.0, -1.0], None),
    "c": (2, 2, None, [0.5, 8.0]),
    "d": (3, 3, None, None),
    "e": (4, 2, [1.0, 2.0], [2.0, -6.0]),  # float64
}
SECOND_UPDATE = {"b": ([5.0, -1.0], [1.0, 1.0]), "c": (None, [0.5, 8.0])}
"""Update 2: both ranks train module 1, rank 1 alone module 2; nobody modules 0, 3, 4."""


def _average_once(average: ModuleGradientAverage, params: dict[str, torch.nn.Parameter]) -> dict:
    """One ``average``: what ``before_reduce`` saw, the presence, the filled parameters' names and
    every gradient after it (lists; None: no gradient)."""
    name_of = {id(p): n for n, p in params.items()}
    seen: list[tuple[int, list[str], list[list[float]]]] = []
    filled = average.average(lambda m, ps, gs: seen.append((m, [name_of[id(p)] for p in ps], [g.tolist() for g in gs])))
    return {
        "seen": seen,
        "presence": average.presence,
        "filled": [name_of[id(p)] for p in filled],
        "grads": {n: None if p.grad is None else p.grad.tolist() for n, p in params.items()},
        "dtypes": {n: str(p.grad.dtype) for n, p in params.items() if id(p) in {id(f) for f in filled}},
    }


def _two_rank_average(rank: int) -> list[dict]:
    """``ModuleGradientAverage`` over modules [a1, a2], [b], [c], [d], [e] on this rank: update 1
    (``LOCAL``), then update 2 (``SECOND_UPDATE``)."""
    params = {}
    for name, (_, size, *local) in LOCAL.items():
        params[name] = _param(size, local[rank], torch.float64 if name == "e" else torch.float32)
    modules = [[params[n] for n, entry in LOCAL.items() if entry[0] == m] for m in range(5)]
    average = ModuleGradientAverage(modules)
    first = _average_once(average, params)
    average.new_update()
    for name, p in params.items():
        local = SECOND_UPDATE.get(name, (None, None))[rank]
        p.grad = None if local is None else torch.tensor(local, dtype=p.dtype)
    return [first, _average_once(average, params)]


@pytest.fixture(scope="module")
def two_ranks():
    ranks = TwoRanks(preload=[__name__])
    try:
        yield ranks
    finally:
        ranks.close()


@pytest.mark.e2e  # two processes
def test_two_learners_average_each_module_over_the_learners_that_trained_it(two_ranks):
    """Both ranks end with the same gradients, each module's the mean over the learners that
    trained it (by hand: a1 (1, -2) and (3, 6) -> (2, 2); a2 trained on rank 0 only but its
    module on both -> (4 + 0) / 2; b on rank 0 only -> itself, filled on rank 1; c on rank 1 only
    -> itself, filled on rank 0; d nobody's -> None; e (float64) -> (1.5, -2)).  ``before_reduce``
    saw each rank's own local gradients.  Update 2 exchanges the presence again: module 1 now on
    both -> b = ((5, -1) + (1, 1)) / 2, module 2 on rank 1 only, the others nobody's (None)."""
    ranks = two_ranks.run(_two_rank_average)
    first = {"a1": [2.0, 2.0], "a2": [2.0], "b": [5.0, -1.0], "c": [0.5, 8.0], "d": None, "e": [1.5, -2.0]}
    second = {"a1": None, "a2": None, "b": [3.0, 0.0], "c": [0.5, 8.0], "d": None, "e": None}
    seen = [
        [(0, ["a1", "a2"], [[1.0, -2.0], [4.0]]), (1, ["b"], [[5.0, -1.0]]), (4, ["e"], [[1.0, 2.0]])],
        [(0, ["a1"], [[3.0, 6.0]]), (2, ["c"], [[0.5, 8.0]]), (4, ["e"], [[2.0, -6.0]])],
    ]
    filled = [["c"], ["a2", "b"]]
    for rank, (update1, update2) in enumerate(ranks):
        assert update1["presence"] == Presence((2, 1, 1, 1, 0, 2), (2, 1, 1, 0, 2)), rank
        assert update1["grads"] == first, rank
        assert update1["seen"] == seen[rank], rank
        assert update1["filled"] == filled[rank], rank
        assert set(update1["dtypes"].values()) == {"torch.float32"}, rank
        assert update2["presence"] == Presence((0, 0, 2, 1, 0, 0), (0, 2, 1, 0, 0)), rank
        assert update2["grads"] == second, rank
        assert update2["filled"] == ([] if rank else ["c"]), rank
