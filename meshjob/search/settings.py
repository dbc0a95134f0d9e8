"""The cluster a plan is predicted on (hosts, NIC rate, device profile, memory per device): the one set of
defaults `meshjob tune`, `plan` and `simulate` share, a tuned manifest's spec.tunedFor, and flags over both.

A flag wins over spec.tunedFor, which wins over the defaults here; so `meshjob simulate tuned.yaml` predicts the
plan on the cluster `meshjob tune` chose it for, with the same model (meshjob.search.job_step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from meshjob.errors import FieldError, SpecError, UsageError
from meshjob.network.model import NetworkModel
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.spec.model import TunedForSpec
from meshjob.units import parse_rate, parse_size

DEFAULT_NIC_RATE = "1gbit"  # the emulated cluster's NICs, which `meshjob run` and the benchmarks shape
DEFAULT_DEVICE = "h100"  # the device `meshjob tune` prices a stage on when neither flag nor manifest names one


@dataclass(frozen=True)
class Settings:
    """What a prediction runs on, as text (what the manifest records) and each value's source path."""

    hosts: int
    nic_rate: str
    device: str
    memory: str = ""  # "": the device profile's
    nic_path: str = "--nic-rate"
    device_path: str = "--device"
    memory_path: str = "--memory"

    def cluster(self, devices_per_host: int, network: NetworkModel | None = None) -> Cluster:
        """The Cluster these settings describe; `network` (default: the standard model at the NIC rate) gets the
        device link as its intra-host rate. Bad values: SpecError naming the flag or field."""
        if self.device not in DEVICES:
            raise SpecError([FieldError(self.device_path, self.device, f"one of {', '.join(sorted(DEVICES))}")])
        device = DEVICES[self.device]
        try:
            nic = parse_rate(self.nic_rate, self.nic_path)
        except ValueError as err:
            raise UsageError(str(err)) from None  # it names the flag or field, the value and what is allowed
        base = network if network is not None else NetworkModel()
        net = NetworkModel(
            **{**base.__dict__, "nic_bytes_per_s": nic, "intra_host_bytes_per_s": device.link_bytes_per_s}
        )
        memory = parse_memory(self.memory, self.memory_path) if self.memory else None
        return Cluster(self.hosts, devices_per_host, device, net, memory)

    def to_spec(self) -> dict[str, Any]:
        """spec.tunedFor of the manifest `meshjob tune --out` writes."""
        out: dict[str, Any] = {"hosts": self.hosts, "nicRate": self.nic_rate, "device": self.device}
        if self.memory:
            out["memory"] = self.memory
        return out


def resolve(
    tuned: TunedForSpec | None,
    hosts: int | None = None,
    nic_rate: str | None = None,
    device: str | None = None,
    memory: str | None = None,
) -> Settings:
    """Each setting from its flag (not None), else the manifest's spec.tunedFor, else the default."""
    field = "spec.tunedFor"

    def pick(flag: str | None, recorded: str | None, default: str, name: str, yaml: str) -> tuple[str, str]:
        if flag is not None:
            return flag, f"--{name}"
        if recorded:
            return recorded, f"{field}.{yaml}"
        return default, f"--{name}"

    nic, nic_path = pick(nic_rate, tuned.nic_rate if tuned else None, DEFAULT_NIC_RATE, "nic-rate", "nicRate")
    dev, dev_path = pick(device, tuned.device if tuned else None, DEFAULT_DEVICE, "device", "device")
    mem, mem_path = pick(memory, tuned.memory if tuned else None, "", "memory", "memory")
    count = hosts if hosts is not None else (tuned.hosts if tuned else 1)
    return Settings(count, nic, dev, mem, nic_path, dev_path, mem_path)


def parse_memory(text: str, path: str = "--memory") -> int:
    """Kubernetes quantities (80Gi) and byte sizes (80GiB, 64mb); SpecError naming `path` when not positive."""
    quantity = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(Ki|Mi|Gi|Ti)\s*", text)
    try:
        n = (
            int(float(quantity.group(1)) * 2 ** (10 * ("KMGT".index(quantity.group(2)[0]) + 1)))
            if quantity
            else parse_size(text)
        )
    except ValueError:
        n = 0
    if n <= 0:
        raise SpecError([FieldError(path, text, "a positive size such as 80Gi, 80GiB or 40960MiB")])
    return n
