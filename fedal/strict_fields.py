"""No lenient coercion of config values: pydantic's lax mode turns `tau = true` into 1,
`stragglers = true` into 1.0 and `fd_exclude_own = "no"` or `0` into False, and the run silently
changes. Numbers may still come as their decimal strings, and booleans as "true"/"false"
(environment overrides are strings)."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ValidationInfo, field_validator


def _scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types among int, float and bool that `annotation` (Optional, Annotated and
    unions unwrapped) admits."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _scalar_kinds(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_scalar_kinds(arg) for arg in typing.get_args(annotation)))
    return {annotation} & {int, float, bool}


def _list_items(annotation: Any) -> Any | None:
    """X where `annotation` (Optional and Annotated unwrapped) is list[X]; else None."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _list_items(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return next((item for arg in typing.get_args(annotation) if (item := _list_items(arg)) is not None), None)
    if origin is list:
        args = typing.get_args(annotation)
        return args[0] if args else None
    return None


def strict_scalar(annotation: Any, value: Any) -> Any:
    """`value` for a field of type `annotation`, or ValueError where lax mode would coerce it
    (a list's items too: `disc_hidden = [true, 64.0]` is refused)."""
    item = _list_items(annotation)
    if item is not None and isinstance(value, list | tuple):
        return [strict_scalar(item, v) for v in value]
    kinds = _scalar_kinds(annotation)
    if not kinds or value is None:
        return value
    if kinds == {bool}:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise ValueError("Input should be a valid boolean (true or false)")
        return value
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"Input should be a valid {'number' if float in kinds else 'integer'}, not a boolean")
    if isinstance(value, float) and kinds <= {int, bool}:
        raise ValueError("Input should be a valid integer, not a float")
    return value


class NoCoercion(BaseModel):
    """A settings model whose int, float and bool fields (list items too) take no value that lax
    mode would coerce (strict_scalar)."""

    @field_validator("*", mode="before")
    @classmethod
    def _not_coerced(cls, value: Any, info: ValidationInfo) -> Any:
        return strict_scalar(cls.model_fields[info.field_name].annotation, value) if info.field_name else value
