"""Every bench that runs ranks says what it ran on: the trainer's transport here and the machine."""

from __future__ import annotations

import torch

from meshjob_bench import machine as machine_module


def test_without_a_gpu_the_transport_is_gloo_and_the_machine_names_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert machine_module.transport_here() == "gloo"
    assert machine_module.machine() == {"torch": torch.__version__, "cpus": machine_module.os.cpu_count()}


def test_with_a_gpu_the_transport_is_nccl_and_the_machine_counts_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert machine_module.transport_here() == "nccl"
    assert machine_module.machine(named=False)["gpus"] == 2  # named: asks CUDA, which this machine lacks
