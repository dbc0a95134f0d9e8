"""Typed reading of manifest fields: a field table derived from dataclass type hints plus a table of
constraints, and a reader that checks a YAML document against it, collecting every FieldError.

Generic: meshjob.spec.manifest supplies the dataclasses, the constraints (RULES) and the YAML renames; the parser,
`job_to_dict` and the CRD generator all read the one table this module builds.
"""

from __future__ import annotations

import builtins
import collections.abc
import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshjob.errors import FieldError

INT_OR_STRING = "int-or-string"  # an integer (minimum/maximum) or one of `enum`'s strings


@dataclass(frozen=True)
class FieldSchema:
    attr: str  # dataclass attribute (snake_case)
    yaml: str  # manifest name (camelCase)
    type: str  # JSON type: integer | number | string | boolean | object | array | int-or-string
    required: bool = False
    nullable: bool = False
    default: Any = None  # dataclass default (None when required)
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    enum: tuple[str, ...] | None = None  # int-or-string: the strings allowed beside integers
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    items: FieldSchema | None = None  # element schema of an array
    model: builtins.type | None = None  # nested dataclass of an object (or of array elements)
    preserve_unknown: bool = False  # free-form object (k8s ResourceRequirements)
    description: str = ""
    legacy: tuple[tuple[Any, str], ...] = ()  # refused values, each with what to write instead
    auto: str | None = None  # also takes this word: a search chooses the value (`stages: auto`, `microbatches: auto`)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def schema_for_type(attr: str, hint: Any, owner: str, renames: Mapping[str, str]) -> FieldSchema:
    """Map a Python type hint to its JSON schema (before RULES are applied)."""
    yaml_name = renames.get(attr, camel(attr))
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return dataclasses.replace(schema_for_type(attr, inner, owner, renames), nullable=True)
    if origin in (typing.Union, types.UnionType) and set(args) == {int, str}:
        return FieldSchema(attr, yaml_name, INT_OR_STRING)
    if hint is bool:
        return FieldSchema(attr, yaml_name, "boolean")
    if hint is int:
        return FieldSchema(attr, yaml_name, "integer")
    if hint is float:
        return FieldSchema(attr, yaml_name, "number")
    if hint is str:
        return FieldSchema(attr, yaml_name, "string")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return FieldSchema(attr, yaml_name, "object", model=hint)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            item = schema_for_type(attr, args[0], owner, renames)
            return FieldSchema(attr, yaml_name, "array", items=item, model=item.model)
        item = schema_for_type(attr, args[0], owner, renames)  # tuple[X, X]: fixed length
        return FieldSchema(attr, yaml_name, "array", items=item, min_items=len(args), max_items=len(args))
    if origin in (collections.abc.Mapping, dict):
        return FieldSchema(attr, yaml_name, "object", preserve_unknown=True)
    raise TypeError(f"{owner}.{attr}: no schema for type {hint!r}")


