"""Reading manifests and hosts files safely, and the way kubectl reads them.

Every YAML input of meshjob (TrainingJob manifests for `plan`, `run`, `simulate` and the worker,
hosts files) goes through `load_documents`. It builds plain values (dict, list, str, int, float,
bool, None) from libyaml's event stream with its own small composer instead of PyYAML's, because
PyYAML's composer recurses (500 levels of `[` end in a RecursionError), expands nothing but lets
every consumer expand aliases (a 1 KB "billion laughs" file becomes gigabytes once printed), and
silently keeps the last of two equal keys. Here:

- work is bounded (`Limits`): input size, nesting depth, alias uses and the expanded size of each
  document (aliases counted as the copies they stand for) are checked while the events stream in,
  so an over-limit input is refused before it costs more than the limit; an alias may only name an
  anchor whose node is complete, so documents never contain cycles;
- a key given twice in one mapping is an error naming the key's path (stricter than kubectl 1.32,
  which silently keeps the last one: one of the two values is a mistake either way);
- plain scalars resolve as kubectl resolves them (sigs.k8s.io/yaml on go-yaml v2), not with
  PyYAML's YAML 1.1 rules: `1e-3`, `1E3`, `.5` are floats; integers take 0x/0o/0b prefixes, a
  leading 0 means octal and `_` separators are dropped; null is `~`/`null`/empty; and the booleans
  are go-yaml's: true/false, yes/no, on/off and y/n in their lower, Capitalised and UPPER forms.
  We keep YAML 1.1's booleans on purpose: the operator only ever sees what kubectl sent, so
  `meshjob plan` must read a manifest the same way or the two would disagree about the same
  file; no meshjob field takes the strings on/off/yes/no, so nothing needs them unquoted.
  Integers beyond 64 bits become floats and numbers beyond float range stay strings, as in Go.
  Timestamps stay strings as written (as kubectl sends them). Mapping keys become strings as in
  JSON (`1:` is "1", `on:` and `y:` are "true"); a null or collection key is an error (as in
  kubectl). tests/test_safeyaml.py checks these against `kubectl create --dry-run=server`;
- `<<` merge keys work (explicit keys win, then earlier merged mappings);
- tags other than the core ones (!!str, !!int, !!float, !!bool, !!null, !!map, !!seq) are
  refused (no !!binary, !!set, !!python/...; kubectl decodes !!binary, no manifest needs it).

`check_tree` applies the same depth and size limits to documents that arrive already parsed
(JSON from the API server in the operator, dicts built in-process), so the model reader never
recurses deeper or walks longer than a YAML document could make it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from meshjob.errors import FieldError, SpecError, short, short_text

STDIN = "-"
Scalar = str | int | float | bool | None  # a plain scalar's value


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 4 * 2**20  # per input; the API server takes at most 3 MiB per request
    max_depth: int = 64  # nested collections; the deepest real field (podTemplate affinity) needs ~12
    max_aliases: int = 64  # alias uses per document
    max_nodes: int = 100_000  # expanded nodes (collections and scalars) per document
    max_documents: int = 1000  # per input


LIMITS = Limits()


# ---------------------------------------------------------------------------------------------
# Reading the text


def read_text(path: str, what: str, limits: Limits = LIMITS) -> str:
    """The UTF-8 text of `path` ("-" reads standard input), refused beyond limits.max_bytes. Errors
    name the file; `what` says what it should hold (e.g. "TrainingJob manifest")."""
    source = source_name(path)
    try:
        if path == STDIN:
            data = sys.stdin.buffer.read(limits.max_bytes + 1)
        else:
            with open(path, "rb") as fh:
                data = fh.read(limits.max_bytes + 1)
    except OSError as err:
        raise SpecError([FieldError(source, path, f"a readable {what} ({err.strerror or err})")]) from None
    if len(data) > limits.max_bytes:
        raise SpecError(
            [FieldError(source, f"more than {limits.max_bytes} bytes", f"a {what} of at most {limits.max_bytes} bytes")]
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError([FieldError(source, f"byte {err.start}", f"a {what} in UTF-8")]) from None


def source_name(path: str) -> str:
    return "<stdin>" if path == STDIN else path


# ---------------------------------------------------------------------------------------------
# Scalars, as kubectl resolves them

_BOOLS = {
    word: value
    for value, words in ((True, "y yes true on"), (False, "n no false off"))
    for w in words.split()
    for word in (w, w.capitalize(), w.upper())
}
_NULLS = {"", "~", "null", "Null", "NULL"}
_SPECIAL_FLOATS = (
    {
        f"{sign}{word}": value
        for word, value in ((".inf", math.inf), (".Inf", math.inf), (".INF", math.inf))
        for sign in ("", "+")
    }
    | {f"-{word}": -math.inf for word in (".inf", ".Inf", ".INF")}
    | {word: math.nan for word in (".nan", ".NaN", ".NAN")}
)
_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INT_RANGE = (-(2**63), 2**64 - 1)  # Go's int64 and uint64
_MAX_INT_TEXT = 70  # sign, prefix and 64 binary digits; longer digit strings are never int64


def _go_int(plain: str) -> int | None:
    m = _INT.fullmatch(plain) if len(plain) <= _MAX_INT_TEXT else None
    if m is None:
        return None
    sign, digits = m.groups()
    prefix = digits[:2].lower()
    if prefix in ("0x", "0o", "0b"):
        value = int(digits[2:], {"0x": 16, "0o": 8, "0b": 2}[prefix])
    elif digits[0] == "0" and len(digits) > 1:  # a leading 0 is octal to Go's base-0 ParseInt
        value = int(digits, 8)
    else:
        value = int(digits)
    value = -value if sign == "-" else value
    return value if _INT_RANGE[0] <= value <= _INT_RANGE[1] else None


def _go_float(text: str) -> float | None:
    if not _FLOAT.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None  # Go refuses out-of-range floats: a string then


def resolve_plain(text: str) -> Scalar:
    """The value of an untagged plain scalar, as sigs.k8s.io/yaml (go-yaml v2) resolves it."""
    if text in _BOOLS:
        return _BOOLS[text]
    if text in _NULLS:
        return None
    if text in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[text]
    if text[:1] == ".":
        value = _go_float(text)
        return text if value is None else value
    if text[:1].isdigit() or text[:1] in "+-":
        plain = text.replace("_", "")
        number: int | float | None = _go_int(plain)
        if number is None:
            number = _go_float(plain)
        return text if number is None else number
    return text


_CORE = "tag:yaml.org,2002:"
_TAG_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (float, int), "bool": bool, "null": type(None)}


def _tagged(tag: str, text: str) -> Scalar:
    """The value of a scalar with an explicit core tag; ValueError when it does not fit."""
    kind = tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag
    if kind in ("str", "!"):
        return text
    resolved = resolve_plain(text)
    wanted = _TAG_TYPES.get(kind)
    if wanted is None:
        raise ValueError(f"tag {tag} is not supported (only !!str, !!int, !!float, !!bool, !!null)")
    if not isinstance(resolved, wanted) or kind in ("int", "float") and isinstance(resolved, bool):
        raise ValueError(f"{text!r} is not a valid !!{kind}")
    return float(resolved) if kind == "float" and isinstance(resolved, (int, float)) else resolved


def _key_string(key: Any) -> str | None:
    """A mapping key as the JSON object key kubectl makes of it; None when it cannot be one."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(key, ".nan" if key != key else f"{key:g}")
    return None


