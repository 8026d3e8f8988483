"""Pydantic's validation errors as one line a user can act on: each problem at its dotted place,
and a key no model field has named "unknown key", with the closest valid key when one is close
(a typo such as `round` for `rounds` read "Extra inputs are not permitted")."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def describe(exc: ValidationError, model: type[BaseModel] | None = None, whole: str | None = None) -> str:
    """`problem; problem; ...`. model: where unknown keys are looked up for a suggestion; whole:
    how a problem of the whole object is placed (None: its message alone, which names its fields)."""
    parts = []
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(str(p) for p in loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _suggestion(model, loc)
        place = where or whole
        parts.append(f"{place}: {msg}" if place else msg)
    return "; ".join(parts)


def one_of(value: str, names: Sequence[str], what: str) -> str:
    """`value` if it is one of `names`, else a ValueError that lists them."""
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join(names)}")
    return value


def _suggestion(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    names = _keys_at(model, loc[:-1]) if model is not None and loc else []
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6) if names else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keys_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """The keys the model found along `path` takes (field names and aliases); [] where unknown."""
    cls: Any = model
    for key in path:
        if not _is_model(cls):
            return []
        field = cls.model_fields.get(key) or next((f for f in cls.model_fields.values() if f.alias == key), None)
        if field is None:
            return []
        cls = _model_in(field.annotation)
    if not _is_model(cls):
        return []
    return sorted({n for name, f in cls.model_fields.items() for n in (name, f.alias) if n})


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if _is_model(annotation):
        return annotation
    for arg in typing.get_args(annotation):  # Model | None, Optional[Model], Annotated[Model, ...]
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_model(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseModel)
