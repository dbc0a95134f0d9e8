"""meshjob's action lists as the CSV torch's `_PipelineScheduleRuntime` loads ("compute_comms" format).

One row per pipeline rank (stage s on rank s), one cell per action: "1F3", "1I3", "1W3", "1SEND_F3",
"1RECV_B3" and "1REDUCE_GRAD" after the stage's last backward, as torch's own lowering adds it. Loaded with
`schedule._load_csv(path, format="compute_comms")`, the runtime issues meshjob's order as it stands: its
warm-up, its delayed W's and, with `depth`, its receives posted ahead (meshjob.plan.comm_order: gloo and
NCCL start a transfer only once its receive is posted, so a receive posted at its use exposes the transfer).
Torch's stages carry the chain only: a skip edge (a tensor to a stage that is not the next) is refused.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence

from meshjob.schedule.actions import DEFAULT_TENSOR, Action, ScheduleError
from meshjob.schedule.boundary import BoundaryKey

FORMAT = "torch-csv"
REDUCE_GRAD = "REDUCE_GRAD"
# the stage a transfer action's peer must be in torch's runtime, from the action's own stage
_CHAIN_PEER = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}
# the compute that consumes each receive (torch waits for a posted receive there)
_CONSUMER = {"RECV_F": ("F",), "RECV_B": ("B", "I")}


def _check_chain(stage: int, action: Action) -> None:
    assert action.peer is not None
    if action.peer != stage + _CHAIN_PEER[action.kind] or action.tensor != DEFAULT_TENSOR:
        raise ScheduleError(
            f"stage {stage}: action {action} moves a tensor between stages {stage} and {action.peer}: "
            "torch's pipeline stages carry one activation to the next stage only (no skip edges)"
        )


def _posted_ahead(stage: int, actions: Sequence[Action], depth: Mapping[BoundaryKey, int]) -> list[Action]:
    """The list with each receive of microbatch m moved to right after the compute that consumes m - depth
    (the first `depth` receives before the stage's first action): meshjob's executor posts them so."""
    recvs = {(a.kind, a.mb): a for a in actions if a.kind in _CONSUMER}
    keys = {kind: BoundaryKey.of_action(stage, a) for (kind, _), a in recvs.items()}
    ahead = {kind: depth.get(key, 0) for kind, key in keys.items()}
    out = [a for (kind, mb), a in sorted(recvs.items(), key=lambda i: i[0][1]) if mb < ahead[kind]]
    for action in actions:
        if action.kind in _CONSUMER:
            if ahead[action.kind] == 0:
                out.append(action)
            continue
        out.append(action)
        for kind, consumers in _CONSUMER.items():
            later = recvs.get((kind, action.mb + ahead.get(kind, 0)))
            if action.kind in consumers and later is not None and ahead[kind] > 0:
                out.append(later)
    return out


def torch_row(
    stage: int, actions: Sequence[Action], microbatches: int, depth: Mapping[BoundaryKey, int] | None = None
) -> list[str]:
    """One stage's cells, in torch's spelling; REDUCE_GRAD after its last B or W and the sends that follow it
    (where torch's own lowering puts it: the gradient goes to the previous stage first)."""
    for action in actions:
        if action.is_comm:
            _check_chain(stage, action)
    ordered = _posted_ahead(stage, actions, depth or {})
    done_kind = "W" if any(a.kind == "I" for a in actions) else "B"
    done = [i for i, a in enumerate(ordered) if a.kind == done_kind]
    if len(done) != microbatches:
        raise ScheduleError(f"stage {stage}: {len(done)} {done_kind} actions, expected {microbatches}")
    at = done[-1] + 1
    while at < len(ordered) and ordered[at].kind.startswith("SEND"):
        at += 1
    row = [f"{stage}{a.kind}{a.mb}" for a in ordered]
    return row[:at] + [f"{stage}{REDUCE_GRAD}"] + row[at:]


def torch_rows(
    schedules: Mapping[int, Sequence[Action]], microbatches: int, depth: Mapping[BoundaryKey, int] | None = None
) -> list[list[str]]:
    """Every stage's row, stage 0 first (torch reads row r as pipeline rank r's)."""
    if sorted(schedules) != list(range(len(schedules))):
        raise ScheduleError(f"schedules must cover stages 0..{len(schedules) - 1}, got {sorted(schedules)}")
    return [torch_row(s, schedules[s], microbatches, depth) for s in range(len(schedules))]


def csv_text(rows: Iterable[Sequence[str]]) -> str:
    """The rows as torch's csv.reader reads them back."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return out.getvalue()


def parse_rows(text: str) -> dict[int, list[tuple[int, str, int | None]]]:
    """A torch CSV's cells as (stage, kind, microbatch) per rank: what a test or the simulator reads back."""
    parsed: dict[int, list[tuple[int, str, int | None]]] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        cells: list[tuple[int, str, int | None]] = []
        for cell in row:
            digits = len(cell) - len(cell.lstrip("0123456789"))
            rest = cell[digits:]
            kind = rest.rstrip("0123456789")
            mb = rest[len(kind) :]
            if not digits or not kind:
                raise ScheduleError(f"rank {rank}: cell {cell!r} is not <stage><kind><microbatch>, e.g. 2F0")
            cells.append((int(cell[:digits]), kind, int(mb) if mb else None))
        parsed[rank] = cells
    return parsed
