"""The trainer's errors that a person acts on: each says in one line what is wrong and where, so a rank
reports it as that line (launch.py), not as a traceback."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """An error whose message is the whole report (a setting, a peer, a disk): no traceback needed."""
