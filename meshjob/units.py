"""Parsing of human units used on the command line: link rates ("1gbit", "500mbit") and sizes ("64MiB")."""

from __future__ import annotations

import re

# tc's rate units, in bits per second ("bps" is tc's bytes per second)
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_SIZE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_rate(text: str, path: str = "rate") -> float:
    """A tc-style rate ("1gbit", "500mbit", "125mbps") in bytes per second; the ValueError names `path`,
    the value and the units allowed."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"{path}: {text!r} is invalid: a positive tc rate such as '1gbit', '500mbit' or "
            f"'125mbps' (units: {', '.join(_RATE_UNITS)})"
        )
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()] / 8


def format_rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def parse_size(text: str) -> int:
    """A byte size ("64MiB", "1mb", "4096") in bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = (m.group(2) or "b").lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is invalid: use a number with one of {', '.join(_SIZE_UNITS)} (e.g. 64MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])