# ---------------------------------------------------------------------------------------------
# The composer


MERGE = "<<"


@dataclass
class _Frame:
    """An open mapping or sequence."""

    value: Any  # the dict or list being filled
    anchor: str | None
    path: str
    nodes: int = 1  # expanded size so far, this node included
    key: str | None = None  # mapping: the key waiting for its value
    merge: bool = False  # mapping: the waiting key is <<
    merged: list[dict[str, Any]] = field(default_factory=list)  # mapping: << sources, in order


class _Composer:
    """Plain values from one stream of YAML events, within limits."""

    def __init__(self, source: str, limits: Limits) -> None:
        self.source, self.limits = source, limits
        self.documents: list[Any] = []
        self._start_document()

    def _start_document(self) -> None:
        self.stack: list[_Frame] = []
        self.anchors: dict[str, tuple[Any, int]] = {}
        self.aliases = 0
        self.nodes = 0

    def fail(self, event: yaml.Event, value: Any, allowed: str) -> SpecError:
        mark = getattr(event, "start_mark", None)
        where = f"{self.source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self.source
        return SpecError([FieldError(where, value, allowed)])

    def feed(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.DocumentStartEvent):
            self._start_document()
        elif isinstance(event, yaml.ScalarEvent):
            self._count(event, 1)
            self._add(event, self._scalar(event), 1, event.anchor, scalar=True)
        elif isinstance(event, yaml.AliasEvent):
            self._alias(event)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self._open(event)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            frame = self.stack.pop()
            if isinstance(frame.value, dict) and frame.merged:
                frame.value = self._merge(frame)
            self._add(event, frame.value, frame.nodes, frame.anchor)

    def _count(self, event: yaml.Event, nodes: int) -> None:
        self.nodes += nodes
        if self.nodes > self.limits.max_nodes:
            raise self.fail(
                event,
                self._path(),
                f"a document of at most {self.limits.max_nodes} values (aliases count as the copies they stand for)",
            )

    def _scalar(self, event: yaml.ScalarEvent) -> Scalar:
        if event.tag is None:
            return resolve_plain(event.value) if event.implicit[0] else event.value
        try:
            return _tagged(event.tag, event.value)
        except ValueError as err:
            raise self.fail(event, short_text(event.value, 80), str(err)) from None

    def _alias(self, event: yaml.AliasEvent) -> None:
        assert event.anchor is not None  # an alias always names an anchor
        self.aliases += 1
        if self.aliases > self.limits.max_aliases:
            raise self.fail(
                event, f"*{short_text(event.anchor, 80)}", f"at most {self.limits.max_aliases} aliases per document"
            )
        if event.anchor not in self.anchors:
            raise self.fail(
                event,
                f"*{short_text(event.anchor, 80)}",
                "an alias of an anchor defined earlier, outside the alias's own node",
            )
        value, nodes = self.anchors[event.anchor]
        self._count(event, nodes)
        self._add(event, value, nodes, None, scalar=not isinstance(value, (dict, list)))

    def _open(self, event: yaml.CollectionStartEvent) -> None:
        mapping = isinstance(event, yaml.MappingStartEvent)
        if event.tag not in (None, "!", _CORE + ("map" if mapping else "seq")):
            raise self.fail(
                event,
                event.tag,
                f"a {'mapping' if mapping else 'sequence'} without tag, or tagged !!{'map' if mapping else 'seq'}",
            )
        parent = self.stack[-1] if self.stack else None
        if parent is not None and isinstance(parent.value, dict) and parent.key is None:
            raise self.fail(
                event, self._path(), "mapping keys that are strings, numbers or booleans (not mappings or lists)"
            )
        if len(self.stack) >= self.limits.max_depth:
            raise self.fail(event, self._path(), f"at most {self.limits.max_depth} levels of nesting")
        self._count(event, 1)
        self.stack.append(_Frame({} if mapping else [], event.anchor, self._path()))

    def _path(self) -> str:
        """Where the next value goes, e.g. spec.stages[1].mesh (keys cut short)."""
        if not self.stack:
            return "document"
        top = self.stack[-1]
        if isinstance(top.value, list):
            return f"{top.path}[{len(top.value)}]"
        if top.key is None:
            return top.path
        key = short_text(top.key, 40)
        return key if top.path == "document" else f"{top.path}.{key}"

    def _add(self, event: yaml.Event, value: Any, nodes: int, anchor: str | None, scalar: bool = False) -> None:
        if anchor is not None:
            self.anchors[anchor] = (value, nodes)
        if not self.stack:
            self.documents.append(value)
            return
        top = self.stack[-1]
        top.nodes += nodes
        if isinstance(top.value, list):
            top.value.append(value)
        elif top.key is None:
            self._key(event, top, value, scalar)
        else:
            self._value(event, top, value)

    def _key(self, event: yaml.Event, top: _Frame, value: Any, scalar: bool) -> None:
        key = _key_string(value) if scalar else None
        if key is None:
            raise self.fail(event, short(value), "mapping keys that are strings, numbers or booleans")
        top.merge = (
            key == MERGE and isinstance(event, yaml.ScalarEvent) and event.tag is None and bool(event.implicit[0])
        )
        if key in top.value or (top.merge and top.merged):
            raise self.fail(
                event,
                f"{top.path}.{short_text(key, 40)}" if top.path != "document" else key,
                "each key once per mapping (this key is given twice)",
            )
        top.key = key

    def _value(self, event: yaml.Event, top: _Frame, value: Any) -> None:
        if top.merge:
            sources = value if isinstance(value, list) else [value]
            if not sources or not all(isinstance(s, dict) for s in sources):
                raise self.fail(event, self._path(), "a mapping or a list of mappings to merge (<<)")
            top.merged.extend(sources)
        else:
            top.value[top.key] = value
        top.key, top.merge = None, False

    @staticmethod
    def _merge(frame: _Frame) -> dict[str, Any]:
        """<< sources under the explicit keys; an earlier source wins over a later one."""
        out: dict[str, Any] = {}
        for source in reversed(frame.merged):
            out.update(source)
        out.update(frame.value)
        return out


