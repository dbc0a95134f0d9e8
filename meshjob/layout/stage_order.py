"""The order a job's stages are laid on hosts: placement fills hosts in this order, each stage preferring the
hosts of the stage placed just before it. A kind is one object in STAGE_ORDERS (the manifest's
spec.topology.stageOrder, and a dimension of `meshjob tune`'s space)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshjob.errors import FieldError, SpecError


@dataclass(frozen=True)
class StageOrder:
    name: str
    order: Callable[[int], tuple[int, ...]]  # stages -> stage indices in placement order
    why: str


def _chain(stages: int) -> tuple[int, ...]:
    return tuple(range(stages))


def _fold(stages: int) -> tuple[int, ...]:
    """0, S-1, 1, S-2, ...: stage k beside stage S-1-k, so a U-Transformer's skip edges (layer i to L-1-i) and
    tied embeddings (first and last stage) stay on a host while the chain crosses hosts."""
    out: list[int] = []
    for k in range((stages + 1) // 2):
        out.append(k)
        if stages - 1 - k != k:
            out.append(stages - 1 - k)
    return tuple(out)


STAGE_ORDERS: dict[str, StageOrder] = {
    o.name: o
    for o in (
        StageOrder("chain", _chain, "stage by stage: neighbours in the chain share hosts"),
        StageOrder("fold", _fold, "stage k beside stage S-1-k: skip edges and tied embeddings share hosts"),
    )
}
DEFAULT_STAGE_ORDER = "chain"


def stage_order(name: str) -> StageOrder:
    found = STAGE_ORDERS.get(name)
    if found is None:
        raise SpecError([FieldError("spec.topology.stageOrder", name, f"one of {', '.join(STAGE_ORDERS)}")])
    return found
