"""Validation errors that name the field, the value and what is allowed."""

from __future__ import annotations

import itertools
import reprlib
from dataclasses import dataclass
from typing import Any

MAX_SHOWN_ERRORS = 50  # a message lists this many problems, then says how many more there are


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, with mappings in their own order (reprlib sorts keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 2, 6, 6, 6
        self.maxstring, self.maxother = 80, 80

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x or level <= 0:
            return "{...}" if x else "{}"
        pieces = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in itertools.islice(x.items(), self.maxdict)
        ]
        return "{" + ", ".join(pieces + (["..."] if len(x) > self.maxdict else [])) + "}"


_SHORT = _ShortRepr()


def short(value: Any) -> str:
    """A repr of at most a few lines: a huge or deeply nested value (an alias bomb, a 1 MB string)
    never reaches a message whole. Big integers are described, not printed (their decimal text can
    be long, and Python refuses to print more than 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    return _SHORT.repr(value)


def short_text(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters (paths built from user keys can be long)."""
    return text if len(text) <= limit else text[:limit] + f"...({len(text) - limit} more)"


@dataclass(frozen=True)
class FieldError:
    path: str  # e.g. "spec.stages[1].mesh"
    value: Any
    allowed: str  # what would have been accepted, in words

    def __str__(self) -> str:
        return f"{short_text(self.path)}: {short(self.value)} is invalid: {short_text(self.allowed, 2000)}"


class SpecError(ValueError):
    """One or more invalid fields; all of them are reported at once."""

    def __init__(self, errors: list[FieldError]):
        self.errors = list(errors)
        lines = [str(e) for e in self.errors[:MAX_SHOWN_ERRORS]]
        if len(self.errors) > MAX_SHOWN_ERRORS:
            lines.append(f"... and {len(self.errors) - MAX_SHOWN_ERRORS} more problems")
        super().__init__("\n".join(lines))


class PlacementError(ValueError):
    """The cluster cannot hold the job; the message says what is missing."""


class UsageError(ValueError):
    """A bad command-line value; the CLI prints it and exits 2."""
