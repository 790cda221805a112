"""The base of every config section, and pydantic's errors as one ``field: what is allowed, got X`` line.

A section is a pydantic ``BaseModel`` that forbids unknown keys, takes no type coercion
(``strict``: ``"3"`` is not a number, ``1`` is not ``true``; an integer is a number),
refuses NaN and Inf, and validates assignments.  ``parse`` builds one from plain data and
turns pydantic's ``ValidationError`` into exactly one ``ConfigError`` that names the dotted
field path (``regularizers[0].fn``, ``model.head_logit_scale.op``) and what is allowed,
worded from the field's type and bounds.  A validator that needs its own wording raises
``ConfigError`` with a path relative to where it runs.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar, Union

import annotated_types as at
from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError, model_validator
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)

PLAIN_DATA = "plain data (strings, finite numbers, true/false, null, lists, and mappings with string keys)"


class ConfigError(ValueError):
    """A config value is not allowed; ``str()`` names the field and what is allowed.  ``problems``:
    the problems one error stands for (``of_all``), each a whole line, for a shortened display."""

    def __init__(self, field_path: str, message: str, problems: Sequence[str] = ()) -> None:
        self.field_path = field_path
        self.message = " ".join(part.strip() for part in message.splitlines() if part.strip())  # one line
        self.problems = list(problems)
        super().__init__(f"{field_path}: {self.message}")

    @classmethod
    def of_all(cls, field_path: str, problems: Sequence[ConfigError]) -> ConfigError:
        """One error for ``problems``: the problem itself when there is one, else all of them on one
        line (``N problems: a; b; ...``; the CLI shows the first few and a count)."""
        if len(problems) == 1:
            return problems[0]
        texts = [str(p) for p in problems]
        return cls(field_path, f"{len(texts)} problems: " + "; ".join(texts), texts)


class ConfigModel(BaseModel):
    """A config section: unknown keys, coercion, NaN/Inf and invalid assignments are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        return {} if data is None else data  # YAML ``vgs:`` with nothing under it

    def __setattr__(self, name: str, value: Any) -> None:
        before = dict(self.__dict__)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            # pydantic has already stored the value when a check across fields refuses it: undo that
            self.__dict__.clear()
            self.__dict__.update(before)
            raise config_error(type(self), exc, SECTION_PATHS.get(type(self), "")) from None


SECTION_PATHS: dict[type[BaseModel], str] = {}
"""Where each section class sits in the whole config (``PPOSection``: ``ppo``), for errors on assignment."""


def parse(cls: type[M], data: Any, root: str = "") -> M:
    """``cls`` built and validated from plain data (None: all defaults); a ``ConfigError`` on the
    first problem, its field path under ``root``."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise config_error(cls, exc, root, data) from None


def config_error(cls: type[BaseModel], exc: ValidationError, root: str = "", data: Any = None) -> ConfigError:
    """One ``ConfigError`` for ``exc``: an unknown key first (most likely the cause), else the first error."""
    errors = exc.errors(include_url=False)
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    return _error_for(cls, err, root, data)


def config_errors(cls: type[BaseModel], exc: ValidationError, root: str = "", data: Any = None) -> list[ConfigError]:
    """Every problem in ``exc`` as its own ``ConfigError`` (same wording as ``config_error``), each once."""
    out: list[ConfigError] = []
    for err in exc.errors(include_url=False):
        error = _error_for(cls, err, root, data)
        if str(error) not in {str(e) for e in out}:
            out.append(error)
    return out


def _error_for(cls: type[BaseModel], err: Any, root: str, data: Any) -> ConfigError:
    """``ConfigError`` for one of pydantic's error dicts."""
    loc, kind, got = tuple(err["loc"]), err["type"], err.get("input")
    path, tp, info, parent, used = _walk(cls, loc, root)
    if used < len(loc) and data is not None:
        got = _value_at(data, loc[:used], got)
    if kind == "extra_forbidden":
        return ConfigError(path or "config", f"unknown key; allowed keys here: {', '.join(parent.model_fields)}")
    if used < len(loc) and loc[used] == "[key]":
        return ConfigError(path or "config", f"keys must be strings, got {_show(loc[used - 1])}")
    if kind == "value_error" and isinstance((err.get("ctx") or {}).get("error"), ConfigError):
        inner: ConfigError = err["ctx"]["error"]
        return ConfigError(_join(path, inner.field_path) or "config", inner.message)
    if kind in ("frozen_instance", "frozen_field"):
        return ConfigError(path, "cannot be changed in place; assign the whole section a new value")
    allowed = _allowed(tp, info)
    if kind == "missing":
        return ConfigError(path or "config", f"is required; must be {allowed}")
    if kind in _BOUND_ERRORS:
        return ConfigError(path or "config", f"must be{_bounds(_peel(tp, info)[1])}, got {_show(got)}")
    if kind == "finite_number":
        return ConfigError(path or "config", f"must be a finite number{_bounds(_peel(tp, info)[1])}, got {got!r}")
    return ConfigError(path or "config", f"must be {allowed}, got {_show(got)}")


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _walk(cls: type[BaseModel], loc: tuple[Any, ...], root: str) -> tuple[str, Any, Any, Any, int]:
    """Follow pydantic's ``loc`` through the types: (dotted path, type there, its FieldInfo or
    None, the innermost model passed, how many ``loc`` parts were followed)."""
    path, tp, info, parent = root, cls, None, cls
    for used, part in enumerate(loc):
        inner = _peel(tp)[0]
        origin = typing.get_origin(inner)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            parent, path = inner, _join(path, str(part))
            if part not in inner.model_fields:
                return path, None, None, parent, used + 1
            info = inner.model_fields[part]
            tp = info.annotation
        elif origin is list and isinstance(part, int):
            path, tp, info = f"{path}[{part}]", typing.get_args(inner)[0], None
        elif origin is dict and part != "[key]":
            if used + 1 < len(loc) and loc[used + 1] == "[key]":
                return path, tp, info, parent, used + 1
            path, tp, info = _join(path, str(part)), typing.get_args(inner)[1], None
        else:  # a union member's tag, or the inside of plain data: report where we are
            return path, tp, info, parent, used
    return path, tp, info, parent, len(loc)


