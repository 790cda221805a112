"""Count the aten ops, kernel-launching ops and host reads a piece of PyTorch code dispatches.

A ``TorchDispatchMode`` sees every op at the dispatcher, on any device.  On a CPU a host read
costs nothing, but the same op on a GPU waits for the device (a sync), so counting them in a
CPU update tells what a GPU update would wait for; kernel-launching ops (all but views and
allocations) tell what it would launch.  The tests and ``bench/telemetry_overhead.py`` use it.

Some host traffic never reaches the dispatcher on a CPU, where source and destination are the
same memory: ``.tolist()``, ``.numpy()``, ``.cpu()`` and a tensor made from host data on "the
device".  A ``TorchFunctionMode`` entered with the counter sees those calls as Python calls
and counts them as host reads too, as a GPU would wait for them (``HOST_CALLS``):

* device -> host: ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``, ``Tensor.to("cpu")`` (the
  string: ``.to(self.device)`` is the learner's device, a GPU in production), ``Tensor.copy_``
  into a host tensor (``.item()``, ``bool(t)``, ``float(t)`` reach the
  dispatcher as ``_local_scalar_dense`` on any device).  A tensor is a host tensor where
  ``.cpu()``/``.to("cpu")`` returned it or it was made from host data without a device
  (tracked by storage, so its views too): reading one again is no device read;
* pageable host -> device: ``torch.tensor``/``as_tensor``/``asarray`` of host data with an
  explicit ``device``, and ``Tensor.to``/``Tensor.cuda``/``Tensor.copy_`` of a tensor that
  ``torch.tensor``/``as_tensor``/``asarray`` made on the host without one (unless
  ``non_blocking=True`` from pinned memory).  ``torch.from_numpy`` is not seen (torch does not
  route it through the mode).

On a CPU ``t.cpu()`` returns ``t`` itself, which is then taken for a host tensor: a second read
of that same tensor is not counted (on a GPU it would be a second copy).

Within such a call the dispatcher's own copy is not counted again.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

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


_READS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy", torch.Tensor.cpu: "Tensor.cpu"}
_FROM_HOST_DATA = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor", torch.asarray: "torch.asarray"}
_MOVES = {torch.Tensor.to: "Tensor.to", torch.Tensor.cuda: "Tensor.cuda"}
HOST_CALLS = frozenset(
    [
        *_READS.values(),
        *(f"{name}(device=)" for name in _FROM_HOST_DATA.values()),
        *_MOVES.values(),
        "Tensor.to(cpu)",
        "Tensor.copy_",
    ]
)
"""The names under which ``OpCounter.host_reads`` counts the Python-level calls (module docstring)."""


class OpCounter(compat.torch_dispatch_mode()):
    """``with counter:`` counts every dispatched op and every host read; reusable (the counts add up)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.kernels = 0
        """Ops that launch a kernel on a GPU (not views, detaches or allocations)."""
        self.calls = 0
        """Calls counted by ``counting_calls``."""
        self._calls_mode = _HostCalls(self)
        self._inside_host_call = 0  # >0: the dispatcher's copy belongs to a counted call

    def __enter__(self) -> OpCounter:
        self._calls_mode.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._calls_mode.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._calls_mode.__exit__(*exc)

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
        if not self._inside_host_call and _reads_host(name, func, args, kwargs):
            self.host_reads[name] += 1
        return func(*args, **kwargs)


class _HostCalls(TorchFunctionMode):
    """The Python-level host reads of ``OpCounter`` (module docstring)."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter
        # Host tensors by storage address (views included): what ``torch.tensor``/``as_tensor``/
        # ``asarray`` made from host data without a device, and what ``.cpu()`` returned.  Reading
        # one is no device read; moving one to a device is a host->device copy.  A weak reference
        # tells a live storage from a freed one whose address was reused.
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def _from_host(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return False
        ref = self._host.get(t.untyped_storage().data_ptr())
        return ref is not None and ref() is not None

    def _mark_host(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._host[t.untyped_storage().data_ptr()] = weakref.ref(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        read = self._host_read(func, args, kwargs)
        if read is None:
            result = func(*args, **kwargs)
        else:
            self.counter.host_reads[read] += 1
            self.counter._inside_host_call += 1
            try:
                result = func(*args, **kwargs)
            finally:
                self.counter._inside_host_call -= 1
        if (
            func is torch.Tensor.cpu
            or read == "Tensor.to(cpu)"
            or (func in _FROM_HOST_DATA and kwargs.get("device") is None and not _is_tensor_arg(args))
        ):
            self._mark_host(result)
        return result

    def _host_read(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        if func in _READS:
            return None if self._from_host(args[0]) else _READS[func]
        if func in _FROM_HOST_DATA:
            has_device = kwargs.get("device") is not None
            return f"{_FROM_HOST_DATA[func]}(device=)" if has_device and not _is_tensor_arg(args) else None
        if func is torch.Tensor.to and args and "cpu" in (kwargs.get("device"), *args[1:]):
            # Named "cpu" in the source: the host, on any machine (``.to(self.device)`` is a
            # ``torch.device``, the learner's device on a GPU, and is not counted here).
            return None if self._from_host(args[0]) else "Tensor.to(cpu)"
        moves = func is torch.Tensor.cuda or (func is torch.Tensor.to and _target_device(args[1:], kwargs) is not None)
        if moves and args and self._from_host(args[0]):
            return None if _pinned_async(args[0], kwargs) else _MOVES[func]
        if func is torch.Tensor.copy_ and len(args) > 1 and self._from_host(args[0]) != self._from_host(args[1]):
            blocking = kwargs if len(args) < 3 else {"non_blocking": args[2]}
            host_side = args[1] if self._from_host(args[1]) else args[0]  # the pinned buffer, either way
            return None if _pinned_async(host_side, blocking) else "Tensor.copy_"
        return None


def _is_tensor_arg(args: tuple) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor)


def _target_device(args: tuple, kwargs: dict) -> str | None:
    """The device type ``Tensor.to(*args, **kwargs)`` names (None: only a dtype)."""
    for target in (kwargs.get("device"), *args):
        if isinstance(target, str | torch.device):
            return torch.device(target).type
        if isinstance(target, torch.Tensor):
            return target.device.type
    return None


def _pinned_async(src: torch.Tensor, kwargs: dict) -> bool:
    """A ``non_blocking`` copy from pinned memory: no host wait."""
    return bool(kwargs.get("non_blocking")) and src.is_pinned()


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
