"""Mistakes in what a user asked for, as one line each: the ``video-grpo`` error path.

A :class:`UsageError` is an error of the input (a file, a key, a type, a value, YAML), not of the
program: ``video-grpo`` prints its message as one line on stderr and exits 2 (``--debug`` or
``VIDEO_GRPO_DEBUG=1``: the traceback instead). Anything else that escapes a command is a bug and
keeps its traceback. :func:`recipe_error` turns what :func:`rl_bridge.recipe.load_recipe`
raises into one, naming the file (or the command line), the key and what was expected::

    recipes/x.yaml: train.stepz: unknown key, did you mean train.steps? (train has: steps, ...)
    command line: train.steps: expected an integer, got 'abc'

Imports nothing heavy: the CLI reports these before torch loads.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = ["UsageError", "recipe_error", "validation_message"]


class UsageError(Exception):
    """The user's input is wrong; the message is one line that says where, what and what was
    expected (``video-grpo``: printed without a traceback, exit status 2)."""


_FIELDS_SHOWN = 10
_ERRORS_SHOWN = 3


def recipe_error(
    error: Exception, path: str | os.PathLike[str] | None, overrides: Sequence[str], model: type | None = None
) -> UsageError | None:
    """The :class:`UsageError` for what ``load_recipe(path, overrides)`` raised, or ``None`` when
    ``error`` is not an input error (a bug: let it propagate).

    Args:
        error: the exception.
        path: the recipe file (``None``: the built-in recipe).
        overrides: the ``dotted.key=value`` overrides.
        model: the pydantic model validated (default :class:`~rl_bridge.recipe.Recipe`).
    """
    import yaml

    where = str(path) if path is not None else "recipe"
    if isinstance(error, IsADirectoryError):
        return UsageError(f"{where}: is a directory, not a recipe file")
    if isinstance(error, FileNotFoundError):
        return UsageError(f"{where}: no such recipe file")
    if isinstance(error, PermissionError):
        return UsageError(f"{where}: permission denied")
    if isinstance(error, UnicodeDecodeError):
        return UsageError(f"{where}: not a text file ({error.reason} at byte {error.start})")
    if isinstance(error, yaml.YAMLError):
        return UsageError(f"{where}: {yaml_problem(error)}")
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        if model is None:
            from rl_bridge.recipe import Recipe

            model = Recipe
        return UsageError(validation_message(error, model, path=path, overrides=overrides))
    if isinstance(error, ValueError):  # load_recipe's own: a malformed override, a file that is no mapping
        return UsageError(_one_line(str(error)))
    return None


def yaml_problem(error: Exception) -> str:
    """``LINE:COLUMN: invalid YAML: PROBLEM`` for a ``yaml.YAMLError``."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return _one_line(f"{at}invalid YAML: {problem}")


def validation_message(
    error: Any, model: type, *, path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> str:
    """One line for a pydantic ``ValidationError`` of ``model``: per error (at most three), where it
    came from (``path``, or ``command line`` when an override set that key), the dotted key and
    what was expected."""
    keys = [o.partition("=")[0].strip() for o in overrides]
    parts = []
    items = error.errors(include_url=False)
    for item in items[:_ERRORS_SHOWN]:
        loc = tuple(str(part) for part in item["loc"])
        key = ".".join(loc)
        if key and any(_related(key, k) for k in keys):
            where = "command line"
        elif path is not None:
            where = str(path)
        else:
            where = "command line" if keys else "recipe"
        what = _expected(item, model, loc)
        parts.append(f"{where}: {key}: {what}" if key else f"{where}: {what}")
    if len(items) > _ERRORS_SHOWN:
        parts.append(f"and {len(items) - _ERRORS_SHOWN} more")
    return _one_line("; ".join(parts))


def _related(key: str, override: str) -> bool:
    """The error at ``key`` is about the value ``override`` set (the same key, or one inside it)."""
    return key == override or key.startswith(override + ".") or override.startswith(key + ".")


_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "path_type": "a path",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping of keys to values",
    "model_type": "a section (a mapping of keys to values)",
    "model_attributes_type": "a section (a mapping of keys to values)",
}


def _expected(item: Any, model: type, loc: tuple[str, ...]) -> str:
    kind, message, ctx = item["type"], item["msg"], item.get("ctx") or {}
    got = _show(item.get("input"))
    if kind == "extra_forbidden":
        return _unknown_key(model, loc)
    if kind == "missing":
        return "missing (required)"
    if kind in ("value_error", "assertion_error"):
        return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {got}"
    if kind == "literal_error" and "expected" in ctx:
        return f"expected {ctx['expected']}, got {got}"
    if message.startswith("Input should be "):
        return f"expected {message.removeprefix('Input should be ')}, got {got}"
    return f"{message[:1].lower()}{message[1:]} (got {got})"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unknown_key(model: type, loc: tuple[str, ...]) -> str:
    section = _model_at(model, loc[:-1])
    if section is None:
        return "unknown key"
    names = [field.alias or name for name, field in section.model_fields.items()]
    owner = ".".join(loc[:-1]) or ("a recipe" if model.__name__ == "Recipe" else f"a {model.__name__}")
    shown = ", ".join(names[:_FIELDS_SHOWN]) + (
        f", ... ({len(names)} keys)" if len(names) > _FIELDS_SHOWN else ""
    )
    close = difflib.get_close_matches(loc[-1], names, n=1)
    hint = f", did you mean {'.'.join((*loc[:-1], close[0]))}?" if close else ""
    return f"unknown key{hint} ({owner} has: {shown})"


def _model_at(model: type, loc: Sequence[str]) -> Any:
    """The pydantic model class of the section at ``loc`` inside ``model``, or ``None``."""
    from pydantic import BaseModel

    current: Any = model
    for part in loc:
        fields = current.model_fields
        field = fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        if field is None:
            return None
        current = next(
            (
                t
                for t in (field.annotation, *_union_members(field.annotation))
                if isinstance(t, type) and issubclass(t, BaseModel)
            ),
            None,
        )
        if current is None:
            return None
    return current


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return ()


def _one_line(text: str) -> str:
    return " ".join(text.split())
