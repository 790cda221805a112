"""Every private RLlib / Ray / torch API gradmon uses, in one place, for the Ray versions it supports.

RLlib's ``Learner`` exposes no public hook for several things the monitor needs (the
whole postprocessed train batch, the grad scaler);
torch's ``GradScaler`` and fused Adam communicate through private names.  Each use is a
small function below; nothing else in ``gradmon_ray`` touches a private RLlib, Ray or torch
name (``tests/test_architecture.py`` checks that on the syntax tree), so an upgrade breaks
here, loudly, and nowhere else.  This module imports nothing from ``gradmon_ray`` (it is in
the bottom layer, so the pure layers may use it too).  ``check_ray_version()`` runs when a
gradmon learner is built.

Private uses kept here (Ray 2.58-2.60 / torch 2.x; where a use differed between them, the function
below holds both forms):

- ``Learner._make_batch_if_necessary`` (overridden by ``TrainBatchHook``, called by ``make_train_batch``)
- ``TorchLearner._make_modules_ddp_if_necessary`` and ``TorchLearner._update`` (``DistributedModulesHook``,
  for ``gradmon_ray.rllib.module_sync``)
- ``Checkpointable._check_component`` (``wants_component``)
- ``TorchLearner._grad_scalers`` (``grad_scaler``, ``idle_grad_scalers``)
- ``torch.amp.GradScaler._get_scale_async`` (``scale_tensor``)
- the ``optimizer.found_inf`` attribute fused Adam reads (``set_found_inf``)
- ``TorchMultiCategorical._cats``, ``TorchMultiDistribution._flat_child_distributions``
  (``child_distributions``)
- ``StatsBase._start_times`` and a ``Stats`` leaf's attribute dict (``reset_timers``, ``copy_stats``)
- ``Trainable._storage`` (``tune_trial_dir_name``)
- ``ray.tune.registry._global_registry._prefix`` (``set_tune_registry_job``) and
  ``ray._private.worker._post_init_hooks`` (``add_first_post_init_hook``), for
  ``gradmon_ray.envs.tune_registry``
- Ray's ``ActorUnavailableError`` wording "actor is restarting" (``refused_while_restarting``)
- the SIGTERM handler ``ray.init`` installs in a driver, ``ray._private.worker``'s ``sigterm_handler``
  (``is_rays_driver_sigterm_handler``)
- ``torch._utils._flatten_dense_tensors`` (``flatten_dense``): torch has no public one-call flatten.
- ``torch.utils._python_dispatch.TorchDispatchMode`` (``torch_dispatch_mode``): exported nowhere public.
- ``torch._foreach_norm``, ``torch._foreach_mul_``, ``_foreach_copy_``, ``_foreach_sub_``,
  ``_foreach_add_``, ``_foreach_clamp_max`` (the ``foreach_*`` functions): torch has no public per-tensor norm list or
  in-place list ops; ``clip_grad_norm_`` uses the same kernels.  ``clip_grads_with_norm_`` is
  public but multiplies by ``max_norm / (total_norm + 1e-6)``, which is not a given factor bit
  for bit, so it does not replace ``_foreach_mul_`` here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

SUPPORTED_RAY_MINORS = ("2.58", "2.59", "2.60")
"""The Ray minor releases every function below was checked against (``pyproject.toml``'s range says the
same; CI runs the fast lane and a drop-in run on the oldest).  Between them, no private API used here
changed; what did change around gradmon is listed in docs/operations.md ("Ray versions")."""


class RayVersionError(RuntimeError):
    """The installed Ray is not one of the versions ``gradmon_ray.compat`` was written for."""


def check_ray_version(version: str | None = None) -> None:
    """Raise ``RayVersionError`` unless Ray's ``major.minor`` is one of ``SUPPORTED_RAY_MINORS``."""
    if version is None:
        import ray

        version = ray.__version__
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_RAY_MINORS:
        raise RayVersionError(
            f"gradmon-ray supports Ray {', '.join(SUPPORTED_RAY_MINORS)} (it uses private RLlib APIs, checked against "
            f"each in gradmon_ray/compat.py); Ray {version} is installed: "
            f"pip install 'ray[default,rllib,tune]>={SUPPORTED_RAY_MINORS[0]},<{_next_minor(SUPPORTED_RAY_MINORS[-1])}'"
        )


