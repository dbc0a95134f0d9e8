"""Cross-mesh resharding: unit tasks, the strategy registry (lowering and cost), balancers, windows.

May import: meshjob.network, meshjob.layout, meshjob.errors. The layers: docs/architecture.md.
"""
