"""Recent: the latest values a pure function made, by their inputs (a small least-recently-used cache).

A search builds many plans that share parts (their boundaries, their delay choice, their transfer order): one
built from the same inputs is the same, so it is made once while it stays recent.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    def __init__(self, kept: int) -> None:
        self.kept = kept
        self.values: collections.OrderedDict[Hashable, V] = collections.OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value made for `key`, made now where it is not kept; the `kept` latest used stay."""
        if key in self.values:
            self.values.move_to_end(key)
            return self.values[key]
        self.values[key] = value = make()
        if len(self.values) > self.kept:
            self.values.popitem(last=False)
        return value