def build_table(
    cls: type,
    rules: Mapping[tuple[str, str], Mapping[str, Any]],
    renames: Mapping[str, str],
    skip: tuple[str, ...] = (),
) -> tuple[FieldSchema, ...]:
    """The field table of one dataclass: types from its hints, constraints from `rules`
    ((class name, attribute) -> FieldSchema keywords; item_minimum bounds array elements)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        schema = schema_for_type(f.name, hints[f.name], cls.__name__, renames)
        extra = dict(rules.get((cls.__name__, f.name), {}))
        item_bounds = {k: extra.pop(f"item_{k}") for k in ("minimum", "maximum") if f"item_{k}" in extra}
        if item_bounds:
            assert schema.items is not None, f"{cls.__name__}.{f.name}: item bounds on a field that is no array"
            schema = dataclasses.replace(schema, items=dataclasses.replace(schema.items, **item_bounds))
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()  # a template: copied before use (tables are cached)
        else:
            default = None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(dataclasses.replace(schema, **({"required": required, "default": default} | extra)))
    return tuple(out)


class FieldReader:
    """Collects FieldErrors; remembers which paths failed so semantic rules can skip them."""

    def __init__(
        self,
        table_of: Callable[[type], tuple[FieldSchema, ...]],
        check_free: Callable[[type, str, Any, str], list[FieldError]] | None = None,
    ) -> None:
        self.table_of = table_of  # dataclass -> its field table
        self.check_free = check_free  # (dataclass, attribute, value, path) -> errors of a free mapping's value
        self.errors: list[FieldError] = []
        self.bad: set[str] = set()

    def fail(self, path: str, value: Any, allowed: str) -> None:
        self.errors.append(FieldError(path, value, allowed))
        self.bad.add(path)

    def clean(self, *paths: str) -> bool:
        """True when no error touched these paths, their parents or their children."""
        for path in paths:
            for bad in self.bad:
                if bad == path or bad.startswith((path + ".", path + "[")) or path.startswith((bad + ".", bad + "[")):
                    return False
        return True

    def read_object(self, cls: type, node: Any, path: str) -> dict[str, Any] | None:
        """attr -> value of one dataclass from a mapping, or None when the node is no mapping."""
        table = self.table_of(cls)
        if not isinstance(node, Mapping):
            self.fail(path, node, f"a mapping with fields {', '.join(f.yaml for f in table)}")
            return None
        by_yaml = {f.yaml: f for f in table}
        for key in node:
            if not isinstance(key, str):
                self.fail(f"{path}[{key!r}]", key, "field names are strings")
            elif key not in by_yaml:
                self.fail(f"{path}.{key}", node[key], unknown_field(key, list(by_yaml)))
        values: dict[str, Any] = {}
        for f in table:
            sub = f"{path}.{f.yaml}"
            if f.yaml not in node or (node[f.yaml] is None and f.nullable):
                if f.required:
                    self.fail(sub, None, f"required: {describe(f)}")
                values[f.attr] = copy.deepcopy(f.default)
            else:
                values[f.attr] = self.read_value(f, node[f.yaml], sub)
                if self.check_free is not None and self.clean(sub):
                    for e in self.check_free(cls, f.attr, node[f.yaml], sub):
                        self.fail(e.path, e.value, e.allowed)
        return values

    def read_value(self, f: FieldSchema, value: Any, path: str) -> Any:
        """The checked (converted) value, or the field default after recording an error."""
        if f.auto is not None and value == f.auto:
            return f.auto  # the caller decides whether a search runs here (meshjob.spec.manifest.parse_job refuses it)
        if f.type in SCALARS:
            problem = check_scalar(f, value)
            if problem is not None:
                self.fail(path, value, problem)
                return f.default
            return plain_scalar(f, value)
        if f.type == "object" and f.preserve_unknown:
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                self.fail(path, value, "a mapping with string keys (k8s ResourceRequirements)")
                return copy.deepcopy(f.default)
            return copy.deepcopy(dict(value))
        if f.type == "object":
            assert f.model is not None, f"{path}: an object field without a model"
            attrs = self.read_object(f.model, value, path)
            return f.default if attrs is None else f.model(**attrs)
        return self.read_array(f, value, path)

    def read_array(self, f: FieldSchema, value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)):
            self.fail(path, value, f"{f.auto + ' or ' if f.auto else ''}a list: {describe(f)}")
            return f.default
        if f.min_items is not None and len(value) < f.min_items or f.max_items is not None and len(value) > f.max_items:
            self.fail(path, value, describe(f))
            return f.default
        assert f.items is not None, f"{path}: an array field without an item schema"
        items = []
        for i, item in enumerate(value):
            items.append(self.read_value(f.items, item, f"{path}[{i}]"))
        return tuple(items)


def unknown_field(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown field{hint}; known fields: {', '.join(known)}"


def describe(f: FieldSchema) -> str:
    """What a field accepts, in words (used in every structural error)."""
    if f.type == "array":
        if f.min_items is not None and f.min_items == f.max_items:
            count = f"exactly {f.min_items}"
        elif f.max_items is not None:
            count = f"{f.min_items or 0} to {f.max_items}"
        else:
            count = f"at least {f.min_items or 0}"
        assert f.items is not None, f"{f.attr}: an array field without an item schema"
        return f"a list of {count} items, each {describe(f.items)}"
    if f.type == "object":
        return "a mapping"
    if f.type == INT_OR_STRING:
        return " or ".join(f.enum or ()) + " or " + _number_words("an integer", f)
    if f.enum is not None:
        return "one of " + ", ".join(f.enum)
    if f.type == "string":
        return _string_words(f)
    words = {"integer": "an integer", "number": "a number", "boolean": "true or false"}[f.type]
    return _number_words(words, f)


def _number_words(words: str, f: FieldSchema) -> str:
    if f.minimum is not None and f.maximum is not None and not f.exclusive_minimum:
        return f"{words} in {_num(f.minimum)}..{_num(f.maximum)}"
    if f.minimum is not None:
        words += f" {'>' if f.exclusive_minimum else '>='} {_num(f.minimum)}"
    if f.maximum is not None:
        words += f"{' and' if f.minimum is not None else ''} <= {_num(f.maximum)}"
    return words


def _string_words(f: FieldSchema) -> str:
    words = "a string"
    if f.min_length and f.max_length is not None:
        words += f" of {f.min_length} to {f.max_length} characters"
    elif f.min_length:
        words += f" of at least {f.min_length} character(s)"
    elif f.max_length is not None:
        words += f" of at most {f.max_length} characters"
    if f.pattern is not None:
        words += f" matching {f.pattern}"
    return words


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


SCALARS = ("integer", "number", "string", "boolean", INT_OR_STRING)


def _integral(value: Any) -> bool:
    """An int, or a float with an integral value (JSON and Kubernetes do not tell 1e3 from 1000)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and value.is_integer()


def plain_scalar(f: FieldSchema, value: Any) -> Any:
    """A checked scalar in its Python type: integers as int (1e3 -> 1000), numbers as float."""
    if f.type == "number":
        return float(value)
    if f.type in ("integer", INT_OR_STRING) and isinstance(value, float):
        return int(value)
    return value


def check_scalar(f: FieldSchema, value: Any) -> str | None:
    """None when a scalar value fits its schema, else what is allowed (in words)."""
    for old, instead in f.legacy:
        if type(value) is type(old) and value == old:
            return f"{describe(f)}; {old!r} is no longer accepted: {instead}"
    if f.type == INT_OR_STRING and isinstance(value, str) or f.type == "string":
        return _check_string(f, value)
    if f.type in ("integer", INT_OR_STRING):
        if not _integral(value):
            return describe(f)
    elif f.type == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return describe(f)
    elif f.type == "boolean":
        return None if isinstance(value, bool) else describe(f)
    else:
        return None
    if f.minimum is not None and (value < f.minimum or (f.exclusive_minimum and value == f.minimum)):
        return describe(f)
    if f.maximum is not None and value > f.maximum:
        return describe(f)
    return None


def _check_string(f: FieldSchema, value: Any) -> str | None:
    if not isinstance(value, str):
        return describe(f)
    if f.enum is not None and value not in f.enum:
        return describe(f)
    if f.max_length is not None and len(value) > f.max_length:
        return describe(f)
    if f.pattern is not None and not re.match(f.pattern, value):
        return describe(f)
    if f.min_length is not None and len(value) < f.min_length:
        return describe(f)
    return None
