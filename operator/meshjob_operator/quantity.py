"""Kubernetes resource quantities: just enough to read allocatable devices and scale requests."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


def _split(value: str | int | float, path: str) -> tuple[Decimal, str]:
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _SUFFIXES or "e" in match.group(1).lower() and match.group(2):
        raise ValueError(f"{path}: {value!r} is invalid: a Kubernetes quantity such as 2, 500m, 4Gi")
    try:
        return Decimal(match.group(1)), match.group(2)
    except InvalidOperation:
        raise ValueError(f"{path}: {value!r} is invalid: a Kubernetes quantity such as 2, 500m, 4Gi") from None


def parse_quantity(value: str | int | float, path: str = "quantity") -> Decimal:
    number, suffix = _split(value, path)
    return number * _SUFFIXES[suffix]


def scale_quantity(value: str | int | float, factor: int, path: str = "quantity") -> str:
    """`value` times `factor`, keeping the unit suffix (so 2Gi x 3 = 6Gi, 500m x 2 = 1000m)."""
    number, suffix = _split(value, path)
    scaled = number * factor
    text = format(scaled.normalize(), "f") if scaled != scaled.to_integral() else str(int(scaled))
    return f"{text}{suffix}"
