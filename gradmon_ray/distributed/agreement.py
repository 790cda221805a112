"""Learners that disagree get a named error, not a hang (ray-project/ray#63819).

Two guards for the learners' collectives, each ending in ONE line that names what went wrong:

- the module schema: before the first collective of an update the learners agree on the modules
  they average and on their order and parameter shapes.  Every learner writes its ``Schema``
  into its own ``SLOTS`` slots of the presence exchange's header (zeros in the others'), so the
  one SUM all-reduce hands every learner every learner's schema; any difference raises
  ``LearnerDisagreementError`` on every learner (they all read the same sums), before a
  collective whose size depends on the schema (gloo aborts the process on a size mismatch);
- a deadline: a collective that does not complete within ``collective_timeout_s`` raises
  ``CollectiveTimeoutError`` naming what it waited for, long before torch's own group timeout
  (30 minutes in RLlib's learner group) or NCCL's watchdog.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

SLOTS = 9
"""Header slots per learner: schema digest (3 x 16 bits), module count, parameter-tensor count,
module-id mask (4 x 16 bits).  16-bit digits: each slot holds one learner's value, exact in float32 too."""
MASK_BITS = 64
TIMEOUT_SETTING = "learner_config_dict['gradmon']['collective_timeout_s']"
T = TypeVar("T")


class LearnerCollectiveError(RuntimeError):
    """A collective among the learners failed: training stops (the message is one line)."""


class LearnerDisagreementError(LearnerCollectiveError):
    """The learners average different modules (a module added or removed on some learners only)."""


class CollectiveTimeoutError(LearnerCollectiveError):
    """A collective did not complete within ``collective_timeout_s`` (another learner never joined it)."""


def _digits(value: int, count: int) -> list[int]:
    """``value``'s lowest ``16 * count`` bits as 16-bit digits, most significant first."""
    return [(value >> (16 * (count - 1 - i))) & 0xFFFF for i in range(count)]


def _join(digits: Sequence[float]) -> int:
    value = 0
    for digit in digits:
        value = (value << 16) | round(digit)
    return value


def module_bit(name: str) -> int:
    """Module ``name``'s bit in the 64-bit module-id mask (a hash: another id may share it)."""
    return 1 << (int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % MASK_BITS)


@dataclass(frozen=True)
class Schema:
    """What the learners must agree on: the modules, in order, and each parameter's shape and dtype."""

    names: tuple[str, ...]
    digest: int
    """48 bits of a SHA-256 of the names and the parameters' shapes and dtypes, in order."""
    params: int
    """Parameter tensors (all modules)."""
    mask: int
    """OR of the modules' ``module_bit``s: tells another learner which of its modules this one lacks."""

    @classmethod
    def of(cls, names: Sequence[str], modules: Sequence[Sequence[torch.Tensor]]) -> Schema:
        layout = [
            (str(name), [(tuple(p.shape), str(p.dtype)) for p in params])
            for name, params in zip(names, modules, strict=True)
        ]
        digest = int.from_bytes(hashlib.sha256(repr(layout).encode()).digest()[:6], "big")
        mask = 0
        for name in names:
            mask |= module_bit(str(name))
        return cls(tuple(str(n) for n in names), digest, sum(len(p) for p in modules), mask)

    def header(self, world_size: int, rank: int) -> list[float]:
        """``SLOTS * world_size`` values: this learner's in its own slots, zeros in the others'."""
        own = [*_digits(self.digest, 3), len(self.names), self.params, *_digits(self.mask, 4)]
        return [0.0] * (SLOTS * rank) + [float(v) for v in own] + [0.0] * (SLOTS * (world_size - rank - 1))


@dataclass(frozen=True)
class _Peer:
    rank: int
    digest: int
    modules: int
    params: int
    mask: int


