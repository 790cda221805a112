"""``distributed/agreement.py`` and the presence exchange that carries it (``gradient_average.py``).

Fast lane: the schema header's encoding (16-bit digits that add up to the schema, each learner in
its own slots) and the verdict ``check_agreement`` gives on headers summed by hand (what one SUM
all-reduce of the learners' headers returns, by construction); the deadline helpers on a stand-in
work and a blocked function.

Two real gloo processes (``two_ranks.TwoRanks``, ``e2e``): learners whose module sets differ both
raise the one line in the same exchange (neither hangs in the next collective); learners that
agree exchange once per update (twice in the first: the schema at the last agreed size, then the
marks); a learner that never joins the presence exchange, or a minibatch's average, stops the
other after ``timeout_s`` with a line naming what it waited for.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gradmon_ray.distributed.agreement import (
    MASK_BITS,
    SLOTS,
    LearnerDisagreementError,
    Schema,
    check_agreement,
    module_bit,
    run_within,
    wait_for,
)
from tests.distributed.two_ranks import STATE, TwoRanks

UPDATE = 4


def _layout(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape in shapes]


def _summed(*schemas: Schema) -> list[float]:
    """What one SUM all-reduce of learner r's ``header(world, r)`` returns, r = 0, 1, ..."""
    headers = [s.header(len(schemas), r) for r, s in enumerate(schemas)]
    return [sum(values) for values in zip(*headers, strict=True)]


# --- the schema and its header -----------------------------------------------------------------


def test_the_header_holds_this_learners_schema_in_its_own_slots_as_16_bit_digits():
    schema = Schema.of(["a", "b"], [_layout((2, 3), (3,)), _layout((4,))])
    header = schema.header(3, 1)
    assert len(header) == 3 * SLOTS
    assert header[:SLOTS] == [0.0] * SLOTS and header[2 * SLOTS :] == [0.0] * SLOTS
    own = [int(v) for v in header[SLOTS : 2 * SLOTS]]
    assert all(0 <= v < 1 << 16 for v in own)
    assert (own[0] << 32) + (own[1] << 16) + own[2] == schema.digest < 1 << 48
    assert own[3:5] == [2, 3], "2 modules, 3 parameter tensors"
    mask = (own[5] << 48) + (own[6] << 32) + (own[7] << 16) + own[8]
    assert mask == module_bit("a") | module_bit("b") == schema.mask
    assert all(bin(module_bit(n)).count("1") == 1 and module_bit(n) < 1 << MASK_BITS for n in "ab")


def test_the_digest_changes_with_order_names_shapes_and_dtypes_and_only_with_them():
    base = Schema.of(["a", "b"], [_layout((2, 3)), _layout((4,))])
    assert Schema.of(["a", "b"], [_layout((2, 3)), _layout((4,))]).digest == base.digest, "fresh tensors"
    changed = {
        "order": Schema.of(["b", "a"], [_layout((4,)), _layout((2, 3))]),
        "name": Schema.of(["a", "c"], [_layout((2, 3)), _layout((4,))]),
        "shape": Schema.of(["a", "b"], [_layout((3, 2)), _layout((4,))]),
        "dtype": Schema.of(["a", "b"], [_layout((2, 3), dtype=torch.float64), _layout((4,))]),
        "a parameter moved between modules": Schema.of(["a", "b"], [_layout((2, 3), (4,)), []]),
    }
    same = [kind for kind, schema in changed.items() if schema.digest == base.digest]
    assert not same, same


# --- the verdict on summed headers --------------------------------------------------------------


def test_agreeing_learners_pass():
    schema = Schema.of(["p0", "p1"], [_layout((2,)), _layout((3,))])
    for rank in range(3):
        check_agreement(_summed(schema, schema, schema), schema, rank, UPDATE)


def test_a_module_one_learner_lacks_is_named_on_both_in_one_line():
    three = Schema.of(["p0", "p1", "p2"], [_layout((2,)), _layout((3,)), _layout((3,))])
    two = Schema.of(["p0", "p1"], [_layout((2,)), _layout((3,))])
    summed = _summed(three, two)
    with pytest.raises(LearnerDisagreementError) as first:
        check_agreement(summed, three, 0, UPDATE)
    with pytest.raises(LearnerDisagreementError) as second:
        check_agreement(summed, two, 1, UPDATE)
    cause = "a module was added or removed on some learners only (Algorithm.add_module/remove_module reach all)"
    assert str(first.value) == (
        "gradmon: the learners disagree on the modules they average, update 4: learner 1 lacks ['p2'] (2 modules, "
        "2 parameter tensors); learner 0 (this one): 3 modules ['p0', 'p1', 'p2'], 3 parameter tensors; " + cause
    )
    assert str(second.value) == (
        "gradmon: the learners disagree on the modules they average, update 4: learner 0 has 1 module not on "
        "learner 1 (3 modules, 3 parameter tensors); learner 1 (this one): 2 modules ['p0', 'p1'], 2 parameter "
        "tensors; " + cause
    )