def _events(text: str) -> Iterator[yaml.Event]:
    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: same events
    loader = loader_class(text)
    try:
        while loader.check_event():
            yield loader.get_event()
    finally:
        loader.dispose()


def load_documents(text: str, source: str = "<string>", limits: Limits = LIMITS) -> list[Any]:
    """Every document of a YAML stream as plain values; empty documents are skipped, as kubectl
    skips them. SpecError (naming source:line:column) for syntax errors and anything over limits."""
    if len(text) > limits.max_bytes:
        raise SpecError([FieldError(source, f"{len(text)} characters", f"at most {limits.max_bytes}")])
    composer = _Composer(source, limits)
    try:
        for event in _events(text):
            composer.feed(event)
            if len(composer.documents) > limits.max_documents:
                raise composer.fail(event, source, f"at most {limits.max_documents} documents")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError([FieldError(where, problem, "valid YAML")]) from None
    except UnicodeError as err:
        raise SpecError([FieldError(source, short_text(str(err), 120), "valid UTF-8 text")]) from None
    return [doc for doc in composer.documents if doc is not None]


def load_one(text: str, source: str, what: str, limits: Limits = LIMITS) -> Any:
    """The single document of a YAML stream; SpecError when there is none or more than one."""
    docs = load_documents(text, source, limits)
    if len(docs) != 1:
        raise SpecError([FieldError(source, f"{len(docs)} documents", f"exactly one {what} document")])
    return docs[0]


