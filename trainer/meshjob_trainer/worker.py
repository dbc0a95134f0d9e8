"""One trainer rank from start to finish, and one host's worth of ranks.

run_worker(env): read the job, build the Plan (the same on every rank: it is a deterministic
function of the spec and hosts, and the ranks check that they agree), join the process group,
assemble the WorkerContext and hand it to the training loop (meshjob_trainer.train.train).
run_host(...): fork the ranks the plan puts on one host, like torchrun --nproc-per-node.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from meshjob.api import MASTER_PORT
from meshjob_trainer.dist import (DEFAULT_TIMEOUT_S, DistError, WorkerContext, WorkerEnv, check_world_size,
                                  device_for_backend, init_distributed, shutdown_distributed)


@dataclass(frozen=True)
class JobSetup:
    job: Any  # meshjob.spec.TrainingJob
    plan: Any  # meshjob.plan.Plan


def nic_bytes_per_s(env: Mapping[str, str]) -> float:
    """MESHJOB_NIC_BYTES_PER_S lets a launcher build the very plan it showed (default: the plan's)."""
    raw = env.get("MESHJOB_NIC_BYTES_PER_S", "")
    if not raw:
        return 1e9 / 8
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistError(f"environment MESHJOB_NIC_BYTES_PER_S={raw!r} is invalid: must be a number > 0")
    return value


def load_setup(job_path: str, hosts_path: str = "", env: Mapping[str, str] | None = None) -> JobSetup:
    """Parse the job (SpecError names bad fields) and build its plan."""
    from meshjob.placement import load_hosts
    from meshjob.plan import build_plan
    from meshjob.spec import load_job

    env = os.environ if env is None else env
    if not job_path:
        raise DistError("no job: pass --job job.yaml or set MESHJOB_JOB")
    job = load_job(job_path)
    hosts = load_hosts(hosts_path) if hosts_path else None
    return JobSetup(job, build_plan(job, hosts, nic_bytes_per_s=nic_bytes_per_s(env)))


def plan_digest(plan: Any) -> str:
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True, default=str).encode()).hexdigest()


def check_rendered_plan(plan: Any, path: str) -> None:
    """The operator renders pods from its plan (MESHJOB_PLAN): our ranks must sit where it put them."""
    if not path or not os.path.exists(path):
        return
    rendered = json.loads(Path(path).read_text())
    ours = plan.to_json()
    for key in ("world_size", "placement"):
        if key in rendered and rendered[key] != ours[key]:
            raise DistError(f"the plan built here differs from the operator's ({path}) in {key!r}: "
                            f"{ours[key]!r} here, {rendered[key]!r} there; were the job or hosts changed?")


def agree_on_plan(plan: Any, rank: int) -> None:
    """Every rank must run the same plan (a time-budgeted balancer could differ between ranks)."""
    import torch.distributed as dist

    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, plan_digest(plan))
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise DistError(f"rank {rank}: ranks {differing} built a different plan than rank 0 from the same spec; "
                        f"use a deterministic balancer (spec.resharding.balancer: greedy or load_balance)")


def stage_of(plan: Any, rank: int) -> int:
    return plan.placement.slots[rank].stage


