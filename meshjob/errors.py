"""Validation errors that name the field, the value and what is allowed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldError:
    path: str  # e.g. "spec.stages[1].mesh"
    value: Any
    allowed: str  # what would have been accepted, in words

    def __str__(self) -> str:
        return f"{self.path}: {self.value!r} is invalid: {self.allowed}"


class SpecError(ValueError):
    """One or more invalid fields; all of them are reported at once."""

    def __init__(self, errors: list[FieldError]):
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


class PlacementError(ValueError):
    """The cluster cannot hold the job; the message says what is missing."""


class UsageError(ValueError):
    """A bad command-line value; the CLI prints it and exits 2."""
