"""Policy head health in a gradmon learner: each head's entropy and KL, measured once per step.

Per minibatch the learner only keeps *references* (``HeadHealthRecorder.record``: no copy, no
kernel, no host sync) to the minibatch's action-distribution inputs, the sampling
policy's inputs (``batch[Columns.ACTION_DIST_INPUTS]``) and the loss mask, overwriting the
previous minibatch's.  Once per telemetry step, at the drain, ``lanes()`` computes the
per-head masked-mean entropy and KL(sampling || current) of that LAST minibatch on the device
(``gradmon_ray.telemetry.head_entropy``): measured on the step's last minibatch, the same
minibatch RLlib's own ``entropy`` and ``mean_kl_loss`` (logged with window=1) report.  The lanes
ride in the step's single packed reduction and host copy.

The heads are the latch heads (``heads.latch_heads``); their sizes come from
``head_sizes``, decided at build with the latches (``distribution_heads``).  Entropy and KL are
computed from the raw logits as one plain categorical per head, so only a distribution that is
exactly that gets them: RLlib's ``TorchCategorical`` (``Discrete``), its catalog's
``TorchMultiCategorical`` (``MultiDiscrete``) and ``TorchMultiDistribution`` of ``TorchCategorical``
children (flat ``Dict`` of ``Discrete``), gradmon's ``FactoredCategorical.for_heads`` classes.  Any
other (a ``Box`` space, a subclass with a temperature in ``from_logits``) gets no head health:
``head_sizes`` returns None and no ``policy/head/...`` metric is reported (not NaN).
"""

from __future__ import annotations

from typing import Any

import torch

from gradmon_ray.rllib.distribution_heads import distribution_heads
from gradmon_ray.telemetry.head_entropy import empty_head_health_lanes, head_health_lanes


def head_sizes(module: Any, heads: tuple[str, ...]) -> tuple[int, ...] | None:
    """Number of actions of each of ``heads`` (``heads.latch_heads(module)``), in order; None when
    the train action distribution is not exactly one plain categorical per head
    (``distribution_heads``: the same build-time decision as the latches)."""
    sizes = distribution_heads(module).sizes
    return sizes if sizes is not None and len(sizes) == len(heads) else None


class HeadHealthRecorder:
    """The last minibatch's references, and the once-per-step head-health lanes computed from them."""

    def __init__(self, sizes: tuple[int, ...] | None, device: torch.device | str) -> None:
        self.sizes = sizes
        self.device = device
        self._last: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    @property
    def enabled(self) -> bool:
        return self.sizes is not None

    def record(self, logits: torch.Tensor, sampling_logits: Any, mask: torch.Tensor | None) -> None:
        """Keep references to this minibatch's inputs; no kernel (``lanes`` reads them under no_grad)."""
        if self.sizes is not None:
            prev = sampling_logits if isinstance(sampling_logits, torch.Tensor) else None
            self._last = (logits, prev, mask)

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """The last minibatch's (logits, sampling logits, loss mask), None without one; forgets them."""
        last, self._last = self._last, None
        return last

    def empty_lanes(self) -> torch.Tensor:
        """The lanes of a step in which this learner saw no minibatch of the module (counts 0)."""
        return empty_head_health_lanes(len(self.sizes or ()), self.device)

    def lanes(self) -> torch.Tensor:
        """This step's ``head_health_lanes`` (zeros, counts 0, without a minibatch); forgets the
        references.  Empty when head health is off.  (A learner computes the lanes of modules with
        the same heads together: ``rllib.module_groups.health_blocks``.)"""
        if self.sizes is None:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        last = self.take()
        if last is None:
            return self.empty_lanes()
        logits, prev, mask = last
        return head_health_lanes(logits, prev, self.sizes, mask)