def make_context(env: WorkerEnv, setup: JobSetup, device: str = "cpu") -> WorkerContext:
    from meshjob_trainer.checkpoint import Checkpointer, spec_fingerprint
    from meshjob_trainer.metrics import TrainerMetrics
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.status import PodStatus, ReportingMetrics

    job, plan = setup.job, setup.plan
    stage = stage_of(plan, env.rank)
    host = plan.placement.hosts[plan.placement.host_of(env.rank)].name
    metrics = TrainerMetrics(job=job.name, rank=env.rank, host=host, stage=stage)
    metrics.set_info(job.resharding.strategy, job.schedule.kind, job.resharding.balancer,
                     ",".join("x".join(map(str, s.mesh)) for s in job.stages))
    port = env.extra.get("MESHJOB_METRICS_PORT", "")
    if port:  # ranks sharing a pod (or a machine) take consecutive ports
        if not port.isdigit() or not 0 < int(port) + env.local_rank < 65536:
            raise DistError(f"environment MESHJOB_METRICS_PORT={port!r} is invalid: must be a port in [1, 65535] "
                            f"(rank with LOCAL_RANK={env.local_rank} serves on it + {env.local_rank})")
        try:
            metrics.serve(int(port) + env.local_rank)
        except OSError as err:
            raise DistError(f"rank {env.rank}: cannot serve metrics on port {int(port) + env.local_rank} "
                            f"(MESHJOB_METRICS_PORT={port} + LOCAL_RANK={env.local_rank}): {err}") from err
    status = PodStatus.from_env() if env.local_rank == 0 else PodStatus()  # one reporter per pod
    reported = ReportingMetrics(metrics, status) if status.enabled else metrics
    directory = env.checkpoint_dir or job.training.checkpoint.path
    checkpoints = (Checkpointer(Path(directory), env.rank, env.world_size,
                                spec_fingerprint(job, env.world_size), status=status) if directory else None)
    reshard = ReshardExecutor(plan, env.rank, metrics, device=device)
    return WorkerContext(env=env, job=job, plan=plan, stage=stage, reshard=reshard, metrics=reported,
                         checkpoints=checkpoints, status=status, device=device)


def run_worker(env: WorkerEnv, timeout_s: float = DEFAULT_TIMEOUT_S, setup: JobSetup | None = None) -> Any:
    """One rank: returns what the training loop returns (meshjob_trainer.train.TrainResult)."""
    setup = setup or load_setup(env.job_path, env.hosts_path, {**env.extra, **os.environ})
    check_world_size(env, setup.plan.placement.world_size, setup.job.name)
    check_rendered_plan(setup.plan, env.extra.get("MESHJOB_PLAN", ""))
    backend = init_distributed(env, timeout_s)
    ctx = None
    try:
        agree_on_plan(setup.plan, env.rank)
        ctx = make_context(env, setup, device_for_backend(backend))
        from meshjob_trainer.train import train

        result = train(ctx)
        ctx.status.flush()
        return result
    finally:
        if ctx is not None:
            ctx.metrics.close()
        shutdown_distributed()


def host_ranks(plan: Any, node_rank: int) -> tuple[int, ...]:
    """Global ranks on the node_rank-th host the job uses (the operator's pod index)."""
    used = plan.placement.hosts_used()
    if not 0 <= node_rank < len(used):
        raise DistError(f"--node-rank {node_rank} is invalid: the job uses {len(used)} host(s), "
                        f"node ranks 0..{len(used) - 1}")
    return tuple(plan.placement.ranks_on(used[node_rank]))


def run_host(setup: JobSetup, node_rank: int, nproc: int | None, env: Mapping[str, str],
             timeout_s: float = DEFAULT_TIMEOUT_S, pre_exec: Any = None) -> Any:
    """Fork this host's ranks (meshjob_trainer.launch) and wait; returns the LaunchResult."""
    from meshjob_trainer.launch import free_port, launch_local

    ranks = host_ranks(setup.plan, node_rank)
    if nproc is not None and nproc != len(ranks):
        raise DistError(f"--nproc {nproc} is invalid: the plan puts {len(ranks)} rank(s) {list(ranks)} on "
                        f"node rank {node_rank}")
    world_size = setup.plan.placement.world_size
    if env.get("WORLD_SIZE") and int(env["WORLD_SIZE"]) != world_size:
        check_world_size(WorkerEnv(rank=0, world_size=int(env["WORLD_SIZE"])), world_size, setup.job.name)
    single_host = len(setup.plan.placement.hosts_used()) == 1
    addr = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or "127.0.0.1"
    port_text = env.get("MASTER_PORT") or env.get("PET_MASTER_PORT") or ""
    port = int(port_text) if port_text else (free_port(addr) if single_host else MASTER_PORT)
    child_env = {k: v for k, v in env.items() if k.startswith("MESHJOB_")}

    def target(worker_env: WorkerEnv) -> None:
        run_worker(worker_env, timeout_s, setup)  # the result stays in the child: the CLI needs the exit code

    return launch_local(world_size, target, ranks=ranks, env=child_env, master_addr=addr, master_port=port,
                        node_rank=node_rank, pre_exec=pre_exec)