def _next_minor(minor: str) -> str:
    major, low = minor.split(".")
    return f"{major}.{int(low) + 1}"


class TrainBatchHook:
    """Mixin: ``on_train_batch(batch)`` sees the whole postprocessed train batch once per ``update``.

    RLlib has no public hook between the learner connector (GAE done) and the first minibatch.
    """

    def _make_batch_if_necessary(self, training_data: Any) -> Any:
        batch = super()._make_batch_if_necessary(training_data)  # type: ignore[misc]
        self.on_train_batch(batch)
        return batch

    def on_train_batch(self, batch: Any) -> None:
        """Called with the ``MultiAgentBatch`` (or None); default: nothing."""


class DistributedModulesHook:
    """Mixin: RLlib's two private learner steps around DDP, as named hooks.  After RLlib's DDP
    wrapping (``_make_modules_ddp_if_necessary``, at the end of the build) ``after_modules_distributed()``
    runs; every update (``_update``) runs inside ``update_context()``.  RLlib has no public hook for
    either; the class after this one in the MRO defines both (``gradmon_ray.rllib.module_sync``).
    """

    def _make_modules_ddp_if_necessary(self) -> None:
        super()._make_modules_ddp_if_necessary()  # type: ignore[misc]
        self.after_modules_distributed()  # type: ignore[attr-defined]

    def _update(self, batch: dict[str, Any]) -> Any:
        with self.update_context():  # type: ignore[attr-defined]
            return super()._update(batch)  # type: ignore[misc]


def make_train_batch(learner: Any, training_data: Any) -> Any:
    """The learner connector's output for ``training_data`` (what ``update`` trains on)."""
    return learner._make_batch_if_necessary(training_data=training_data)


def learner_connector(learner: Any) -> Any:
    """The learner's connector pipeline (None: it has none, e.g. fed batches only)."""
    return getattr(learner, "_learner_connector", None)


def wants_component(learner: Any, name: str, components: Any, not_components: Any) -> bool:
    """Whether ``get_state(components, not_components=...)`` asks for ``name``."""
    return learner._check_component(name, components, not_components)


def grad_scaler(learner: Any, module_id: str) -> torch.amp.GradScaler | None:
    """The module's ``GradScaler`` (``config.experimental(_torch_grad_scaler_class=...)``), else None."""
    scalers = learner._grad_scalers
    return scalers[module_id] if scalers is not None else None


