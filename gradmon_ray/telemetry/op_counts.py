"""Count the aten ops, kernel-launching ops and host reads a piece of PyTorch code dispatches.

A ``TorchDispatchMode`` sees every op at the dispatcher, on any device.  On a CPU a host read
costs nothing, but the same op on a GPU waits for the device (a sync), so counting them in a
CPU update tells what a GPU update would wait for; kernel-launching ops (all but views and
allocations) tell what it would launch.  The tests and ``bench/telemetry_overhead.py`` use it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradmon_ray import compat

HOST_READ_OPS = frozenset(
    {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::masked_select"}
)
"""Ops that read device data on the host: ``.item()``, ``bool(t)``, ``float(t)``, ``t.nonzero()``, ..."""
BOOL_INDEX_OPS = frozenset({"aten::index", "aten::index_put", "aten::index_put_"})
"""Indexing ops that read the device when an index is a bool mask (its ``nonzero`` sets the output
shape): RLlib's ``data[mask]``.  On a CPU their inner ``nonzero`` is not dispatched, so it is
counted here."""
NO_KERNEL_OPS = frozenset(
    {
        "aten::detach",
        "aten::lift_fresh",
        "aten::empty",
        "aten::new_empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::scalar_tensor",
    }
)
"""Ops that launch no kernel besides views: detaching, wrapping and allocating (``scalar_tensor``
wraps a Python number, e.g. ``where(m, x, 0.0)``'s ``0.0``, as a host scalar the kernel takes as
an argument)."""


class OpCounter(compat.torch_dispatch_mode()):
    """``with counter:`` counts every dispatched op; reusable (the counts add up)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.kernels = 0
        """Ops that launch a kernel on a GPU (not views, detaches or allocations)."""
        self.calls = 0
        """Calls counted by ``counting_calls``."""

    @property
    def ops(self) -> int:
        return sum(self.by_name.values())

    @property
    def num_host_reads(self) -> int:
        return sum(self.host_reads.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = f"{func.namespace}::{func.__name__.split('.')[0]}"  # the overload packet, e.g. aten::index
        self.by_name[name] += 1
        if not (func.is_view or name in NO_KERNEL_OPS):
            self.kernels += 1
        if _reads_host(name, func, args, kwargs):
            self.host_reads[name] += 1
        return func(*args, **kwargs)


def _reads_host(name: str, func: Any, args: tuple, kwargs: dict) -> bool:
    if name in HOST_READ_OPS:
        return True
    if name in BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name in ("aten::_to_copy", "aten::copy_"):  # a copy from a device to the host
        src = args[0] if name == "aten::_to_copy" else args[1]
        dst = kwargs.get("device") if name == "aten::_to_copy" else args[0].device
        return (
            isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst or src.device).type == "cpu"
        )
    return False


@contextmanager
def counting_calls(obj: Any, method: str, counter: OpCounter) -> Iterator[OpCounter]:
    """While open, every call of ``obj.<method>`` (in any thread) runs under ``counter``."""
    original: Callable[..., Any] = getattr(obj, method)
    own = method in vars(obj)  # an instance attribute already (put it back), or the class's

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        with counter:
            return original(*args, **kwargs)

    setattr(obj, method, counted)
    try:
        yield counter
    finally:
        if own:
            setattr(obj, method, original)
        else:
            delattr(obj, method)
