"""A trainer process's place in the job, its settings, the process group, its context.

Configuration is read from the environment once, at the process entry (`meshjob worker`), and
passed on as values from there:
- WorkerEnv: torchrun's variables (and Kubeflow's PET_* spellings): rank, world size, rendezvous.
  A launcher makes one per forked rank.
- NodeEnv: what a host's launcher knows before any rank exists (node rank, world size, rendezvous).
- WorkerSettings: meshjob's own MESHJOB_* variables, which the operator sets on its pods (job and
  hosts files, the rendered plan, checkpoints, metrics port, pod identity).
init_distributed() runs a rendezvous of its own on a TCPStore before creating the process
group, so a rank that never comes is named in the error instead of a bare timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshjob.costs.devices import ComputeMode
from meshjob.plan.build import Plan
from meshjob.spec.api import MASTER_PORT
from meshjob.spec.manifest import TrainingJob
from meshjob_trainer.checkpoint import Checkpointer
from meshjob_trainer.errors import TrainerError
from meshjob_trainer.events import Fanout, MetricsSink

if TYPE_CHECKING:  # torch, and reshard which imports it: this module loads with the CLI, before torch
    import torch
    import torch.distributed as dist

    from meshjob_trainer.reshard import ReshardExecutor

DEFAULT_TIMEOUT_S = 300.0
RENDEZVOUS_PREFIX = "meshjob/rendezvous"


class DistError(TrainerError):
    """The process group could not be formed; the message says which rank or setting is at fault."""


def _env_int(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            raise DistError(f"environment {name}={raw!r} is invalid: must be an integer >= 0") from None
        if value < 0:
            raise DistError(f"environment {name}={raw!r} is invalid: must be an integer >= 0")
        return value
    if default is None:
        raise DistError(f"environment {' or '.join(names)} is not set: needed to place this process in the job")
    return default


def _env_optional_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    return _env_int(env, names, -1) if any(env.get(n) for n in names) else None


def _env_str(env: Mapping[str, str], names: tuple[str, ...], default: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    return default


RANK = ("RANK", "PET_RANK")
WORLD_SIZE = ("WORLD_SIZE", "PET_WORLD_SIZE")
LOCAL_RANK = ("LOCAL_RANK", "PET_LOCAL_RANK")
LOCAL_WORLD_SIZE = ("LOCAL_WORLD_SIZE", "PET_LOCAL_WORLD_SIZE")
NODE_RANK = ("NODE_RANK", "PET_NODE_RANK", "GROUP_RANK")
MASTER_ADDR = ("MASTER_ADDR", "PET_MASTER_ADDR")
MASTER_PORTS = ("MASTER_PORT", "PET_MASTER_PORT")


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int = 0
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = MASTER_PORT
    local_world_size: int = 1  # ranks on this host (torchrun's LOCAL_WORLD_SIZE)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise DistError(f"WORLD_SIZE={self.world_size} is invalid: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise DistError(f"RANK={self.rank} is invalid: must be in [0, WORLD_SIZE={self.world_size})")
        if not 0 < self.master_port < 65536:
            raise DistError(f"MASTER_PORT={self.master_port} is invalid: must be in [1, 65535]")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv:
        """torchrun names first, then Kubeflow's PET_* ones."""
        return cls(
            rank=_env_int(env, RANK, None),
            world_size=_env_int(env, WORLD_SIZE, None),
            local_rank=_env_int(env, LOCAL_RANK, 0),
            node_rank=_env_int(env, NODE_RANK, 0),
            master_addr=_env_str(env, MASTER_ADDR, "127.0.0.1"),
            master_port=_env_int(env, MASTER_PORTS, MASTER_PORT),
            local_world_size=_env_int(env, LOCAL_WORLD_SIZE, 1),
        )


@dataclass(frozen=True)
class NodeEnv:
    """One host's place in the job before its ranks exist (what `meshjob worker --nproc` reads)."""

    node_rank: int = 0
    world_size: int | None = None  # None: unset, the plan decides
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: unset, the launcher chooses

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NodeEnv:
        return cls(
            node_rank=_env_int(env, NODE_RANK, 0),
            world_size=_env_optional_int(env, WORLD_SIZE),
            master_addr=_env_str(env, MASTER_ADDR, "127.0.0.1"),
            master_port=_env_optional_int(env, MASTER_PORTS),
        )

    @staticmethod
    def has_rank(env: Mapping[str, str]) -> bool:
        """Whether RANK is set: then a launcher (torchrun, Kubeflow) started this one process per rank."""
        return any(env.get(name) for name in RANK)


