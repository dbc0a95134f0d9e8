"""The meshjob Kubernetes operator (kopf): TrainingJob -> topology-placed trainer pods.

`meshjob operator` runs it with meshjob's own flags (cli.py); `kopf run -m meshjob_operator.handlers`
registers the same handlers with plain kopf.
"""
