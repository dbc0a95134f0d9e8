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

# A job's children are named <job> (the headless Service: a DNS-1035 label) and <job>-host-<index> (pods,
# whose hostname is their name: a DNS label of at most 63 characters); a name fits up to 10,000 hosts.
HOST_POD_INFIX = "-host-"
MAX_HOST_INDEX_DIGITS = 4
JOB_NAME_MAX_LENGTH = 63 - len(HOST_POD_INFIX) - MAX_HOST_INDEX_DIGITS
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def pod_name(job: str, index: int) -> str:
    """The job's host pod of node rank `index`."""
    return f"{job}{HOST_POD_INFIX}{index}"


# labels and annotations on a job's children
JOB_LABEL = f"{GROUP}/job-name"
HOST_INDEX_LABEL = f"{GROUP}/host-index"

# trainer metrics the operator reads for a job's progress (from global rank 0's metrics endpoint)
STEP_METRIC = "meshjob_step"  # gauge: last completed training step
CHECKPOINT_STEP_METRIC = "meshjob_last_checkpoint_step"  # gauge: step of the newest checkpoint
STEP_SECONDS_METRIC = "meshjob_step_seconds"  # histogram: wall time of a step

# trainer exit codes that no restart can cure (`meshjob worker` exits 2 on an invalid job or command line);
# any other failure (1: a rank failed, 128+N: killed by signal N) may pass and is retried as a gang restart
PERMANENT_EXIT_CODES = frozenset({2})

# ports
MASTER_PORT = 29500  # torch.distributed rendezvous (torchrun's default)
TRAINER_METRICS_PORT = 9400  # spec.metrics.port's default; local rank r serves on it + r
OPERATOR_METRICS_PORT = 9401
