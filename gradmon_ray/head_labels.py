"""How readers and writers name a head, and which heads are value heads: THE one definition.

A head's **label** is its name in a one-module run (``op``) and ``<module>/<head>`` in a run whose
learners monitor several RLModules (``p1/op``, ``head_label``); a module's metric is
``module/<module>/<name>`` (``module_metric``).

A **value head** is judged by the value bands and is never an action head (not in the worst-head
ranking, the norm CV or the health_stop action-head rules).  ``is_value_head(label, value_heads)``
is the one test every writer and reader asks:

- ``value`` (gradmon's own modules) and ``vf`` (RLlib's default modules) always are
  (``VALUE_HEAD_NAMES``);
- so is every head the run declares: the module's own ``value_heads`` attribute, or the gradmon
  settings' ``value_heads`` (``learner_config_dict["gradmon"]``, per module in ``per_module``);
- a run that declares any records the value heads it reports in the ``gradmon.value_heads`` tag
  (``format_value_heads``, written with ``gradmon.head_names``); readers read it back
  (``parse_value_heads``), and a run without it (none declared, or written before the tag
  existed) has the built-in names only.

A head name or module id goes into every metric name as one path segment, so only names the
grammar can carry are accepted (``check_name``, asked by every place that takes a name: the gradmon
settings, the heads and module ids a learner resolves, gradmon's own module).

Bottom layer: ``metric_names`` re-exports all of this; nothing here imports gradmon.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable

VALUE_HEAD_NAMES: tuple[str, ...] = ("value", "vf")
"""Head names that always mean the value function (gradmon's own modules say ``value``, RLlib's
default modules ``vf``), in every run; a run may declare more (``is_value_head``)."""

POLICY_LATCH = "policy"
"""The one latch head (``latch/nan/policy``, ...) of a module whose action distribution has no
per-head log-probs (``rllib.heads.latch_heads``): it watches the whole policy's log-prob; ``watch``
and the report show it in each action head's latch rows (``viz.runs.latch_head``)."""

_module_template = "module/{module}/{name}"
"""How a module's metric is named (``module_metric``): in a run whose learners monitor several
RLModules (multi-agent), every per-module metric (gradient telemetry, latches, losses) is
``module/<module_id>/<name>``, e.g. ``module/p1/grad/head/op/norm``.  A run with one module keeps
the plain names.  Readers see a module's head as the label ``<module_id>/<head>`` (``head_label``)."""


MAX_NAME_LENGTH = 64
"""The longest head name or module id: two of them and the longest template stay well inside
MLflow's 250-character metric names (``module/<id>/latch/collapse/<head>/first_iteration``)."""
NAME_RULE = f"1-{MAX_NAME_LENGTH} characters from A-Z a-z 0-9 _ - . (not '.' or '..')"
"""What a head name or module id may be, in words (every refusal says it)."""
_name_pattern = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_NAME_LENGTH}}}\Z")
# Why not more: '/' splits path segments (``p1/op`` is module/head to ``metric_parsing``), ','
# separates the ``gradmon.head_names`` tag, MLflow refuses most other characters (':' on Windows)
# and the paths '.' and '..' (``grad/head/../norm`` is not unique); whitespace, which MLflow takes,
# would be a name that looks like another in a table or a shell.


def check_name(name: object, what: str) -> str:
    """``name`` if a head name or module id can be it (``NAME_RULE``), else a one-line ``ValueError``
    naming ``what`` (e.g. ``"gradmon head"``), the name and what is allowed."""
    if isinstance(name, str) and _name_pattern.match(name) and name not in (".", ".."):
        return name
    raise ValueError(
        f"{what} {name!r} cannot go into gradmon's metric names (module/<module>/grad/head/<head>/norm): "
        f"use {NAME_RULE}"
    )


@functools.lru_cache(maxsize=4096)  # ~90 names per telemetry step, the same every step
def module_metric(module: str | None, name: str) -> str:
    """``name`` as the metric of ``module`` in a multi-module run (``_module_template``); None: ``name``."""
    return name if module is None else _module_template.format(module=module, name=name)


def head_label(module: str | None, head: str) -> str:
    """How readers name a head: ``head`` in a one-module run, ``<module>/<head>`` otherwise."""
    return head if module is None else f"{module}/{head}"


def split_head_label(label: str) -> tuple[str | None, str]:
    """``head_label``'s inverse: ``"p1/op"`` -> ``("p1", "op")``, ``"op"`` -> ``(None, "op")``."""
    module, sep, head = label.rpartition("/")
    return (module, head) if sep else (None, label)


def describe_head(label: str) -> str:
    """``head 'op'``, or ``head 'op' of module 'p1'`` for a ``head_label`` with a module."""
    module, head = split_head_label(label)
    return f"head {head!r}" + (f" of module {module!r}" if module is not None else "")


def head_metric(template: str, head: str) -> str:
    """Fill a per-head template, e.g. ``head_metric(HEAD_GRAD_NORM, "op")``; a ``head_label`` with a
    module gives that module's metric (``head_metric(HEAD_GRAD_NORM, "p1/op")`` is
    ``module/p1/grad/head/op/norm``)."""
    module, name = split_head_label(head)
    return module_metric(module, template.format(head=name))


def is_value_head(label: str, value_heads: Collection[str] = ()) -> bool:
    """Whether the head (a name or a ``head_label``) is a value head: THE one definition.

    ``value_heads``: the run's declared value heads besides ``VALUE_HEAD_NAMES``; a plain name
    counts in every module (``critic`` makes ``p1/critic`` a value head), a label in its own
    module only (``p1/critic`` leaves ``p2/critic`` an action head).
    """
    head = split_head_label(label)[1]
    return head in VALUE_HEAD_NAMES or head in value_heads or label in value_heads


def value_heads_among(heads: Iterable[str], value_heads: Collection[str] = ()) -> tuple[str, ...]:
    """The value heads (``is_value_head``) of ``heads``, in their order."""
    return tuple(h for h in heads if is_value_head(h, value_heads))


def format_value_heads(heads: Iterable[str]) -> str:
    """The ``gradmon.value_heads`` tag's value: the labels, comma-separated."""
    return ",".join(heads)


def parse_value_heads(tag: str | None) -> tuple[str, ...]:
    """``format_value_heads``' inverse; ``()`` for a run without the tag (built-in names only)."""
    return tuple(h for h in (tag or "").split(",") if h)
