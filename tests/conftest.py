"""Shared fixtures. torch is imported here once so that forked ranks start in milliseconds
instead of each importing it (see meshjob.trainer.launch)."""
from __future__ import annotations

import pytest

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError:  # the plan-layer and operator tests run without torch
    torch = None


@pytest.fixture
def gang():
    """launch(world_size, target, **kw) -> values; fails the test with every rank's traceback."""
    from meshjob.trainer.launch import launch_local

    def launch(world_size: int, target, timeout_s: float = 45.0, **kwargs):
        return launch_local(world_size, target, timeout_s=timeout_s, **kwargs).raise_on_failure().values

    return launch
