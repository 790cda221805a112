"""The replica checksum: a learner's parameters' exact bit patterns in two float64 "digits" that
ride the telemetry step's one SUM reduction (``collective.reduce_modules``), and the error that
stops a run whose replicas differ."""

from __future__ import annotations

import torch

CHECKSUM_BITS = 48
_CHUNK = 1 << 24


def parameter_checksum(params: list[torch.Tensor]) -> torch.Tensor:
    """A 48-bit checksum of the parameters' exact bit patterns, as two float64 "digits".

    ``sum_i bits_i * w_i mod 2^48`` with fixed odd weights ``w_i``: a change of any single
    element changes it (``w_i`` is odd and ``|delta bits| < 2^33``).  The two 24-bit digits
    stay exact in float64 after summing over up to 2^29 learners, so ``SUM == K * own`` is an
    exact test across replicas.
    """
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    bits = flat.view(torch.int32).to(torch.int64)
    index = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64)
    weights = (index * 2654435761 + 1) | 1  # odd, distinct, deterministic
    total = (bits * weights).sum() & ((1 << CHECKSUM_BITS) - 1)
    return torch.stack([(total // _CHUNK).double(), (total % _CHUNK).double()])


class ReplicaDivergenceError(RuntimeError):
    """Learner replicas hold different parameters: the run can no longer be trusted."""
