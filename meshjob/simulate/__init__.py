"""The discrete-event simulator: one step, the steady period, a lower bound on a step.

May import: meshjob.costs, meshjob.spec and the layers below. The layers: docs/architecture.md.
"""