# ---------------------------------------------------------------------------------------------
# Writing YAML that reads back the same


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper quotes only the strings its own YAML 1.1 rules would misread; `0o17`,
    `1e3` or `y` went out plain and came back as numbers or booleans here (and under kubectl)."""

    def represent_str(self, data: str) -> yaml.ScalarNode:
        plain = resolve_plain(data)
        keeps = isinstance(plain, str) and plain == data
        return self.represent_scalar("tag:yaml.org,2002:str", data, style=None if keeps else '"')


_Dumper.add_representer(str, _Dumper.represent_str)


def dump_yaml(doc: Any, sort_keys: bool = False) -> str:
    """YAML text of plain values that load_documents (and kubectl) read back as the same values."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=sort_keys, allow_unicode=True, default_flow_style=False)


# ---------------------------------------------------------------------------------------------
# Documents that arrive parsed


def check_tree(doc: Any, path: str = "document", limits: Limits = LIMITS) -> None:
    """SpecError when an already-parsed document nests deeper than limits.max_depth or holds more
    than limits.max_nodes values (shared and cyclic references count each time they are reached,
    so a cycle is refused, never followed). Iterative: no recursion, whatever the input; paths are
    only worked out for the error."""
    if not isinstance(doc, (dict, list, tuple)):
        return
    stack: list[tuple[Any, int]] = [(doc, 0)]
    nodes = 1
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        nodes += len(children)
        if nodes > limits.max_nodes:
            raise SpecError([FieldError(path, "a document", f"at most {limits.max_nodes} values")])
        if depth >= limits.max_depth and children:
            raise SpecError(
                [
                    FieldError(
                        _path_to(doc, node, path), "a deeper value", f"at most {limits.max_depth} levels of nesting"
                    )
                ]
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))


def _path_to(doc: Any, target: Any, path: str) -> str:
    """The path of the first container that is `target` (depth-first, as check_tree found it)."""
    stack: list[tuple[Any, str]] = [(doc, path)]
    while stack:
        node, where = stack.pop()
        if node is target:
            return where
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend(
            (child, f"{where}.{short_text(str(key), 40)}" if isinstance(node, dict) else f"{where}[{key}]")
            for key, child in items
            if isinstance(child, (dict, list, tuple))
        )
    return path
