"""A job's progress, read from its trainers' metrics endpoint (global rank 0: local rank 0 of host pod 0).

Trainer pods have no API credentials (automountServiceAccountToken: false), so they cannot report
anything through the API server; the operator reads the same Prometheus exposition Prometheus scrapes.
Reading it is best effort: an endpoint that does not answer leaves the last progress in place.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from meshjob.spec.api import CHECKPOINT_STEP_METRIC, STEP_METRIC, STEP_SECONDS_METRIC
from meshjob_operator.status import timestamp

SCRAPE_TIMEOUT_S = 2.0
INTERVAL_S = 10.0  # between two readings of one job


@dataclass(frozen=True)
class Reading:
    step: int | None = None  # last completed step
    checkpoint_step: int | None = None  # step of the newest checkpoint
    mean_step_s: float | None = None  # mean wall time of a step since the trainer started


def _samples(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(float(sample.value))
    return out


def parse(text: str) -> Reading:
    """The exposition of one trainer process as a Reading; metrics it lacks stay None."""
    samples = _samples(text)

    def top(name: str) -> int | None:
        values = samples.get(name)
        return int(max(values)) if values else None

    count, total = (
        sum(samples.get(f"{STEP_SECONDS_METRIC}_count", [])),
        sum(samples.get(f"{STEP_SECONDS_METRIC}_sum", [])),
    )
    return Reading(
        step=top(STEP_METRIC), checkpoint_step=top(CHECKPOINT_STEP_METRIC), mean_step_s=total / count if count else None
    )


def status(reading: Reading, total_steps: int, now: datetime.datetime) -> dict[str, Any] | None:
    """status.progress: step, total, percent done and the estimated end (from the mean step time)."""
    if reading.step is None:
        return None
    step = min(reading.step, total_steps)
    out: dict[str, Any] = {"step": step, "total": total_steps, "percent": int(100 * step / total_steps)}
    if reading.mean_step_s is not None and step < total_steps:
        left = (total_steps - step) * reading.mean_step_s
        out["eta"] = timestamp(now + datetime.timedelta(seconds=left))
    return out


class Scraper:
    """One HTTP session for the trainers' metrics endpoints (no credentials: they are plain HTTP)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def read(self, ip: str, port: int) -> Reading | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        host = f"[{ip}]" if ":" in ip else ip
        try:
            async with self._session.get(f"http://{host}:{port}/metrics") as resp:
                if resp.status != 200:
                    return None
                return parse(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
