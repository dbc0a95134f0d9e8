"""What a benchmark ran on: torch, the cores, and whether tensors moved over NCCL on GPUs or over gloo on the CPU.

The trainer puts every rank on CUDA over NCCL wherever torch sees a GPU (meshjob_trainer.dist), so a bench
that runs ranks records which transport that was. The GPU's name is asked only after the ranks ran (`named`):
CUDA initialised in the launcher would break the ranks it forks; counting GPUs asks NVML, which does not.
"""

from __future__ import annotations

import os
from typing import Any


def gpu_visible() -> bool:
    """Whether torch sees a GPU, asking NVML: safe in a process that forks ranks afterwards."""
    # torch only when called: the module imports without it (`meshjob bench --help` imports every benchmark)
    import torch

    return torch.cuda.device_count() > 0


def transport_here() -> str:
    """What the trainer's ranks use on this machine: "nccl" with a GPU, else "gloo"."""
    return "nccl" if gpu_visible() else "gloo"


def machine(named: bool = True) -> dict[str, Any]:
    """torch's version, the cores, and with a GPU their number, the first one's name (`named`) and NCCL's version."""
    # torch only when called: the module imports without it (`meshjob bench --help` imports every benchmark)
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    if gpu_visible():
        out["gpus"] = torch.cuda.device_count()
        if named:
            out.update(gpu=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out
