"""The meshjob Kubernetes operator (kopf): TrainingJob -> topology-placed trainer pods.

Importing this package registers the kopf handlers, so `kopf run -m meshjob.operator` works;
`meshjob operator` is the same with meshjob's own flags (see cli.py).
"""
from meshjob.operator import handlers  # noqa: F401  (registers the handlers with kopf)
