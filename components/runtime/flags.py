"""Command-line flags derived from pydantic configs (every component's, the runtime's own included), so defaults and
help live in one place (the config model).

``add_model_arguments(parser, Model)`` adds ``--field-name`` for every field (help = the field's description,
default = the model's); ``model_from_args(Model, args)`` builds the model back, letting pydantic validate;
``argv_for(values)`` is the inverse, the flags that give a process those field values (``kvmesh serve`` starts every
component this way from a graph's sections).
Lists take comma-separated values; booleans take ``--flag/--no-flag``. A field whose name carries its unit
(``*_s``, ``*_ms``) and whose description does not say it gets the unit in its help ("in seconds"), so every
``--help`` states the unit of every timing flag. A field may name extra spellings of its flag in
``json_schema_extra={"cli_aliases": ["--seed-system-name"]}`` (the router keeps Dynamo's flag names this way).
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Name suffix -> unit (checked longest first: "_ms" before "_s").
_UNITS = {"_ms": "milliseconds", "_s": "seconds"}


def _unit(name: str, description: str) -> str:
    """The unit to add to the help of a field named ``*_s`` (``*_ms``) whose description does not name it:
    'in seconds; ', else ''."""
    if name.endswith("_per_s"):  # a rate (per second), not a duration: its description names what is counted
        return ""
    for suffix, unit in _UNITS.items():
        if name.endswith(suffix):
            return "" if unit in description.lower() else f"in {unit}; "
    return ""


def _base_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return annotation


def add_model_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], skip: set[str] | None = None) -> None:
    group = parser.add_argument_group(model.__name__, (model.__doc__ or "").strip().split("\n")[0])
    for name, field in model.model_fields.items():
        if skip and name in skip:
            continue
        base = _base_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        desc = field.description or ""
        help_text = f"{desc} ({_unit(name, desc)}default: {default})".replace("%", "%%")
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        aliases = extra.get("cli_aliases")
        flags = (
            [_flag(name), *(a for a in aliases if isinstance(a, str))] if isinstance(aliases, list) else [_flag(name)]
        )
        if base is bool and name.startswith("no_"):
            # `--no-operation` (Dynamo's planner flag): BooleanOptionalAction would read any `--no-` flag as "off",
            # so a field whose name is already a negation is a plain switch that turns it on.
            group.add_argument(*flags, dest=name, action="store_const", const=True, default=None, help=help_text)
        elif base is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(base) is list:
            group.add_argument(*flags, dest=name, default=None, help=help_text + "; comma-separated")
        else:
            group.add_argument(*flags, dest=name, default=None, help=help_text)


def given_values(model: type[BaseModel], args: argparse.Namespace) -> dict[str, Any]:
    """The model's fields whose flags were given, lists split on commas (pydantic converts the strings later)."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        v = getattr(args, name, None)
        if v is None:
            continue
        if typing.get_origin(_base_type(field.annotation)) is list and isinstance(v, str):
            v = [x.strip() for x in v.split(",") if x.strip()]
        values[name] = v
    return values


def model_from_args(model: type[M], args: argparse.Namespace, **extra: Any) -> M:
    """Only flags that were given override the model's defaults; pydantic validates and converts the strings."""
    return model.model_validate(given_values(model, args) | extra)


def argv_for(values: Mapping[str, Any]) -> list[str]:
    """Flags that set these field values in a parser built by ``add_model_arguments``: ``speedup_ratio: inf`` ->
    ``--speedup-ratio inf``, ``enable_prefix_caching: False`` -> ``--no-enable-prefix-caching``, a list ->
    comma-separated, a value that starts with '-' -> ``--flag=-value`` (argparse would read it as a flag). None means
    "the component's default": nothing is passed (a caller that must pass None where the default is not None has to
    refuse it before). A value no flag can carry (a mapping, a list item with a comma) raises ``ValueError``, which
    ``flag_problem`` lets a caller ask about first."""
    out: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        flag = _flag(name)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
            continue
        text = _list(name, value) if isinstance(value, list | tuple | set | frozenset) else _scalar(name, value)
        out += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return out


def flag_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be given to field ``name`` as a flag, or None when ``argv_for`` can carry it."""
    try:
        argv_for({name: value})
    except ValueError as e:
        return str(e)
    return None


def _list(name: str, values: Any) -> str:
    items = [_scalar(name, v) for v in values]
    if any("," in item for item in items):
        raise ValueError(f"{name}: a list item cannot contain ',' (the flag takes comma-separated values)")
    return ",".join(items)


def _scalar(name: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, Mapping | BaseModel | list | tuple | set | frozenset):
        raise ValueError(f"{name}: a {type(v).__name__} cannot be given as a flag")
    return str(v)
