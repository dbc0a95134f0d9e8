"""Per-job wake-up flags: pod, node and job events wake the job's reconcile loop at once."""

from __future__ import annotations

import asyncio
from typing import Any

Key = tuple[str, str]  # (namespace, name)


class Wakeups:
    def __init__(self) -> None:
        self._events: dict[Key, asyncio.Event] = {}
        self.waiting_for_nodes: set[Key] = set()

    def register(self, key: Key) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def unregister(self, key: Key) -> None:
        self._events.pop(key, None)
        self.waiting_for_nodes.discard(key)

    def wake(self, key: Key) -> None:
        event = self._events.get(key)
        if event is not None:
            event.set()

    def wake_waiting_for_nodes(self) -> None:
        for key in list(self.waiting_for_nodes):
            self.wake(key)


async def wait_any(event: asyncio.Event, stopped: Any, timeout: float | None) -> None:
    """Until the event is set, the daemon is stopped, or the timeout passes."""
    tasks = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
