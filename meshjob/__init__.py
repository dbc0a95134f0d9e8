"""meshjob: pipeline training with fast cross-mesh resharding.

The `meshjob` package is the pure plan layer and the command line (no torch, no kubernetes imports);
the `meshjob_trainer` and `meshjob_operator` distributions are executors that interpret its plans.
"""

__version__ = "0.1.0"
