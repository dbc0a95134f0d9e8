"""The names the operator, the trainer and the manifests share: the Kubernetes-facing contract.

Defined once here (the plan layer is the one package both executors import) so that a renamed label,
annotation or port cannot drift between the pods the operator renders and the trainers that run in them.
"""
from __future__ import annotations

GROUP = "meshjob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj",)

# labels and annotations on a job's children
JOB_LABEL = f"{GROUP}/job-name"
HOST_INDEX_LABEL = f"{GROUP}/host-index"
STEP_ANNOTATION = f"{GROUP}/step"  # a trainer's last finished step, on its own pod
CHECKPOINT_ANNOTATION = f"{GROUP}/checkpoint-step"  # the step of its newest checkpoint

# trainer metrics the operator reads for a job's progress (from global rank 0's metrics endpoint)
STEP_METRIC = "meshjob_step"  # gauge: last completed training step
CHECKPOINT_STEP_METRIC = "meshjob_last_checkpoint_step"  # gauge: step of the newest checkpoint
STEP_SECONDS_METRIC = "meshjob_step_seconds"  # histogram: wall time of a step

# ports
MASTER_PORT = 29500  # torch.distributed rendezvous (torchrun's default)
TRAINER_METRICS_PORT = 9400  # spec.metrics.port's default; local rank r serves on it + r
OPERATOR_METRICS_PORT = 9401
