"""How the panel, the plots and the report lay heads out: by module, with short unique names, and
the band edges each head is judged by (the run's own, read back from its params, and its value
heads, read back from its ``gradmon.value_heads`` tag).

Pure logic, no MLflow, no drawing: every reader groups and names heads the same way.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from gradmon_ray import metric_names as mn
from gradmon_ray.telemetry.bands import DEFAULT_BANDS, BandSet, HealthBands

BAND_PARAM = "telemetry.bands.{kind}.{edge}"
"""The MLflow param ``gradmon-ray train`` logs for each band edge (the flattened run config)."""
_EDGES = ("dead_below", "weak_below", "healthy_max", "elevated_max")
_WORD_BREAK = re.compile(r"[_\-. ]+")


def group_heads(heads: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """``heads`` (``metric_names.head_label``s) module by module, modules in first-seen order and
    heads in their given order: ``["p1/op", "p2/op", "p1/value"]`` ->
    ``[("p1", ["p1/op", "p1/value"]), ("p2", ["p2/op"])]``; a one-module run is ``[(None, heads)]``."""
    groups: dict[str | None, list[str]] = {}
    for head in heads:
        groups.setdefault(mn.split_head_label(head)[0], []).append(head)
    return list(groups.items())


def short_head(label: str) -> str:
    """The head's own name without its module (``"p1/op"`` -> ``"op"``): a module's table or
    subplot is titled with the module, so its columns need not repeat it."""
    return mn.split_head_label(label)[1]


def _candidate(name: str, width: int) -> str:
    """``alpha_target`` -> ``a_target`` (initials of all words but the last), then cut to ``width``
    with ``…``; a one-word name is cut: ``blueprint`` -> ``bluepr…``."""
    words = [w for w in _WORD_BREAK.split(name) if w]
    short = "_".join([*(w[0] for w in words[:-1]), words[-1]]) if len(words) > 1 else name
    return short if len(short) <= width else short[: width - 1] + "…"


def abbreviate(names: Sequence[str], width: int) -> dict[str, str]:
    """A unique name of at most ``width`` characters for each of ``names`` (which are unique).

    A name that fits stays as it is; a longer one becomes its words' initials plus its last word,
    cut with ``…`` (``alpha_target`` -> ``a_targ…`` at 7), so ``alpha_target``, ``alpha_speed``
    and ``alpha_curve`` stay apart where a plain cut makes all three ``alpha_…``.  Long names that
    would still clash are numbered (``head_…1``, ``head_…2``); ``h1``, ``h2``, ... (by position)
    as a last resort.  ``ValueError`` when not even that fits in ``width``.
    """
    if len(str(len(names))) + 1 > width:
        raise ValueError(f"cannot name {len(names)} heads uniquely in {width} characters")
    short = {n: n if len(n) <= width else _candidate(n, width) for n in names}
    counts = Counter(short.values())
    clashing = [n for n in names if short[n] != n and counts[short[n]] > 1]
    for k, name in enumerate(clashing, start=1):
        short[name] = name[: max(1, width - 1 - len(str(k)))] + "…" + str(k)
    if len(set(short.values())) != len(short) or any(len(s) > width for s in short.values()):
        short = {n: f"h{i}" for i, n in enumerate(names, start=1)}
    return short


def legend(short: Mapping[str, str]) -> str:
    """``"a_targ… = alpha_target, bluepr… = blueprint"``: every abbreviated name, in order."""
    return ", ".join(f"{s} = {n}" for n, s in short.items() if s != n)


def run_bands(params: Mapping[str, str], tags: Mapping[str, str] | None = None) -> BandSet:
    """The edges the run judged its heads by, from its ``telemetry.bands.*`` params (``gradmon-ray
    train`` logs its whole config); the defaults for a run without them (a user's own callback) or
    with edges that do not parse.  Its value heads (``BandSet.value_heads``) are the
    ``gradmon.value_heads`` tag's; a run without the tag has ``value`` and ``vf`` only."""
    edges: dict[str, HealthBands] = {}
    for kind, default in (("action", DEFAULT_BANDS.action), ("value", DEFAULT_BANDS.value)):
        try:
            given = {e: float(params[BAND_PARAM.format(kind=kind, edge=e)]) for e in _EDGES}
            edges[kind] = HealthBands(**given) if all(math.isfinite(v) for v in given.values()) else default
        except (KeyError, ValueError, TypeError):
            edges[kind] = default
    value_heads = mn.parse_value_heads((tags or {}).get(mn.TAG_VALUE_HEADS))
    return BandSet(
        action=edges["action"], value=edges["value"], collapse=DEFAULT_BANDS.collapse, value_heads=value_heads
    )


def band_edges_text(bands: HealthBands) -> str:
    """``"0.01 / 0.1 / 2 / 5"``: the four edges, for titles and legends."""
    return " / ".join(f"{e:g}" for e in bands.edges)


def modules_of(heads: Iterable[str]) -> list[str | None]:
    """The modules of ``heads`` in first-seen order (``[None]`` for a one-module run)."""
    return [module for module, _ in group_heads(list(heads))]


MINIBATCH_PARAMS = ("ppo.minibatch_size", "minibatch_size")
"""Where a run's minibatch size is among its MLflow params: ``gradmon-ray train``'s, RLlib's (callback)."""


def batch_advice(noise_scale: float | None, params: Mapping[str, str]) -> str | None:
    """``critical batch ~ B_simple = 3,400 samples; minibatch 128: well below it, ...`` (McCandlish et al.
    2018: far below B_simple each step is mostly noise and larger batches cut the steps about
    proportionally; far above it, samples are wasted).  None without a finite, positive noise scale."""
    if noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0:
        return None
    text = f"critical batch ~ B_simple = {noise_scale:,.0f} samples"
    minibatch = next((params[k] for k in MINIBATCH_PARAMS if params.get(k) not in (None, "None")), None)
    try:
        size = int(float(minibatch)) if minibatch is not None else None
    except ValueError:
        size = None
    if size is None:
        return text
    if size < noise_scale / 10:
        verdict = "well below it: larger minibatches would need about proportionally fewer steps"
    elif size > noise_scale * 10:
        verdict = "well above it: smaller minibatches would use the samples better"
    else:
        verdict = "near it: a good trade-off of steps and samples"
    return f"{text}; minibatch {size:,}: {verdict}"
