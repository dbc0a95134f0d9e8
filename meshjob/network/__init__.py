"""The one network model: host links, per-message costs, host-level tasks, list scheduling.

May import: meshjob.errors, meshjob.units. The layers: docs/architecture.md.
"""
