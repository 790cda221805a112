"""A VGS ``element`` step launches a number of kernels that does not grow with the number of
parameter tensors, eager or compiled (issue #44, item 3).

How it is counted:

* eager (``compile="off"``, the flat step of ``vgs.flat_kernels``): ``telemetry.op_counts.OpCounter``
  around one step, its dispatched ops and its kernels (ops that launch one on a GPU);
* compiled (``compile="on"``): a dispatch mode would make ``torch.compile`` run eagerly, so the
  count is read from the code Inductor generates for the step, at 16 tensors, against the count
  measured at 4 and at 16 alike
  (``torch._inductor.utils.run_and_get_code``): every fused kernel it calls (``cpp_fused_*`` on a
  CPU, ``triton_*`` on CUDA) and every ATen op it falls back to (``kthvalue``, ``cumsum``, ...).

Bugs these catch: a per-tensor Python loop of ops in the step (a per-parameter ``view``, gather or
EMA update), a compiled fold that Inductor splits into a kernel per tensor.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from gradmon_ray.telemetry.op_counts import OpCounter
from gradmon_ray.vgs import VarianceGradientScaler

EAGER_KERNELS = 91
"""Kernels of one eager element step (p90 over a 256-entry sample), measured 2026-11-28: 3 to
copy and clean the gradients, 4 to fold, 1 to scale, the rest on the 256 sampled entries."""

_LAUNCH = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(", re.M
)
"""A call in the generated wrapper's ``call``: a fused kernel or an ATen fallback."""


def _scaler(tensors: int, compile_mode: str) -> VarianceGradientScaler:
    params = [torch.nn.Parameter(torch.zeros(16, 16)) for _ in range(tensors)]
    gen = torch.Generator().manual_seed(tensors)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return VarianceGradientScaler(params, warmup_steps=0, quantile_sample_size=256, compile=compile_mode)


def _eager_counts(tensors: int) -> tuple[int, int]:
    vgs = _scaler(tensors, "off")
    vgs.scale_gradients()
    with OpCounter() as counter:
        vgs.scale_gradients()
    return counter.ops, counter.kernels


def test_an_eager_element_step_dispatches_the_same_ops_for_4_and_48_tensors():
    four, forty_eight = _eager_counts(4), _eager_counts(48)
    assert four == forty_eight, (four, forty_eight)
    assert four[1] <= EAGER_KERNELS, four


def _compiled_launches(tensors: int) -> list[str]:
    vgs = _scaler(tensors, "on")
    _, codes = run_and_get_code(vgs.scale_gradients)
    assert vgs.compiled
    return _LAUNCH.findall("\n".join(codes))


COMPILED_LAUNCHES = 5
"""Calls in Inductor's code for one compiled element step on a CPU, measured 2026-11-28 at 4 and at
16 tensors alike: 3 fused C++ kernels, ``cumsum`` and ``kthvalue`` (one compile here: each costs
several seconds of the suite)."""


@pytest.mark.filterwarnings("ignore")
def test_a_compiled_element_step_of_16_tensors_launches_the_fixed_handful():
    launches = _compiled_launches(16)
    assert len(launches) == COMPILED_LAUNCHES, launches
