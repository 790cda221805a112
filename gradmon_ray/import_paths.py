"""Code a config may name: a ``"package.module:attribute"`` import path.

The one place a regularizer named in a config (``regularizers[].fn``) is imported.  It
needs neither torch nor Ray, so config validation resolves ``fn`` here, before anything
starts, without importing torch or RLlib; ``gradmon_ray.losses.regularizers`` maps the names
resolved here to its functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

BUILTIN_REGULARIZER_NAMES = ("logit_l2", "uniform_prior_kl", "weight_l2")
"""The built-in regularizers (their functions live in ``gradmon_ray.losses.regularizers``)."""


def import_path(target: str) -> Any:
    """The attribute a ``"package.module:attribute"`` path names; ``ImportError`` or
    ``AttributeError`` when it does not exist."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_regularizer_fn(name: str, fn: str | Callable[..., Any] | None = None) -> str | Callable[..., Any]:
    """What regularizer ``name`` computes: a built-in's name, or the callable ``fn`` names.

    ``fn`` is a built-in name, ``"package.module:function"`` or a callable (default: the
    built-in called ``name``).  An unknown name, a failed import or a non-callable is a
    ``ValueError`` that names the regularizer and the allowed built-ins.
    """
    target = name if fn is None else fn
    if callable(target) or target in BUILTIN_REGULARIZER_NAMES:
        return target
    if ":" in target:
        try:
            resolved = import_path(target)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"regularizer {name!r}: cannot import {target!r}: {exc}") from None
        except Exception as exc:  # the module itself fails on import: still the config's problem
            raise ValueError(f"regularizer {name!r}: cannot import {target!r}: {type(exc).__name__}: {exc}") from None
        if not callable(resolved):
            raise ValueError(f"regularizer {name!r}: {target!r} is not callable")
        return resolved
    raise ValueError(
        f"regularizer {name!r}: unknown function {target!r}; use one of {sorted(BUILTIN_REGULARIZER_NAMES)} "
        "or 'package.module:function'"
    )
