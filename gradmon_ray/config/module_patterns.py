"""Module ids or glob patterns of them: which modules a setting (``modules``, ``probe.modules``) names.

League and self-play training adds its modules while the run goes on (``Algorithm.add_module``), so
a setting may name a module the learner does not have yet: an id (``main_exploiter_0``) or a glob
pattern (``league_*``, ``snapshot_?``; ``*`` any run of characters, ``?`` one, nothing else is a
wildcard).  Each is checked against the metric-name grammar when the setting is read (an id must be
one a metric name can carry, ``head_labels.check_name``; a pattern must be such an id once its
wildcards are filled), matched when a module arrives, and an entry that never matched a module is
reported once (``unmatched``), never refused: a typo stays visible without stopping a league.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from gradmon_ray.head_labels import NAME_RULE, check_name

WILDCARDS = ("*", "?")


def is_pattern(entry: str) -> bool:
    """Whether ``entry`` is a glob pattern (holds ``*`` or ``?``) rather than one module id."""
    return any(w in entry for w in WILDCARDS)


def check_module_entry(entry: object, what: str) -> str:
    """``entry`` if it is a module id (``check_name``) or a glob pattern whose filled-in ids would be
    (``*`` and ``?`` the only wildcards); else a one-line ``ValueError`` naming ``what``."""
    if not isinstance(entry, str) or not is_pattern(entry):
        return check_name(entry, what)
    filled = entry.replace("*", "x").replace("?", "x")
    try:
        check_name(filled, what)
    except ValueError:
        raise ValueError(
            f"{what} {entry!r} is not a module id or a glob pattern of one: use {NAME_RULE}, with * or ? as wildcards"
        ) from None
    return entry


def matches(module_id: str, entries: Sequence[str] | None) -> bool:
    """Whether ``entries`` (ids and glob patterns) name ``module_id``; None names every module."""
    if entries is None:
        return True
    return any(_glob_match(module_id, e) if is_pattern(e) else module_id == e for e in entries)


def _glob_match(module_id: str, pattern: str) -> bool:
    # "[" escaped: only * and ? are wildcards (fnmatch would read [...] as a character class)
    return fnmatch.fnmatchcase(module_id, pattern.replace("[", "[[]"))


def unmatched(entries: Sequence[str] | None, module_ids: Iterable[str]) -> list[str]:
    """The entries (ids and patterns) that name none of ``module_ids``, in their order."""
    have = [str(m) for m in module_ids]
    return [e for e in entries or () if not any(matches(m, (e,)) for m in have)]
