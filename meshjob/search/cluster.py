"""The cluster `meshjob tune` searches on: identical hosts of identical devices behind one NIC each.

A device is meshjob.costs.devices' DeviceProfile (the compute rate emulated compute uses) plus what the search
also needs: its memory and the bandwidth between devices of one host (NVLink). The figures of the named
devices are the vendors' data sheets (SXM parts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshjob.costs.devices import DEVICES as PROFILES
from meshjob.costs.devices import DeviceProfile
from meshjob.network.model import NetworkModel
from meshjob.plan.placement import Host

GiB = 2**30


@dataclass(frozen=True)
class TuneDevice:
    profile: DeviceProfile
    memory_bytes: int
    link_bytes_per_s: float  # between devices of one host, per direction

    @property
    def name(self) -> str:
        return self.profile.name

    def flops_per_s(self, precision: str) -> float:
        """The profile's reachable rate (its dense tensor-core peak x efficiency), for either precision:
        emulated compute uses the same rate."""
        return self.profile.flops_per_s

    def to_json(self) -> dict[str, object]:
        return {**self.profile.to_json(), "memory_bytes": self.memory_bytes, "link_bytes_per_s": self.link_bytes_per_s}


DEVICES: dict[str, TuneDevice] = {
    # H100 SXM5 80 GB, NVLink 4: 900 GB/s (450 each way); A100 SXM4 80 GB, NVLink 3: 600 GB/s (300 each way)
    "h100": TuneDevice(PROFILES["h100"], 80 * GiB, 450e9),
    "a100": TuneDevice(PROFILES["a100"], 80 * GiB, 300e9),
}


@dataclass(frozen=True)
class Cluster:
    hosts: int
    devices_per_host: int
    device: TuneDevice = field(default_factory=lambda: DEVICES["h100"])
    network: NetworkModel = field(default_factory=NetworkModel)  # its intra-host rate is the device link's
    memory_bytes: int | None = None  # per device; None: the device's

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} is invalid: a positive integer")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes {self.memory_bytes!r} is invalid: a positive number of bytes")

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def memory(self) -> int:
        return self.device.memory_bytes if self.memory_bytes is None else self.memory_bytes

    def host_list(self) -> tuple[Host, ...]:
        return tuple(Host(f"host-{i}", self.devices_per_host) for i in range(self.hosts))

    def to_json(self) -> dict[str, object]:
        return {
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "device": self.device.to_json(),
            "memory_bytes": self.memory,
            "network": self.network.to_json(),
        }
