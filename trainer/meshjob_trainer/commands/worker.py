"""`meshjob worker`: one trainer process (RANK set, as under torchrun or Kubeflow), or one host's
worth of ranks (--nproc / --node-rank, what a trainer pod runs)."""
from __future__ import annotations

import argparse
import os
import sys

HELP = "one trainer process per device (what a trainer pod runs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", default=os.environ.get("MESHJOB_JOB", ""),
                        help="TrainingJob YAML (default: $MESHJOB_JOB)")
    parser.add_argument("--hosts", default=os.environ.get("MESHJOB_HOSTS", ""),
                        help="hosts.yaml: [{name, devices, rack}] (default: $MESHJOB_HOSTS, else the plan's default hosts)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="start this host's ranks (must equal the devices the plan uses on it)")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="which of the job's hosts this is (default: $NODE_RANK, else 0)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoints (default: $MESHJOB_CHECKPOINT_DIR, else spec.training.checkpoint.path)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for peers at the rendezvous and in collectives")


def _bad(flag: str, value: object, allowed: str) -> int:
    print(f"meshjob worker: {flag}: {value!r} is invalid: {allowed}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from meshjob_trainer.dist import DistError, WorkerEnv
    from meshjob_trainer.worker import load_setup, run_host, run_worker

    if args.nproc is not None and args.nproc < 1:
        return _bad("--nproc", args.nproc, "an integer >= 1")
    if args.node_rank is not None and args.node_rank < 0:
        return _bad("--node-rank", args.node_rank, "an integer >= 0")
    if not args.timeout > 0:
        return _bad("--timeout", args.timeout, "a number of seconds > 0")
    if not args.job:
        return _bad("--job", args.job, "a TrainingJob YAML file (or set MESHJOB_JOB)")
    os.environ["MESHJOB_JOB"] = os.path.abspath(args.job)
    if args.hosts:
        os.environ["MESHJOB_HOSTS"] = os.path.abspath(args.hosts)
    if args.checkpoint_dir:
        os.environ["MESHJOB_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir)
    try:
        setup = load_setup(os.environ["MESHJOB_JOB"], os.environ.get("MESHJOB_HOSTS", ""))  # SpecError: exit 2
        one_process = args.nproc is None and (os.environ.get("RANK") or os.environ.get("PET_RANK"))
        if one_process:
            run_worker(WorkerEnv.from_env(), args.timeout, setup)
            return 0
        node_rank = args.node_rank if args.node_rank is not None else int(
            os.environ.get("NODE_RANK") or os.environ.get("PET_NODE_RANK") or 0)
        result = run_host(setup, node_rank, args.nproc, dict(os.environ), args.timeout)
    except DistError as err:
        print(f"meshjob worker: {err}", file=sys.stderr)
        return 1
    for failure in result.failures():
        print(f"meshjob worker: rank {failure.rank} exited {failure.exit_code}: "
              f"{failure.error.strip().splitlines()[-1] if failure.error.strip() else ''}", file=sys.stderr)
    return 0 if result.ok else 1
