"""The order a run's heads are shown in (the ``gradmon.head_names`` tag, watch, the plots, the report)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gradmon_ray.config import GradmonConfig

logger = logging.getLogger(__name__)


def reported_head_order(action_space: Any, head_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """The heads the learner reports, in display order: ``head_names`` (the environment's declared
    order; checked against the space by ``resolve_heads``) when given, else the action space's
    order (a ``Dict``'s sorted keys), then ``value``.  The ``gradmon.head_names`` tag holds this;
    watch, the plots and the report follow the tag.  Only the display order: the logits stay in
    dm-tree's sorted-key order."""
    from gradmon_ray.rllib.module import VALUE_HEAD, resolve_heads

    layout = resolve_heads(action_space, head_names)
    return (*(tuple(head_names) if head_names is not None else layout.names), VALUE_HEAD)


def declared_head_names(cfg: GradmonConfig) -> Sequence[str] | None:
    """``model.head_names``, else the built-in environments' own order (``op`` first), else None."""
    from gradmon_ray.envs import BUILTIN_ENV_IDS, HEAD_NAMES

    if cfg.model.head_names is not None:
        return cfg.model.head_names
    return HEAD_NAMES if cfg.env.id in BUILTIN_ENV_IDS else None


def head_order(algo: Any, cfg: GradmonConfig) -> tuple[str, ...]:
    """``reported_head_order`` for the algorithm's module(s) (empty, with a warning, if the spaces are unknown).

    A multi-agent run (several modules) names each head ``<module>/<head>``
    (``metric_names.head_label``), module by module.  Computed here, not read off the result
    dict: RLlib's ``MetricsLogger.aggregate`` merges the learners' results through a ``set`` of
    keys, so their order changes from run to run.
    """
    from gradmon_ray.metric_names import head_label

    try:
        # RLlib's ``algo.spaces`` also holds the env's own entry ("__env__"...) and, for a
        # multi-agent env, entries without an action space: only the modules' count.
        known = dict(getattr(algo, "spaces", None) or {})
        spaces = {mid: s for mid, s in known.items() if not str(mid).startswith("__") and s[1] is not None}
        if not spaces:
            from gradmon_ray.rllib.local_learner import module_spaces

            spaces = module_spaces(cfg)
        several = len(spaces) > 1
        return tuple(
            head_label(module_id if several else None, head)
            for module_id, (_, action_space) in spaces.items()
            for head in reported_head_order(action_space, declared_head_names(cfg))
        )
    except Exception as exc:  # only the tag's order depends on it: sorted heads, then value
        logger.warning("could not work out the head order (%s: %s); heads are tagged sorted", type(exc).__name__, exc)
        return ()
