"""Pipeline schedules as data: the action IR, the schedule-kind registry, validator, boundary names.

May import: meshjob.network, meshjob.layout, meshjob.errors. The layers: docs/architecture.md.
"""
