"""Command-line options shared by `meshjob plan` and `meshjob simulate`: the network model and the
compute costs a plan is built with (--nic-rate, --duplex, --message-us, --calibrate)."""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

from meshjob.network import DEFAULT_MESSAGE_S, DUPLEX


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nic-rate", default="1gbit", help="NIC rate per host and direction, tc style (default 1gbit)")
    p.add_argument("--duplex", default="full", choices=DUPLEX,
                   help="network model: full (separate egress and ingress links, as NICs are; default) or "
                        "half (the paper's: a host in one transfer at a time; for the ablation)")
    p.add_argument("--message-us", type=float, default=DEFAULT_MESSAGE_S * 1e6,
                   help=f"per-message cost in microseconds (default {DEFAULT_MESSAGE_S * 1e6:g}, measured on "
                        "the emulated cluster by `meshjob bench message-cost`)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure compute costs with a short forward/backward of the model on this machine "
                        "(needs the meshjob-trainer distribution); they size the weight-gradient delay")


def network_from_args(args: argparse.Namespace) -> Any:
    """The NetworkModel the options describe; a bad value is a UsageError naming the option."""
    from meshjob.errors import UsageError
    from meshjob.network import NetworkModel
    from meshjob.units import parse_rate

    try:
        nic = parse_rate(args.nic_rate, "--nic-rate")
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not (math.isfinite(args.message_us) and args.message_us >= 0):
        raise UsageError(f"--message-us: {args.message_us!r} is invalid: a number of microseconds >= 0")
    return NetworkModel(nic_bytes_per_s=nic, message_s=args.message_us / 1e6, duplex=args.duplex)


def cost_from_args(args: argparse.Namespace, job: Any, network: Any) -> Any:
    """The CostModel: the formula's defaults, or (--calibrate) measured on this machine."""
    from meshjob.costs import CostModel

    cost = CostModel(network=network)
    if not args.calibrate:
        return cost
    return replace(cost, **measure(job), measured=True)


def measure(job: Any) -> dict[str, float]:
    """meshjob_trainer.calibrate's figures for `job`, imported only here (it needs torch)."""
    from meshjob.errors import UsageError

    try:
        from meshjob_trainer.calibrate import measure_costs
    except ModuleNotFoundError as err:
        raise UsageError(f"--calibrate: needs the meshjob-trainer distribution (torch), which is not installed "
                         f"({err.name} is missing; from a checkout: pip install ./trainer)") from None
    return measure_costs(job)