@dataclass(frozen=True)
class WorkerSettings:
    """meshjob's own settings of a trainer process (the operator sets them on its pods)."""

    job_path: str = ""  # MESHJOB_JOB: the TrainingJob YAML
    hosts_path: str = ""  # MESHJOB_HOSTS: hosts.yaml (else the plan's default hosts)
    plan_path: str = ""  # MESHJOB_PLAN: the operator's rendered plan (inputs and digest) to verify against
    checkpoint_dir: str = ""  # MESHJOB_CHECKPOINT_DIR: overrides spec.training.checkpoint.path
    metrics_port: int | None = None  # MESHJOB_METRICS_PORT: local rank r serves /metrics on it + r
    step_log: bool = False  # a line per step from the first rank of each stage (`meshjob worker`: the pod's log)
    compute: ComputeMode | None = None  # `meshjob run --compute`; None: real
    termination_log: str = ""  # MESHJOB_TERMINATION_LOG: the container's terminationMessagePath (a summary at the end)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        port = _env_optional_int(env, ("MESHJOB_METRICS_PORT",))
        if port is not None and not 0 < port < 65536:
            raise DistError(f"environment MESHJOB_METRICS_PORT={port} is invalid: must be a port in [1, 65535]")
        return cls(
            job_path=env.get("MESHJOB_JOB", ""),
            hosts_path=env.get("MESHJOB_HOSTS", ""),
            plan_path=env.get("MESHJOB_PLAN", ""),
            checkpoint_dir=env.get("MESHJOB_CHECKPOINT_DIR", ""),
            metrics_port=port,
            step_log=True,
            termination_log=env.get("MESHJOB_TERMINATION_LOG", ""),
        )


def check_world_size(env: WorkerEnv, plan_world_size: int, job_name: str = "") -> None:
    """The launcher's WORLD_SIZE must be the plan's: every rank's role comes from the plan."""
    if env.world_size != plan_world_size:
        of = f" of job {job_name!r}" if job_name else ""
        raise DistError(
            f"WORLD_SIZE={env.world_size} but the plan{of} needs {plan_world_size} ranks "
            f"(one per device of every stage mesh); start exactly {plan_world_size} processes"
        )


def _rendezvous(env: WorkerEnv, timeout_s: float) -> dist.TCPStore:
    """Every rank sets its key on rank 0's TCPStore, then waits for all keys (polling gently).

    Rank 0 decides a timeout: it lists the missing ranks, publishes that verdict on the store and
    gives the waiting ranks a moment to read it, so every rank that came reports the same
    missing ranks (instead of a bare "connection closed" when rank 0 exits)."""
    import torch.distributed as dist  # torch only once a rank runs: this module loads with the CLI

    deadline = time.monotonic() + timeout_s
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as err:  # noqa: BLE001 - torch raises several types for "cannot connect"
        who = "this rank (0) could not host it" if env.rank == 0 else "rank 0 never came or is unreachable"
        raise DistError(
            f"rank {env.rank}: rendezvous store at {where} not reachable within {timeout_s:g} s: "
            f"{who} ({type(err).__name__}: {err})"
        ) from err
    keys = [f"{RENDEZVOUS_PREFIX}/{r}" for r in range(env.world_size)]
    verdict, acks = f"{RENDEZVOUS_PREFIX}/failed", f"{RENDEZVOUS_PREFIX}/acks"
    try:
        store.set(keys[env.rank], "1")
        while not store.check(keys):
            if env.rank == 0 and time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                message = (
                    f"rendezvous at {where} timed out after {timeout_s:g} s: rank(s) "
                    f"{', '.join(map(str, missing))} of WORLD_SIZE={env.world_size} never joined"
                )
                store.set(verdict, message)
                came = env.world_size - len(missing)
                grace = time.monotonic() + 2.0
                while int(store.add(acks, 0)) < came - 1 and time.monotonic() < grace:
                    time.sleep(0.02)
                raise DistError(f"rank 0: {message}")
            if env.rank != 0 and store.check([verdict]):
                message = store.get(verdict).decode()
                store.add(acks, 1)
                raise DistError(f"rank {env.rank}: {message}")
            if env.rank != 0 and time.monotonic() > deadline + 5.0:  # rank 0 is there but gave no verdict
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise DistError(
                    f"rank {env.rank}: rendezvous at {where} timed out after {timeout_s:g} s: rank(s) "
                    f"{', '.join(map(str, missing))} of WORLD_SIZE={env.world_size} never joined"
                )
            time.sleep(0.05)
    except DistError:
        raise
    except Exception as err:  # noqa: BLE001 - the store's connection broke: rank 0 went away
        raise DistError(
            f"rank {env.rank}: the rendezvous store at {where} (hosted by rank 0) went away while "
            f"waiting for peers ({type(err).__name__}: {err})"
        ) from err
    return store


GLOO = "gloo"
MAX_CUDA_CONNECTIONS = 32  # CUDA_DEVICE_MAX_CONNECTIONS' largest value (its default is 8)
# torch's combined backend: CPU tensors go through gloo, CUDA tensors through NCCL, in one group.
GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"


