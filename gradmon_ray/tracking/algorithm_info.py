"""What ``GradmonMLflowCallback`` reads off an RLlib algorithm (duck-typed: tracking imports nothing
from ``gradmon_ray.rllib``).  The callback creates no store on the driver: the sink makes it with the
run (``store_lock``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gradmon_ray import compat
from gradmon_ray import metric_names as mn
from gradmon_ray.tracking.result_metrics import DEFAULT_MODULE_ID

logger = logging.getLogger(__name__)

TAG_TRIAL_DIR = "ray.tune.trial_dir_name"
"""Run tag under Tune: the trial's directory name, which holds its id (the run is named after it too)."""


def module_head_order(algorithm: Any, module_id: str | None) -> tuple[str, ...]:
    """The module's action heads in its action-space order, for the ``gradmon.head_names`` tag.

    ``module_id`` None: every policy of the algorithm, each head as ``<module>/<head>`` when
    there are several (``metric_names.head_label``), one module's plain names otherwise.

    Asked of the module itself (``FactoredActorCritic.head_names`` is ``resolve_heads``' order,
    what ``gradmon-ray train`` tags), else the keys of ``learner_config_dict["gradmon"]["heads"]``;
    duck-typed, so tracking imports nothing from gradmon_ray.rllib.  Empty when neither is known:
    ``order_heads`` then sorts the action heads, ``value`` last.
    """
    if module_id is None:
        policies = list(getattr(algorithm.config, "policies", None) or [DEFAULT_MODULE_ID])
        if len(policies) > 1:
            return tuple(mn.head_label(str(p), h) for p in policies for h in module_head_order(algorithm, str(p)))
        module_id = str(policies[0])
    try:
        names = getattr(algorithm.get_module(module_id), "head_names", None)
        if names:
            return tuple(str(n) for n in names)
    except Exception as exc:
        logger.debug("gradmon callback: no module to read head names from (%s)", exc)
    heads = (getattr(algorithm.config, "learner_config_dict", None) or {}).get("gradmon", {}).get("heads")
    return tuple(str(h) for h in heads) if isinstance(heads, Mapping) else ()


def config_params(config: Any) -> dict[str, Any]:
    """The scalar top-level settings of an ``AlgorithmConfig`` (what a Tune search usually varies)."""
    try:
        items = config.to_dict().items()
    except Exception:
        return {}
    return {k: v for k, v in sorted(items) if isinstance(v, (bool, int, float, str)) or v is None}


def tune_trial_dir_name(algorithm: Any) -> str | None:
    """The Tune trial's directory name (``<trainable>_<trial_id>_<index>_<params>_<date>``); None outside Tune.

    Not ``algorithm.trial_name``/``trial_id``: RLlib drops Tune's trial info when it turns the
    trial's config into an ``AlgorithmConfig`` (``update_from_dict`` skips ``__trial_info__``),
    so those say "default" in a trial too.  Private Ray API (``Trainable._storage``, set by Tune
    only), read defensively: without it the run is simply not named after the trial.
    """
    return compat.tune_trial_dir_name(algorithm)
