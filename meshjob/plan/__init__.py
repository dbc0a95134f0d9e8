"""The Plan: placement, each boundary's resharding program, per-stage schedules, their transfer order.

May import: meshjob.simulate and the layers below. The layers: docs/architecture.md.
"""