def backend_for_device(cuda_available: bool | None = None) -> str:
    """gloo on CPU; with CUDA torch's combined "cpu:gloo,cuda:nccl".

    With CUDA every tensor that trains goes device to device over NCCL: the stage-internal
    collectives (TP all-reduce, DP gradient reduce) on the default group, issued in program order by
    the training thread, and the communication engine's messages on communicators of their own
    (meshjob_trainer.wire.NcclWire: one per directed pair of ranks, issued in the plan's order). The
    CPU objects ranks still exchange (the plan's digest, calibration figures) go over gloo in the
    same group, which plain NCCL could not carry."""
    if cuda_available is None:
        import torch  # torch only once a rank runs: this module loads with the CLI

        cuda_available = torch.cuda.is_available()
    return GLOO_AND_NCCL if cuda_available else GLOO


def uses_cuda(backend: str) -> bool:
    """Whether a backend string (plain or combined, e.g. "cpu:gloo,cuda:nccl") puts CUDA tensors on NCCL."""
    return "nccl" in backend.lower()


def device_for_backend(backend: str) -> str:
    """The torch device a rank trains on: the GPU init_distributed selected when the backend carries
    CUDA tensors, else the CPU."""
    if not uses_cuda(backend):
        return "cpu"
    import torch  # torch only once a rank runs: this module loads with the CLI

    return f"cuda:{torch.cuda.current_device()}"


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """What makes a timed region's end its device's (a torch.device): CUDA's synchronize (its kernels run
    after their launch returns), None on the CPU."""
    if device.type != "cuda":
        return None
    import torch  # torch only once a rank runs: this module loads with the CLI

    return lambda: torch.cuda.synchronize(device)


def nccl_host_id(env: WorkerEnv, gpus: int, host: str) -> str | None:
    """The NCCL host id of a rank that shares its GPU with another rank of its machine, else None. `host`:
    the host's own id (NCCL_HOSTID where set, e.g. an emulated host's, else the machine's name).

    NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU detected"). Where
    a machine runs more ranks than it has GPUs (an emulated cluster on one GPU, as `meshjob run` and the
    tests make), each rank becomes an NCCL host of its own, so its messages take NCCL's network
    transport, as between ranks on separate hosts. A machine with a GPU per rank keeps the host's id,
    and with it NVLink and shared memory between the GPUs of a host."""
    if env.local_world_size <= gpus:
        return None
    return f"{host}-rank{env.rank}"


def describe_transport(env: WorkerEnv, backend: str, gpus: int) -> str:
    """One line for the log of the machine (a pod, or `meshjob run`'s one machine): what carries its ranks' tensors."""
    if not uses_cuda(backend):
        return f"meshjob: {env.local_world_size} rank(s) here, CPU tensors over gloo"
    line = f"meshjob: {env.local_world_size} rank(s) here on {gpus} GPU(s), CUDA tensors over NCCL"
    if nccl_host_id(env, gpus, "") is not None:
        line += "; ranks share GPUs, so each is an NCCL host of its own (NCCL's network transport between them)"
    return line


def init_distributed(
    env: WorkerEnv,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    expected_world_size: int | None = None,
) -> str:
    """Join the default process group (gloo on CPU, gloo+NCCL when CUDA is present); returns the backend."""
    import torch  # torch only once a rank runs: this module loads with the CLI
    import torch.distributed as dist

    if expected_world_size is not None:
        check_world_size(env, expected_world_size)
    backend = backend or backend_for_device()
    store = _rendezvous(env, timeout_s)
    if uses_cuda(backend):
        gpus = torch.cuda.device_count()
        host_id = nccl_host_id(env, gpus, os.environ.get("NCCL_HOSTID") or socket.gethostname())
        if host_id is not None:
            os.environ["NCCL_HOSTID"] = host_id  # read once, at this process's first communicator
        # Every directed pair's communicator has a CUDA stream of its own, and receives are posted early. With
        # CUDA's default 8 hardware queues, streams beyond 8 share one and queue behind each other's work: a
        # send could wait there behind a receive that waits for a peer, an order across ranks that the plan's
        # issue order does not rule out. 32 queues (CUDA's most) keep up to 32 streams apart. A guard, not
        # seen on a GPU yet; read when this process's CUDA context is made, just below.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(MAX_CUDA_CONNECTIONS))
        torch.cuda.set_device(env.local_rank % gpus)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("meshjob/pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def shutdown_distributed() -> None:
    import torch.distributed as dist  # torch only once a rank runs: this module loads with the CLI

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class WorkerContext:
    """What the training loop (meshjob_trainer.train.train) gets from the worker."""

    env: WorkerEnv
    job: TrainingJob
    plan: Plan
    stage: int  # this rank's pipeline stage
    reshard: ReshardExecutor  # this rank's
    events: MetricsSink = field(default_factory=Fanout)  # every listener of this rank
    checkpoints: Checkpointer | None = None  # None when checkpoints are off
    device: str = "cpu"
    compute: ComputeMode | None = None  # None: real

    @property
    def rank(self) -> int:
        return self.env.rank