class _IdleGradScaler:
    """A module's ``GradScaler`` as RLlib's ``apply_gradients`` sees it while the module has no
    gradient: ``step`` and ``update`` leave its optimizer and the scaler as they were (the real
    ``step`` would assert "No inf checks were recorded for this optimizer")."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None: ...

    def update(self, new_scale: Any = None) -> None: ...

    def get_scale(self) -> float:
        return self.scaler.get_scale()  # RLlib logs every module's scale


@contextmanager
def idle_grad_scalers(learner: Any, module_ids: Collection[str]) -> Iterator[None]:
    """Inside the block, RLlib's ``apply_gradients`` neither steps nor updates the ``GradScaler`` of
    ``module_ids`` (modules without any gradient this minibatch); they are put back afterwards."""
    scalers = learner._grad_scalers or {}  # None without mixed precision
    saved = {mid: scalers[mid] for mid in module_ids if mid in scalers}
    scalers.update({mid: _IdleGradScaler(scaler) for mid, scaler in saved.items()})
    try:
        yield
    finally:
        scalers.update(saved)


def scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The scaler's current scale as a device tensor (``get_scale()`` would sync with the host)."""
    return scaler._get_scale_async()


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` reads ``found_inf`` on the device (fused Adam/AdamW/SGD)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Make the next ``optimizer.step()`` of a fused optimizer skip inside the kernel when
    ``found_inf`` is nonzero: the protocol ``torch.amp.GradScaler.step`` uses, without a host
    round trip.  Undo with ``clear_found_inf``."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]


def clear_found_inf(optimizer: torch.optim.Optimizer) -> None:
    """Remove what ``set_found_inf`` set (nothing when it is not set)."""
    optimizer.__dict__.pop("found_inf", None)


def step_unless_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """One fused step that the kernel itself skips when ``found_inf`` is nonzero."""
    set_found_inf(optimizer, found_inf)
    try:
        optimizer.step()
    finally:
        clear_found_inf(optimizer)


def child_distributions(dist: Any) -> list[Any]:
    """The per-component distributions of RLlib's ``TorchMultiCategorical`` (MultiDiscrete) or
    ``TorchMultiDistribution`` (Dict, flattened in dm-tree's sorted-key order)."""
    for attr in ("_cats", "_flat_child_distributions"):
        if hasattr(dist, attr):
            return list(getattr(dist, attr))
    raise TypeError(f"{type(dist).__name__} has no per-component distributions")


def reset_timers(stats: Any) -> None:
    """Give a copied ``Stats`` its own, empty timer table (what ``StatsBase.__init__`` starts with)."""
    stats._start_times = {}


def copy_stats(stats: Any) -> Any:
    """A new ``Stats`` leaf with ``stats``'s settings (its attribute dict) and its own empty timers."""
    copied = object.__new__(type(stats))
    copied.__dict__.update(stats.__dict__)
    reset_timers(copied)
    return copied


def tune_trial_dir_name(algorithm: Any) -> str | None:
    """The Tune trial directory name of ``algorithm`` (``Trainable._storage``, set by Tune only); None outside Tune."""
    name = getattr(getattr(algorithm, "_storage", None), "trial_dir_name", None)
    return str(name) if name else None


def add_first_post_init_hook(hook: Any) -> None:
    """Put ``hook`` first among the functions Ray runs after every ``ray.init`` in this process
    (``ray._private.worker._post_init_hooks``, where Tune flushes its queued registrations); once."""
    from ray._private import worker

    if hook not in worker._post_init_hooks:
        worker._post_init_hooks.insert(0, hook)


def set_tune_registry_job(job_id: str | None) -> None:
    """Key Ray Tune's registry entries by ``job_id`` from now on (None: read again at first use);
    Tune reads it once per process (``_Registry.prefix``) and has no setter."""
    from ray.tune.registry import _global_registry

    _global_registry._prefix = job_id


def refused_while_restarting(exc: BaseException) -> bool:
    """Whether Ray refused an actor call because the actor was restarting (so the call never ran).

    Ray raises ``ActorUnavailableError`` both for a call sent while the actor restarts ("The
    actor is restarting") and for one it was running when it died ("The actor was restarted");
    only the wording tells them apart in Ray 2.60.
    """
    return "actor is restarting" in str(exc)


def is_rays_driver_sigterm_handler(handler: Any) -> bool:
    """Whether ``handler`` is the SIGTERM handler ``ray.init`` installs in a driver (``sys.exit(15)``,
    which skips every ``except KeyboardInterrupt``): a default to take over, not a user's own."""
    return getattr(handler, "__module__", None) == "ray._private.worker" and (
        getattr(handler, "__name__", None) == "sigterm_handler"
    )


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, as one fused kernel per device and dtype (what ``clip_grad_norm_`` runs)."""
    return list(torch._foreach_norm(tensors))


def foreach_clamp_max(tensors: list[torch.Tensor], bound: float) -> list[torch.Tensor]:
    """Each tensor clamped at ``bound`` from above, as new tensors, in one multi-tensor op."""
    return list(torch._foreach_clamp_max(tensors, bound))


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the documented way to see every aten op
    (``telemetry.op_counts``), which torch exports only from this private module."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def flatten_dense(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated in one call (``torch._utils._flatten_dense_tensors``,
    what DDP's buckets use): one C++ loop, where ``cat([t.reshape(-1) ...])`` is a Python call per tensor."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``factor`` (a 0-d tensor stays on the device: no host sync)."""
    torch._foreach_mul_(tensors, factor)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy ``sources`` into ``targets`` in place, pairwise."""
    torch._foreach_copy_(targets, sources)


def foreach_sub_(targets: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``targets[i] -= others[i]`` in place."""
    torch._foreach_sub_(targets, others)


def foreach_add_(targets: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``targets[i] += others[i]`` in place."""
    torch._foreach_add_(targets, others)
