"""Command-line options shared by `meshjob plan` and `meshjob simulate`: the network model and the
compute costs a plan is built with (--nic-rate, --duplex, --message-us, --tbf-burst, --emulated, --calibrate,
--device)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
from dataclasses import replace
from typing import TypedDict

from meshjob.costs.compute import CostModel
from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import parse_device
from meshjob.errors import UsageError
from meshjob.network.model import DEFAULT_MESSAGE_S, DUPLEX, NetworkModel, emulated_network
from meshjob.search.cluster import Cluster
from meshjob.search.settings import DEFAULT_NIC_RATE, resolve
from meshjob.spec.manifest import TrainingJob
from meshjob.spec.model import TunedForSpec
from meshjob.units import parse_rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nic-rate",
        default=None,
        help=f"NIC rate per host and direction, tc style (default: spec.tunedFor's, else {DEFAULT_NIC_RATE})",
    )
    p.add_argument(
        "--duplex",
        default="full",
        choices=DUPLEX,
        help="network model: full (separate egress and ingress links, as NICs are; default) or "
        "half (the paper's: a host in one transfer at a time; for the ablation)",
    )
    p.add_argument(
        "--message-us",
        type=float,
        default=DEFAULT_MESSAGE_S * 1e6,
        help=f"per-message cost in microseconds (default {DEFAULT_MESSAGE_S * 1e6:g}, measured on "
        "the emulated cluster by `meshjob bench message-cost`)",
    )
    p.add_argument(
        "--tbf-burst",
        default="0",
        help="each NIC a token bucket of this size like the emulated cluster's tc tbf (e.g. 128kb, "
        "what `meshjob run` and the benchmarks use); default 0: real NICs",
    )
    p.add_argument(
        "--emulated",
        action="store_true",
        help="the network model `meshjob run` plans its emulated cluster with: every host on this "
        "machine's cores, the communication engine's link time and CPU per message as `meshjob "
        "bench resharding` measured them (meshjob.network.model.emulated_network); takes --nic-rate",
    )
    p.add_argument(
        "--device",
        default=None,
        help="compute costs of this device profile (a100, h100 or TFLOP/s), as `meshjob run --compute "
        "emulated --device` waits them (meshjob.costs.device_costs)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure compute costs with a short forward/backward of the model on this machine "
        "(needs the meshjob-trainer distribution); they size the weight-gradient delay",
    )


def network_from_args(args: argparse.Namespace, tuned: TunedForSpec | None = None) -> NetworkModel:
    """The NetworkModel the options describe, at --nic-rate, else a tuned manifest's (`tuned`: its
    spec.tunedFor), else the default; a bad value is a UsageError naming the option or field."""
    settings = resolve(tuned, nic_rate=args.nic_rate)
    try:
        nic = parse_rate(settings.nic_rate, settings.nic_path)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not (math.isfinite(args.message_us) and args.message_us >= 0):
        raise UsageError(f"--message-us: {args.message_us!r} is invalid: a number of microseconds >= 0")
    if getattr(args, "emulated", False):
        return _emulated(args, nic)
    return NetworkModel(
        nic_bytes_per_s=nic, message_s=args.message_us / 1e6, duplex=args.duplex, burst_bytes=_burst(args.tbf_burst)
    )


def _emulated(args: argparse.Namespace, nic_bytes_per_s: float) -> NetworkModel:
    """--emulated: `meshjob run`'s model at the NIC rate, on this machine's cores (PlanInputs.emulated's); it
    has its own per-message costs and duplex, so the options that set those are refused."""
    others = [
        name
        for name, given in (
            ("--message-us", args.message_us != DEFAULT_MESSAGE_S * 1e6),
            ("--duplex", args.duplex != "full"),
            ("--tbf-burst", _burst(args.tbf_burst) != 0),
        )
        if given
    ]
    if others:
        raise UsageError(
            f"--emulated plans with the costs `meshjob run` uses on the emulated cluster: it takes "
            f"--nic-rate, not {', '.join(others)}"
        )
    return emulated_network(nic_bytes_per_s, os.cpu_count() or 1)


def _burst(text: str) -> float:
    """A tc size ("128kb", "1mb", "0") in bytes; k and m count 1024 as tc does."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(b|kb|k|mb|m)?\s*", str(text).lower())
    if not m:
        raise UsageError(f"--tbf-burst: {text!r} is invalid: a size such as 0, 128kb or 1mb")
    return float(m.group(1)) * {None: 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}[m.group(2)]


def tuned_cluster(args: argparse.Namespace, job: TrainingJob, network: NetworkModel) -> Cluster | None:
    """A tuned manifest (spec.tunedFor) whose compute no flag sets otherwise: the cluster it was tuned for,
    the flags over it, on `network`; its plan is then predicted as `meshjob tune` predicted it
    (meshjob.search.job_step). None for any other manifest."""
    if job.tuned_for is None or args.calibrate or getattr(args, "layer_forward_ms", None) is not None:
        return None
    settings = resolve(job.tuned_for, nic_rate=args.nic_rate, device=args.device)
    return settings.cluster(job.topology.devices_per_host, network)


def cost_from_args(args: argparse.Namespace, job: TrainingJob, network: NetworkModel) -> CostModel:
    """The CostModel: the formula's defaults, or (--calibrate) measured on this machine."""
    cost = CostModel(network=network)
    if getattr(args, "device", None) is not None:
        if args.calibrate:
            raise UsageError("--calibrate and --device: choose one source of compute costs")
        return replace(cost, stages=emulated_costs(job, parse_device(args.device)), measured=True)
    if not args.calibrate:
        return cost
    return replace(cost, **measure(job), measured=True)


# --calibrate runs the model with torch: the trainer distribution's, found by name like `meshjob run`
# (the plan layer never imports an executor).
CALIBRATOR = "meshjob_trainer.calibrate"


class Calibration(TypedDict):
    """What meshjob_trainer.calibrate.measure_costs measures: the CostModel fields of the formula."""

    layer_forward_s: float  # one layer's forward, per sample
    backward_factor: float  # backward / forward


def measure(job: TrainingJob) -> Calibration:
    """The trainer's measured compute costs for `job` (meshjob_trainer.calibrate.measure_costs)."""
    try:
        calibrate = importlib.import_module(CALIBRATOR)
    except ModuleNotFoundError as err:
        raise UsageError(
            f"--calibrate: needs the meshjob-trainer distribution (torch), which is not installed "
            f"({err.name} is missing; from a checkout: pip install ./trainer)"
        ) from None
    figures: Calibration = calibrate.measure_costs(job)
    return figures