def test_the_same_modules_in_another_order_disagree_and_every_learner_raises():
    """Three learners, the last with its modules in another order (a flat buffer laid out
    differently would sum one module's gradient into another's): all three raise."""
    ab = Schema.of(["a", "b"], [_layout((2,)), _layout((2,))])
    ba = Schema.of(["b", "a"], [_layout((2,)), _layout((2,))])
    summed = _summed(ab, ab, ba)
    messages = []
    for rank, schema in enumerate((ab, ab, ba)):
        with pytest.raises(LearnerDisagreementError) as raised:
            check_agreement(summed, schema, rank, UPDATE)
        messages.append(str(raised.value))
    same = "has the same 2 modules in another order, or other shapes (2 modules, 2 parameter tensors)"
    assert f"update 4: learner 2 {same}; learner 0 (this one): 2 modules ['a', 'b']" in messages[0]
    assert "learner 1 " not in messages[0], "learner 1 agrees with learner 0"
    assert f"update 4: learner 0 {same}; learner 1 {same}; learner 2 (this one): 2 modules ['b', 'a']" in messages[2]
    assert all(m.endswith("; modules added in different orders or with different specs") for m in messages)
    assert all("\n" not in m for m in messages)


# --- the deadline helpers -----------------------------------------------------------------------


class _Work:
    """A stand-in ``torch.distributed`` work (pure logic: the polling loop) that completes after ``polls``."""

    def __init__(self, polls: float) -> None:
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout: object = None) -> bool:
        self.waited = True
        return True


def test_a_device_work_is_polled_until_it_completes_or_the_deadline():
    done = _Work(polls=3)
    assert wait_for(done, 5.0, host=False) and done.waited
    never = _Work(polls=float("inf"))
    start = time.monotonic()
    assert not wait_for(never, 0.2, host=False)
    assert 0.2 <= time.monotonic() - start < 1.0 and not never.waited


def test_run_within_returns_false_for_a_blocked_call_and_raises_its_error():
    release = threading.Event()
    start = time.monotonic()
    assert not run_within(release.wait, 0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    release.set()
    assert run_within(lambda: None, 1.0)

    def boom() -> None:
        raise ValueError("from the helper thread")

    with pytest.raises(ValueError, match="from the helper thread"):
        run_within(boom, 1.0)


# --- two real learners (gloo) -------------------------------------------------------------------


def _average(rank: int, names: list[str], timeout_s: float | None, grads: list[list[float] | None]) -> dict:
    """A ``ModuleGradientAverage`` of one 1-element parameter per module, with ``grads`` (None: no
    gradient), kept in ``STATE``; counts the all-reduces it makes."""
    from gradmon_ray.distributed.gradient_average import ModuleGradientAverage

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in names]
    STATE["average"] = ModuleGradientAverage([[p] for p in params], names=names, timeout_s=timeout_s)
    STATE["params"], STATE["grads"] = params, grads
    _set_grads()
    return {"rank": rank}


def _set_grads() -> None:
    for p, g in zip(STATE["params"], STATE["grads"], strict=True):
        p.grad = None if g is None else torch.tensor(g)


def _updates(rank: int, updates: int) -> dict:
    """``updates`` updates of one minibatch each: the sizes of every all-reduce, the presence and
    the averaged gradients."""
    import torch.distributed as dist

    sizes: list[int] = []
    real = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        average, out = STATE["average"], []
        for _ in range(updates):
            _set_grads()  # each update's backward: the same learners train the same modules
            average.average()
            out.append({"sizes": list(sizes), "presence": average.presence})
            sizes.clear()
            average.new_update()
        return {"updates": out, "grads": [p.grad.tolist() for p in STATE["params"]]}
    finally:
        dist.all_reduce = real


def _replace(rank: int, names: list[str] | None) -> list[str]:
    """Learner ``rank``'s average replaced by one over ``names`` (None: kept), as after an
    ``add_module``/``remove_module`` that reached only it."""
    from gradmon_ray.distributed.gradient_average import ModuleGradientAverage

    old = STATE["average"]
    if names is not None:
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in names]
        for p in params:
            p.grad = torch.ones(1)
        STATE["average"] = ModuleGradientAverage([[p] for p in params], names=names, timeout_s=5.0, follows=old)
    return list(STATE["average"].schema.names)


