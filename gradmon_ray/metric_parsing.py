"""The one parser of gradmon metric names, for every reader.

The names themselves (constants and templates, and the helpers that fill them) live in
``gradmon_ray.metric_names`` and ``gradmon_ray.head_labels``; this module takes a name apart again:
``parse`` gives the template it fills and its parts, ``heads_of`` and ``probe_buckets`` read many names at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gradmon_ray.head_labels import _module_template, head_label
from gradmon_ray.metric_names import PER_HEAD_TEMPLATES, PROBE_TEMPLATES, SCALAR_NAMES, _bucket_template

# Every metric name and template ``parse`` recognises (tags are not metric names).
METRIC_TEMPLATES: tuple[str, ...] = (*PER_HEAD_TEMPLATES, *SCALAR_NAMES, *PROBE_TEMPLATES)

_placeholder = re.compile(r"\{(\w+)\}")
# What a placeholder may hold, where it is narrower than one non-empty path segment: a bucket is
# ``bucket_<n>`` (``metric_names._bucket_template`` filled with a number).
_part_regex: dict[str, str] = {"bucket": r"bucket_\d+", "index": r"\d+"}


def template_pattern(template: str) -> re.Pattern[str]:
    """A regular expression matching the filled ``template``; each ``{part}`` is a named group
    of one non-empty path segment (``{bucket}``: ``bucket_<n>``), e.g.
    ``template_pattern(HEAD_GRAD_NORM).match(name).group("head")``.  Readers use ``parse``."""
    pieces = _placeholder.split(template)
    regex = "".join(
        re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>{_part_regex.get(piece, '[^/]+')})"
        for i, piece in enumerate(pieces)
    )
    return re.compile(f"^{regex}\\Z")


def bucket_index(bucket: str) -> int:
    """``bucket_index("bucket_10") == 10``; ``ValueError`` for anything ``metric_names.probe_bucket`` does not write."""
    match = _bucket_pattern.match(bucket)
    if match is None:
        raise ValueError(f"not a probe bucket: {bucket!r}")
    return int(match.group("index"))


@dataclass(frozen=True)
class ParsedName:
    """A gradmon metric name taken apart: the template it fills (a constant of ``metric_names``, a
    plain name for a scalar) and the value of each placeholder, e.g. ``{"head": "op"}``."""

    template: str
    parts: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, part: str) -> str:
        return self.parts[part]


def _literal_length(template: str) -> int:
    return len(_placeholder.sub("", template))


def _first_segment(template: str) -> str | None:
    first = template.split("/", 1)[0]
    return None if _placeholder.search(first) else first


def _candidates() -> dict[str | None, tuple[tuple[str, re.Pattern[str]], ...]]:
    """Templates by their first path segment, most literal text first (ties: source order).

    A name may match several templates: ``grad_norm/bucket_1/num_steps`` fills both
    ``PROBE_NUM_STEPS`` and ``PROBE_COMPONENT_NORM`` (component ``num_steps``); the template with
    more literal text wins, so the explicit name is never read as a component.  Key None holds
    the templates whose first segment is a placeholder (none today); they are tried for every name.
    """
    ordered = sorted(dict.fromkeys(METRIC_TEMPLATES), key=_literal_length, reverse=True)
    compiled = [(t, template_pattern(t)) for t in ordered]
    firsts = {_first_segment(t) for t in ordered}
    return {
        first: tuple((t, p) for t, p in compiled if _first_segment(t) in (first, None)) for first in firsts | {None}
    }


_by_first_segment = _candidates()
_bucket_pattern = template_pattern(_bucket_template)


_module_pattern = re.compile(r"^module/(?P<module>[^/]+)/(?P<name>.+)\Z")
assert _module_template == "module/{module}/{name}"  # what _module_pattern reads


def split_module(name: str) -> tuple[str | None, str]:
    """``("p1", "grad/global_norm")`` for ``module/p1/grad/global_norm``; ``(None, name)`` otherwise."""
    match = _module_pattern.match(name)
    return (match.group("module"), match.group("name")) if match else (None, name)


def parse(name: str) -> ParsedName | None:
    """The template ``name`` fills and its parts, or None when it is not a gradmon metric name.

    A module's metric in a multi-module run (``module/<id>/<name>``) parses as ``<name>`` with
    ``parts["module"]`` set and its ``head`` given as the label ``<id>/<head>``
    (``metric_names.head_label``), so readers handle module x head as one head label.

    Every placeholder holds exactly one non-empty path segment, so ``latch/nan/op/first_iteration``
    is ``HEAD_NAN_LATCH_FIRST_ITERATION`` of head ``op``, never ``HEAD_NAN_LATCH`` of a head
    ``op/first_iteration``; a ``{bucket}`` is ``bucket_<n>``.  Where several templates match, the
    one with the most literal text wins (see ``_candidates``).
    """
    module, name = split_module(name)
    first = name.split("/", 1)[0]
    for template, pattern in _by_first_segment.get(first, _by_first_segment[None]):
        match = pattern.match(name)
        if match is not None:
            parts = match.groupdict()
            if module is not None:
                parts["module"] = module
                if "head" in parts:
                    parts["head"] = head_label(module, parts["head"])
            return ParsedName(template, parts)
    return None


def modules_of(names: Iterable[str]) -> list[str]:
    """The module ids of a multi-module run's metric names, once each, in first-seen order."""
    return list(dict.fromkeys(m for name in names if (m := split_module(name)[0]) is not None))


def heads_of(names: Iterable[str], template: str) -> list[str]:
    """The ``{head}`` of each of ``names`` that parses as the per-head ``template``, in ``names``' order."""
    return [parsed["head"] for name in names if (parsed := parse(name)) is not None and parsed.template == template]


def probe_buckets(names: Iterable[str]) -> list[str]:
    """The probe buckets ``names`` mention, once each, in numeric order (``bucket_2`` before ``bucket_10``)."""
    buckets = {parsed["bucket"] for name in names if (parsed := parse(name)) is not None and "bucket" in parsed.parts}
    return sorted(buckets, key=bucket_index)