def _peers(summed: Sequence[float]) -> list[_Peer]:
    """Every learner's schema from the SUM-reduced header (``SLOTS`` values per learner)."""
    if len(summed) % SLOTS:
        raise ValueError(f"a presence header holds {SLOTS} values per learner, got {len(summed)}")
    out = []
    for rank in range(len(summed) // SLOTS):
        s = summed[rank * SLOTS : (rank + 1) * SLOTS]
        out.append(_Peer(rank, _join(s[0:3]), round(s[3]), round(s[4]), _join(s[5:9])))
    return out


def check_agreement(summed: Sequence[float], schema: Schema, rank: int, update: int) -> None:
    """Raise ``LearnerDisagreementError`` unless every learner's schema in the SUM-reduced
    ``summed`` header equals ``schema``; the same sums on every learner, so all of them raise."""
    others = [p for p in _peers(summed) if p.rank != rank and p.digest != schema.digest]
    if not others:
        return
    parts, sets_differ = [], False
    for peer in others:
        lacks = [n for n in schema.names if not peer.mask & module_bit(n)]
        extra = peer.modules - (len(schema.names) - len(lacks))
        sets_differ |= bool(lacks) or extra > 0
        what = [f"lacks {lacks}"] if lacks else []
        what += [f"has {_count(extra, 'module')} not on learner {rank}"] if extra > 0 else []
        what = what or [f"has the same {_count(peer.modules, 'module')} in another order, or other shapes"]
        parts.append(
            f"learner {peer.rank} {' and '.join(what)} ({_count(peer.modules, 'module')}, "
            f"{_count(peer.params, 'parameter tensor')})"
        )
    mine = f"{_count(len(schema.names), 'module')} {list(schema.names)}, {_count(schema.params, 'parameter tensor')}"
    cause = (
        "a module was added or removed on some learners only (Algorithm.add_module/remove_module reach all)"
        if sets_differ
        else "modules added in different orders or with different specs"
    )
    raise LearnerDisagreementError(
        f"gradmon: the learners disagree on the modules they average, update {update}: "
        f"{'; '.join(parts)}; learner {rank} (this one): {mine}; {cause}"
    )


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def timed_out(what: str, rank: int, world_size: int, timeout_s: float) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"gradmon: learner {rank} of {world_size} waited {timeout_s:g} s ({TIMEOUT_SETTING}) for {what}; "
        "another learner never joined it (stopped, stuck, or in a different collective)"
    )


def failed(what: str, rank: int, world_size: int, exc: BaseException) -> LearnerCollectiveError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return LearnerCollectiveError(f"gradmon: {what} failed on learner {rank} of {world_size}: {first}")


def wait_for(work: Any, timeout_s: float | None, *, host: bool) -> bool:
    """Wait for a ``torch.distributed`` work; False if it did not complete within ``timeout_s``
    (None: no deadline).  ``host``: a gloo work on host tensors, whose ``wait(timeout)`` blocks
    with a deadline; otherwise (NCCL) ``wait`` only orders the streams unless
    ``TORCH_NCCL_BLOCKING_WAIT`` is set, so the work's completion is polled until the deadline
    (the caller reads the result on the host right after anyway)."""
    if timeout_s is None:
        work.wait()
        return True
    if host:
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            if str(exc).startswith("Operation timed out"):  # torch's Work.wait deadline (not gloo's own timeout)
                return False
            raise
        return True
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)  # at most 1 ms late, as NCCL's own blocking wait
    work.wait()
    return True


def run_within(fn: Callable[[], None], timeout_s: float | None) -> bool:
    """Run ``fn`` in a helper thread; False if it has not returned within ``timeout_s`` (it is
    left blocked: a collective cannot be interrupted, and the run stops).  Its exception is raised here."""
    if timeout_s is None:
        fn()
        return True
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=target, name="gradmon-collective", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return False
    if errors:
        raise errors[0]
    return True


def within_deadline(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """``fn()``, a step every learner of RLlib's torch.distributed world must join (e.g. RLlib's
    ``add_module``, whose DDP wrapping is a collective): with 2+ learners it may take at most
    ``timeout_s``, else ``CollectiveTimeoutError`` naming ``what``."""
    import torch.distributed as dist

    if timeout_s is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return fn()
    out: list[T] = []
    if not run_within(lambda: out.append(fn()), timeout_s):
        raise timed_out(what, dist.get_rank(), dist.get_world_size(), timeout_s)
    return out[0]