def _value_at(data: Any, loc: tuple[Any, ...], default: Any) -> Any:
    try:
        for part in loc:
            data = data[part]
    except (KeyError, IndexError, TypeError):
        return default
    return data


def _join(path: str, part: str) -> str:
    if not part:
        return path
    if not path or part.startswith("["):
        return f"{path}{part}"
    return f"{path}.{part}"


def _show(value: Any, limit: int = 200) -> str:
    """``repr(value)``, or, when longer than ``limit``, what it is without any of its text: cutting it
    here, before the CLI masks credentials, could print part of a password (mask, then cut)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    unit = "characters" if isinstance(value, str) else "items"
    size = f" of {len(value)} {unit}" if hasattr(value, "__len__") else f" ({len(text)} characters)"
    return f"a {type(value).__name__}{size}, too long to show"


def _peel(tp: Any, info: FieldInfo | None = None) -> tuple[Any, list[Any], bool]:
    """``tp`` without ``Annotated`` and ``Optional``; the bounds met on the way (and in ``info``);
    whether null is allowed."""
    constraints, nullable = (list(info.metadata) if info is not None else []), False
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp, *extra = typing.get_args(tp)
            for item in extra:
                constraints.extend(item.metadata if isinstance(item, FieldInfo) else [item])
        elif origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp, constraints, nullable
            tp, nullable = args[0], True
        else:
            return tp, constraints, nullable


def _bounds(constraints: list[Any]) -> str:
    parts = []
    for c in constraints:
        if isinstance(c, at.Ge):
            parts.append(f">= {c.ge}")
        elif isinstance(c, at.Gt):
            parts.append(f"> {c.gt}")
        elif isinstance(c, at.Le):
            parts.append(f"<= {c.le}")
        elif isinstance(c, at.Lt):
            parts.append(f"< {c.lt}")
    return (" " + " and ".join(parts)) if parts else ""


def _allowed(tp: Any, info: FieldInfo | None) -> str:
    extra = info.json_schema_extra if info is not None and isinstance(info.json_schema_extra, dict) else {}
    if "allowed" in extra:
        return str(extra["allowed"])
    return describe(tp, info)


def describe(tp: Any, info: FieldInfo | None = None, plural: bool = False) -> str:
    """What a value of type ``tp`` (with the bounds in ``info``) may be, in words."""
    tp, constraints, nullable = _peel(tp, info)
    bounds = _bounds(constraints)
    origin = typing.get_origin(tp)
    if tp is JsonValue:
        text = PLAIN_DATA
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        text = f"{'mappings' if plural else 'a mapping'} of {', '.join(tp.model_fields)}"
    elif origin is Literal:
        text = "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    elif origin is list:
        text = f"{'lists' if plural else 'a list'} of {describe(typing.get_args(tp)[0], plural=True)}"
    elif origin is dict:
        text = f"{'mappings' if plural else 'a mapping'} of strings to {describe(typing.get_args(tp)[1], plural=True)}"
    else:
        singular, many = _SCALARS.get(tp, (getattr(tp, "__name__", str(tp)),) * 2)
        text = (many if plural else singular) + bounds
        if tp is str and any(isinstance(c, at.MinLen) and c.min_length >= 1 for c in constraints):
            text = "non-empty strings" if plural else "a non-empty string"
    return f"{text} or null" if nullable else text


_SCALARS: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "true/false values"),
    str: ("a string", "strings"),
    Any: ("any value", "any values"),
}
