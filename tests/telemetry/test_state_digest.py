"""state_digest: equal states digest alike whatever container type carried them; any change shows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from gradmon_ray.telemetry.state_digest import state_digest


def _state() -> dict:
    return {
        "latched": {"op": True, "slot": False},
        "prev": [0.5, float("nan")],
        "iteration": 7,
        "ema": torch.tensor([1.0, 2.0]),
        "first": None,
        "name": "vgs",
    }


def test_worked_answer_for_a_single_array():
    array = np.array([1.5, -2.0], dtype="<f8")
    expected = hashlib.sha256(b"<f8(2,)" + array.tobytes()).hexdigest()
    assert state_digest(array) == expected
    assert state_digest(torch.tensor([1.5, -2.0], dtype=torch.float64)) == expected  # tensor == its numpy


def test_key_order_and_numpy_round_trip_do_not_matter():
    a = _state()
    b = dict(reversed(list(a.items())))
    b["ema"] = a["ema"].numpy().copy()  # what a pickle/numpy round trip may hand back
    b["iteration"] = np.int64(7)
    assert state_digest(a) == state_digest(b)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["latched"].update(slot=True),
        lambda s: s["prev"].__setitem__(0, 0.5000001),
        lambda s: s.__setitem__("iteration", 8),
        lambda s: s.__setitem__("ema", torch.tensor([1.0, 2.0], dtype=torch.float64)),  # dtype counts
        lambda s: s.__setitem__("ema", torch.tensor([[1.0, 2.0]])),  # shape counts
        lambda s: s.__setitem__("first", 0),
        lambda s: s.pop("name"),
    ],
)
def test_any_change_changes_the_digest(change):
    changed = _state()
    change(changed)
    assert state_digest(changed) != state_digest(_state())


def test_unknown_objects_are_refused():
    with pytest.raises(TypeError, match="cannot digest"):
        state_digest({"x": object()})


def test_mixed_type_keys_are_ordered_by_their_text_worked_answer():
    """Keys of different types sort by ``str(key)`` ("1" < "b"), so the digest does not depend on the
    insertion order and never compares an int with a str; built by hand from the documented feed."""
    expected = hashlib.sha256()
    expected.update(b"{")
    expected.update(repr("1").encode())
    expected.update(repr("a").encode())
    expected.update(repr("b").encode())
    expected.update(f"{np.dtype(np.int64).str}(1,)".encode())  # a scalar is fed as a 1-element int64 array
    expected.update((2).to_bytes(8, "little" if np.dtype(np.int64).str[0] == "<" else "big"))
    expected.update(b"}")
    assert state_digest({1: "a", "b": 2}) == expected.hexdigest()
    assert state_digest({"b": 2, 1: "a"}) == expected.hexdigest()
