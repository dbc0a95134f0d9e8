"""Compute costs for the simulator, measured on this machine: a short forward/backward of the model.

The whole model runs as one stage in this process (no distribution, one thread per rank as in `meshjob run`),
so the figures are what one device spends per layer and sample; the simulator divides them by each stage's
tensor- and data-parallel degrees.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from meshjob_trainer.families import build_stage
from meshjob_trainer.numerics import Numerics


def measure_costs(job: Any, repeats: int = 3) -> dict[str, float]:
    """{"layer_forward_s": forward seconds per layer per sample, "backward_factor": backward / forward}."""
    torch.set_num_threads(1)
    config = job.model
    module = build_stage(config, 0, config.layers, job.training.seed, numerics=Numerics(job.training.precision))
    samples = job.training.microbatch_size
    gen = torch.Generator().manual_seed(job.training.seed)
    tokens = torch.randint(config.vocab, (samples, config.seq_len), generator=gen)
    inputs = {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1)}
    forward, backward = [], []
    for i in range(repeats + 1):  # the first round warms up allocators and kernels
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = module(inputs)["loss"]
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    f, b = statistics.median(forward), statistics.median(backward)
    return {"layer_forward_s": f / (config.layers * samples), "backward_factor": b / f}
