"""meshjob: pipeline training with fast cross-mesh resharding.

The `meshjob` package itself is the pure plan layer (no torch, no kubernetes imports);
`meshjob.trainer` and `meshjob.operator` are executors that interpret its plans.
"""
__version__ = "0.1.0"
