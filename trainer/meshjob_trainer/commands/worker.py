"""`meshjob worker`: one trainer process (RANK set, as under torchrun or Kubeflow), or one host's
worth of ranks (--nproc / --node-rank, what a trainer pod runs).

The environment is read here, once (WorkerEnv / NodeEnv / WorkerSettings, flags winning over
variables); everything below gets those values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from meshjob_trainer import worker
from meshjob_trainer.checkpoint import CheckpointError
from meshjob_trainer.dist import DistError, NodeEnv, WorkerEnv, WorkerSettings

HELP = "one trainer process per device (what a trainer pod runs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", help="TrainingJob YAML (default: $MESHJOB_JOB)")
    parser.add_argument(
        "--hosts", help="hosts.yaml: [{name, devices, rack}] (default: $MESHJOB_HOSTS, else the plan's default hosts)"
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="start this host's ranks (must equal the devices the plan uses on it)"
    )
    parser.add_argument(
        "--node-rank", type=int, default=None, help="which of the job's hosts this is (default: $NODE_RANK, else 0)"
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoints (default: $MESHJOB_CHECKPOINT_DIR, else spec.training.checkpoint.path)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for peers at the rendezvous and in collectives"
    )


def _bad(flag: str, value: object, allowed: str) -> int:
    print(f"meshjob worker: {flag}: {value!r} is invalid: {allowed}", file=sys.stderr)
    return 2


def _settings(args: argparse.Namespace, environ: dict[str, str]) -> WorkerSettings:
    flags = {"job_path": args.job, "hosts_path": args.hosts, "checkpoint_dir": args.checkpoint_dir}
    settings = WorkerSettings.from_env(environ)
    return dataclasses.replace(settings, **{k: os.path.abspath(v) for k, v in flags.items() if v})


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None and args.nproc < 1:
        return _bad("--nproc", args.nproc, "an integer >= 1")
    if args.node_rank is not None and args.node_rank < 0:
        return _bad("--node-rank", args.node_rank, "an integer >= 0")
    if not args.timeout > 0:
        return _bad("--timeout", args.timeout, "a number of seconds > 0")
    environ = dict(os.environ)  # the process boundary: nothing below reads the environment
    try:
        settings = _settings(args, environ)
        if not settings.job_path:
            return _bad("--job", args.job, "a TrainingJob YAML file (or set MESHJOB_JOB)")
        setup = worker.load_setup(settings)  # SpecError: exit 2
        if args.nproc is None and NodeEnv.has_rank(environ):
            worker.run_worker(WorkerEnv.from_env(environ), settings, setup, args.timeout)
            return 0
        node = NodeEnv.from_env(environ)
        if args.node_rank is not None:
            node = dataclasses.replace(node, node_rank=args.node_rank)
        result = worker.run_host(setup, settings, node, args.nproc, args.timeout)
    except (DistError, CheckpointError) as err:  # said plainly, not as a traceback
        print(f"meshjob worker: {err}", file=sys.stderr)
        return 1
    for failure in result.failures():
        print(
            f"meshjob worker: rank {failure.rank} exited {failure.exit_code}: "
            f"{failure.error.strip().splitlines()[-1] if failure.error.strip() else ''}",
            file=sys.stderr,
        )
    if result.ok and settings.termination_log:
        write_summary(settings.termination_log, worker.host_summary(result.values))
    return 0 if result.ok else 1


def write_summary(path: str, summary: dict[str, float | int]) -> None:
    """The host's end of training as its container's termination message (a line of JSON): the operator
    reads the final step and loss from the pod's status once the pod has ended. Best effort: the run
    itself succeeded."""
    try:
        with open(path, "w") as f:
            f.write(json.dumps(summary) + "\n")
    except OSError as err:
        print(f"meshjob worker: cannot write the summary to {path}: {err}", file=sys.stderr)
