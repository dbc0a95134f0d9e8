"""Pipeline schedules as data: an action IR per stage, generators and a validator.

CONTRACT STUB. Names other modules rely on:
  @dataclass(frozen=True) Action: kind: "F"|"B"|"I"|"W"|"SEND_F"|"RECV_F"|"SEND_B"|"RECV_B";
      mb: int; peer: int | None (the other stage of a SEND/RECV); tensor: str = "activation"
      str(): "F3", "B3", "I3", "W3", "SEND_F3@2", "RECV_B3@1" (peer after @; tensor appended as
      ":skip0" when not "activation");  Action.parse(text) inverse
  generate(kind, num_stages, microbatches, edges: list[tuple[int, int, str]] (src, dst, tensor),
           split_backward=False, weight_delay: dict[int, int] | None = None)
      -> dict[int, list[Action]]
  warmup_forwards(kind, stage, num_stages, microbatches) -> int
  validate(schedules, edges, microbatches, split_backward) -> None   # raises ScheduleError naming
      the offending action and stage
  class ScheduleError(ValueError)
"""
from __future__ import annotations