def _exchange_or_error(rank: int, join: bool) -> tuple[str, str, float]:
    """The next presence exchange (``join`` False: this learner stays away): what it raised, how fast."""
    start = time.monotonic()
    if not join:
        return ("stayed away", "", 0.0)
    try:
        STATE["average"].exchange_presence()
        return ("ok", "", time.monotonic() - start)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _average_or_error(rank: int, join: bool) -> tuple[str, str, float]:
    """Presence exchanged by both; then only a joining learner averages its first minibatch."""
    average = STATE["average"]
    average.exchange_presence()
    start = time.monotonic()
    if not join:
        return ("stayed away", "", 0.0)
    try:
        average.average()
        return ("ok", "", time.monotonic() - start)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - start)


@pytest.fixture(scope="module")
def ranks():
    pair = TwoRanks()
    yield pair
    pair.close()


@pytest.mark.e2e
def test_learners_that_agree_exchange_the_schema_with_the_marks_once_per_update(ranks):
    """Learner 0 trained p0 only, learner 1 both: p1's count is 1 and its mean is learner 1's
    gradient, p0's the mean of both (worked answers).  The first update sends the schemas at the
    last agreed size (0 marks: 2 x 9 header values), then the 2 marks; later updates both in one
    all-reduce of 18 + 2; each minibatch one all-reduce of the 2 gradients."""
    ranks.run(_average, (["p0", "p1"], 5.0, [[2.0], None]), (["p0", "p1"], 5.0, [[4.0], [6.0]]))
    results = ranks.run(_updates, (2,), (2,))
    for result in results:
        first, second = result["updates"]
        assert first["sizes"] == [2 * SLOTS, 2, 2] and second["sizes"] == [2 * SLOTS + 2, 2]
        assert first["presence"].param_counts == (2, 1) == second["presence"].param_counts
    assert results[0]["grads"] == results[1]["grads"] == [[3.0], [6.0]]


@pytest.mark.e2e
def test_a_learner_whose_module_set_changed_alone_stops_both_with_the_line(ranks):
    """As after an ``add_module`` that reached learner 0 only: both learners raise in the same
    exchange (neither waits in the next collective), each naming its modules and the other's."""
    ranks.run(_average, (["p0", "p1"], 5.0, [[1.0], [1.0]]), (["p0", "p1"], 5.0, [[1.0], [1.0]]))
    ranks.run(_updates, (1,), (1,))  # agreed once: the exchanges' size is now 18 + 2
    assert ranks.run(_replace, (["p0", "p1", "p2"],), (None,)) == [["p0", "p1", "p2"], ["p0", "p1"]]
    (kind0, line0, took0), (kind1, line1, took1) = ranks.run(_exchange_or_error, (True,), (True,))
    assert kind0 == kind1 == "LearnerDisagreementError", (line0, line1)
    assert max(took0, took1) < 2.0, "no wait for a timeout"
    assert line0.startswith("gradmon: the learners disagree on the modules they average, update 2: learner 1 lacks")
    assert "learner 1 lacks ['p2'] (2 modules, 2 parameter tensors); learner 0 (this one): 3 modules" in line0
    assert "learner 0 has 1 module not on learner 1 (3 modules, 3 parameter tensors); learner 1 (this one)" in line1


@pytest.mark.e2e
def test_a_learner_that_never_joins_the_presence_exchange_stops_the_other_after_the_timeout(ranks):
    # 0.5 s: no collective before the one waited for (a minibatch's average, below, keeps 1.5 s: the
    # exchange before it is joined by both, whose start may differ by a second on a loaded box)
    ranks.run(_average, (["p0", "p1"], 0.5, [[1.0], None]), (["p0", "p1"], 0.5, [[1.0], None]))
    try:
        (kind, line, took), away = ranks.run(_exchange_or_error, (True,), (False,))
    finally:
        ranks.close()  # learner 0's exchange is still pending in gloo: the next test gets a fresh world
    assert away[0] == "stayed away"
    assert kind == "CollectiveTimeoutError", line
    assert 0.5 <= took < 2.5
    assert line == (
        "gradmon: learner 0 of 2 waited 0.5 s (learner_config_dict['gradmon']['collective_timeout_s']) for the "
        "presence exchange of update 1 for modules ['p0', 'p1']; another learner never joined it (stopped, stuck, "
        "or in a different collective)"
    )


@pytest.mark.e2e
def test_a_learner_that_never_joins_a_minibatchs_average_stops_the_other_after_the_timeout(ranks):
    ranks.run(_average, (["p0", "p1"], 1.5, [[1.0], None]), (["p0", "p1"], 1.5, [[1.0], None]))
    try:
        (kind, line, took), away = ranks.run(_average_or_error, (True,), (False,))
    finally:
        ranks.close()
    assert away[0] == "stayed away" and kind == "CollectiveTimeoutError", line
    assert 1.5 <= took < 3.5
    assert (
        "waited 1.5 s" in line
        and "for the gradient average of minibatch 1 of update 1 for modules ['p0', 'p1']" in line
    )
