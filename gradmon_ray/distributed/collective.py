"""One named Ray collective group among the learner actors, and one packed allreduce.

The group is a ``ray.util.collective`` group.  With gloo it becomes a ``torch.distributed``
sub-group of the world RLlib already created for DDP, under a run-unique name that never is
``"default"`` (that name would mean torch's WORLD group, and destroying it would tear down
RLlib's DDP).  It is created lazily on the first reduction and destroyed on learner shutdown.
A reduction that has not completed within ``timeout_s`` raises ``CollectiveTimeoutError`` naming
the step (``distributed.agreement``): Ray's gloo group has torch's 30-minute timeout, its NCCL
group none.

Why ONE SUM allreduce carries everything: every lane that would need MAX is a 0/1 flag
(per-head NaN/Inf latches on the *local* log-probs), and for 0/1 flags ``OR == (SUM > 0)``.
Lanes computed after DDP's all-reduce are identical on every replica; their SUM is K times
the value and is divided by K.  Norm sums and their counts are used as a ratio, so SUM
needs no correction.  A second call with MAX would double the latency for nothing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from gradmon_ray.distributed.agreement import run_within, timed_out
from gradmon_ray.telemetry.accumulator import IterationAccumulator, reduce_and_copy
from gradmon_ray.telemetry.lane_layout import TelemetryLayout

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")


def new_group_name() -> str:
    """A run-unique group name (never torch's ``"default"``)."""
    return f"gradmon-{uuid.uuid4().hex[:12]}"


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"``: NCCL for CUDA tensors when Ray's NCCL backend (cupy) is installed, else
    gloo on the host copy the learner makes anyway; an explicit choice is checked."""
    if backend not in BACKENDS:
        raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gloo":
        return backend
    from ray.util import collective

    if backend == "auto":
        return "nccl" if device.type == "cuda" and collective.nccl_available() else "gloo"
    if backend == "nccl" and (device.type != "cuda" or not collective.nccl_available()):
        raise ValueError("collective backend 'nccl' needs CUDA learners and Ray's NCCL support (cupy)")
    return backend


class LearnerCollective:
    """The learners' collective group; ``allreduce_sum`` counts its calls.

    With ``world_size <= 1`` there is no group and ``allreduce_sum`` returns its input:
    one learner takes the same code path with nothing to reduce.
    """

    def __init__(
        self,
        group_name: str,
        world_size: int,
        rank: int,
        backend: str,
        device: torch.device,
        timeout_s: float | None = None,
    ) -> None:
        if group_name == "default":
            raise ValueError("never name the gradmon collective group 'default' (torch's WORLD group)")
        self.group_name = group_name
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.backend = resolve_backend(backend, device) if self.world_size > 1 else "none"
        self.calls = 0
        self.timeout_s = timeout_s
        """How long one reduction may wait for the other learners (None: the transport's own limit)."""
        self._initialized = False
        self._stuck = False  # a reduction timed out: its group is left alone (destroying it would block)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _ensure_group(self) -> None:
        if self._initialized:
            return
        from ray.util import collective

        collective.init_collective_group(self.world_size, self.rank, backend=self.backend, group_name=self.group_name)
        self._initialized = True

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM-allreduce ``tensor`` in place across the learners (one collective call).

        gloo reduces a host tensor (the caller's single device->host copy); NCCL reduces on
        the device.  Returns the reduced tensor.
        """
        if not self.active:
            return tensor
        # In a helper thread, waited for at most ``timeout_s``: no transport here takes a deadline.
        if not run_within(lambda: self._transport(tensor), self.timeout_s):
            self._stuck = True
            what = f"the telemetry reduce of step {self.calls + 1} (group {self.group_name})"
            raise timed_out(what, self.rank, self.world_size, self.timeout_s or 0.0)
        self.calls += 1
        return tensor

    def _transport(self, tensor: torch.Tensor) -> None:
        self._allreduce(tensor)
        if tensor.is_cuda:  # NCCL: the reduction is queued on a stream; wait for it here, within the deadline
            torch.cuda.synchronize(tensor.device)

    def _allreduce(self, tensor: torch.Tensor) -> None:
        """The transport: one in-place SUM through the Ray collective group (made on first use)."""
        from ray.util import collective

        self._ensure_group()
        collective.allreduce(tensor, group_name=self.group_name)

    def destroy(self) -> None:
        """Tear down this group only (RLlib's DDP world is left alone)."""
        if not self._initialized or self._stuck:
            return
        from ray.util import collective

        try:
            collective.destroy_collective_group(self.group_name)
        except Exception as exc:  # shutdown must not fail because a peer went first
            logger.warning("destroying collective group %s failed: %s", self.group_name, exc)
        self._initialized = False


class ReducedIteration(NamedTuple):
    """One module's numbers of one step after ``reduce_iteration``/``reduce_modules`` (numpy, on the host)."""

    lanes: np.ndarray
    """The telemetry lanes, merged across replicas (``TelemetryLayout.merge_replicas``)."""
    checksum: np.ndarray
    """The SUM of the learners' checksum digits (one set per learner, shared by its modules)."""
    noise: np.ndarray
    """The SUM of the learners' noise-scale lanes (``gradmon_ray.telemetry.noise_scale``)."""
    local: np.ndarray
    """``local`` as it was on this learner (not reduced)."""
    health: np.ndarray
    """The SUM of the learners' policy head-health lanes (``telemetry.head_entropy``; empty when off)."""
    own_checksum: np.ndarray
    """This learner's own checksum digits (rode the host copy unreduced)."""
    minibatch_norms: np.ndarray | None = None
    """``[minibatches, heads + 1]``: this learner's own minibatch norms of the module (its heads,
    its global norm), None where they were not handed over."""
    extra: dict[str, np.ndarray] | None = None
    """``reduce_modules``' ``extra`` as this learner had them (learner-wide: the same for every module)."""


class ModuleLanes(NamedTuple):
    """What one module puts into a step's packed reduction besides its telemetry and health lanes."""

    layout: TelemetryLayout
    """The module's telemetry lanes' layout (their share of ``reduce_modules``' ``lanes``)."""
    noise: torch.Tensor
    local: torch.Tensor
    """Rank-local values that ride the same host copy unreduced."""
    norm_columns: Sequence[int] = ()
    """The module's columns of ``reduce_modules``' ``minibatch_norms`` (its heads, its global norm)."""


HealthBlock = tuple[Sequence[int], torch.Tensor]
"""(module indices, their head-health lanes module after module, flat)."""


def reduce_modules(
    lanes: torch.Tensor,
    modules: Sequence[ModuleLanes],
    collective: LearnerCollective,
    *,
    checksum: torch.Tensor,
    health: Sequence[HealthBlock] = (),
    minibatch_norms: torch.Tensor | None = None,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> list[ReducedIteration]:
    """ONE SUM reduction and ONE device->host copy for every module of the learner.

    ``lanes``: every module's telemetry lanes, module after module (``lane_fold.LaneFold``);
    ``health``: the head-health lanes of the modules that measure it, in blocks (a module in none
    has none); ``minibatch_norms``: ``[minibatches, columns]`` norms that ride the copy rank-local
    (each module reads its ``norm_columns``).  Packed as ``[checksum, lanes, health blocks, noise
    per module | own checksum, minibatch norms, local per module]``: the reduced part first, so a
    single in-place allreduce covers it (on the device for NCCL, on the host copy for gloo), all
    of it in one ``cat``.  With one learner nothing is reduced.
    """
    reduced_parts: dict[str, torch.Tensor] = {"checksum": checksum, "lanes": lanes}
    reduced_parts.update((f"health.{b}", block) for b, (_, block) in enumerate(health))
    local_parts: dict[str, torch.Tensor] = {"checksum": checksum}
    if minibatch_norms is not None:
        local_parts["minibatch_norms"] = minibatch_norms
    for name, tensor in (extra or {}).items():
        local_parts[f"extra.{name}"] = tensor
    for i, part in enumerate(modules):
        reduced_parts[f"{i}.noise"] = part.noise
        local_parts[f"{i}.local"] = part.local
    reduced, local = Segments(reduced_parts), Segments(local_parts)
    n = sum(reduced.sizes.values())
    host = reduce_and_copy(
        reduced.pack(then=local),
        n,
        allreduce=collective.allreduce_sum if collective.active else None,
        reduce_on_device=collective.backend == "nccl",
    )
    reduced_host, local_host = reduced.unpack(host[:n]), local.unpack(host[n:])
    offsets = np.cumsum([0, *(part.layout.size for part in modules)])
    health_host = {  # equal shares of a block, one a module
        k: share
        for b, (indices, _) in enumerate(health)
        for k, share in zip(indices, np.split(reduced_host[f"health.{b}"], len(indices)), strict=True)
    }
    empty = np.zeros(0)
    norms = (
        local_host["minibatch_norms"].reshape(minibatch_norms.shape[0], -1)
        if minibatch_norms is not None
        else np.zeros((0, 0))
    )
    extra_host = {name: local_host[f"extra.{name}"] for name in extra or {}}  # rank-local, flat
    return [
        ReducedIteration(
            part.layout.merge_replicas(reduced_host["lanes"][offsets[i] : offsets[i + 1]], collective.world_size),
            reduced_host["checksum"],
            reduced_host[f"{i}.noise"],
            local_host[f"{i}.local"],
            health_host.get(i, empty),
            local_host["checksum"],
            norms[:, list(part.norm_columns)] if minibatch_norms is not None else None,
            extra_host,
        )
        for i, part in enumerate(modules)
    ]


def reduce_iteration(
    accumulator: IterationAccumulator,
    collective: LearnerCollective,
    *,
    checksum: torch.Tensor,
    noise: torch.Tensor,
    local: torch.Tensor,
    health: torch.Tensor | None = None,
) -> ReducedIteration:
    """``reduce_modules`` for one module: drain ``accumulator`` with ``[checksum, noise, health]``
    riding in its ONE reduction and ``local`` in its one host copy."""
    lanes = accumulator.fold()
    blocks = [] if health is None else [([0], health)]
    part = ModuleLanes(accumulator.layout, noise, local)
    (reduced,) = reduce_modules(lanes, [part], collective, checksum=checksum, health=blocks)
    accumulator.buffer.zero_()
    return reduced


class Segments:
    """Named, contiguous segments of one flat float64 vector: pack on the device, unpack on the host.

    The segments keep their order; a segment may be empty.  Offsets are derived, never written.
    """

    def __init__(self, parts: Mapping[str, torch.Tensor]) -> None:
        self.sizes = {name: int(t.numel()) for name, t in parts.items()}
        self._parts = parts

    def pack(self, then: Segments | None = None) -> torch.Tensor:
        """The segments (followed by ``then``'s), concatenated in order, as one float64 tensor, in
        one ``cat`` (it promotes the dtypes: no conversion op per segment, and no reshape of one
        already flat)."""
        tensors = [*self._parts.values(), *(then._parts.values() if then is not None else ())]
        parts = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]
        if parts and all(t.numel() == 0 and t.dtype == torch.float64 for t in parts):
            return parts[0]  # nothing to join (a module's unused local lanes): no op
        packed = torch.cat(parts)
        return packed if packed.dtype == torch.float64 else packed.double()

    def unpack(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """``{name: values}`` of a packed vector (e.g. after its host copy)."""
        if len(flat) != sum(self.sizes.values()):
            raise ValueError(f"expected {sum(self.sizes.values())} values for segments {self.sizes}, got {len(flat)}")
        out, start = {}, 0
        for name, size in self.sizes.items():
            out[name] = np.asarray(flat[start : start + size])
            start += size
        return out
