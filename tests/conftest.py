"""Shared fixtures. torch is imported here once so that forked ranks start in milliseconds
instead of each importing it (see meshjob_trainer.launch)."""

from __future__ import annotations

import pytest

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError:  # the plan-layer and operator tests run without torch
    torch = None


# gloo's TCP mesh on loopback now and then fails to form while the process group starts ("Connection
# closed by peer" in connectFullMesh; PyTorch's own gloo tests flake the same way, pytorch/pytorch#53270).
# Seen once here in a CI run of 1736 tests; the same test passed on every rerun.
GLOO_MESH_FLAKE = "Gloo connectFullMesh failed"
KILLED_FOR_ANOTHER = "killed: another rank failed"


def failed_only_forming_the_mesh(result) -> bool:
    """Whether a gang failed only because gloo's connection mesh did not form: some rank's process group
    did not start for that reason, and every other failed rank was killed for it."""
    failures = result.failures()
    return any(GLOO_MESH_FLAKE in r.error for r in failures) and all(
        GLOO_MESH_FLAKE in r.error or KILLED_FOR_ANOTHER in r.error for r in failures
    )


def run_losses(folder, name: str, doc: dict) -> list[list[float]]:
    """[step, loss] of each step of a real `meshjob run` of manifest `doc` (written to `folder`), which must
    train every step it asks for."""
    import json

    import yaml

    from meshjob.cli import main as cli_main

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = folder / f"{name}.json"
    assert cli_main(["run", str(path), "--no-netns", "--quiet", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["steps_completed"] == doc["spec"]["training"]["steps"]
    return summary["losses"]


@pytest.fixture
def gang():
    """launch(world_size, target(env), **kw) -> values; fails the test with every rank's traceback. A gang
    whose gloo mesh did not form (above) is launched once more: its ranks start over."""
    from meshjob_trainer.launch import launch as launch_gang

    def launch(world_size: int, target, timeout_s: float = 45.0, **kwargs):
        result = launch_gang(world_size, lambda ctx: target(ctx.env), timeout_s=timeout_s, **kwargs)
        if not result.ok and failed_only_forming_the_mesh(result):
            result = launch_gang(world_size, lambda ctx: target(ctx.env), timeout_s=timeout_s, **kwargs)
        return result.raise_on_failure().values

    return launch


ONE_HOST_JOB = {  # 2 stages x 2 ranks on one 4-device host: the smallest job a worker test runs
    "apiVersion": "meshjob.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "onehost"},
    "spec": {
        "model": {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seqLen": 16},
        "training": {"steps": 4, "globalBatch": 8, "microbatches": 2, "learningRate": 1.0e-3, "seed": 0},
        "topology": {"devicesPerHost": 4},
        "stages": [
            {"layers": [0, 1], "mesh": [1, 2], "tensorParallelDim": 1},
            {"layers": [1, 2], "mesh": [1, 2], "dataParallelDim": 1},
        ],
        "resharding": {"strategy": "broadcast", "chunks": 2, "balancer": "greedy", "budgetSeconds": 0.5},
        "schedule": {"kind": "1f1b", "weightGradDelay": 0},
    },
}


@pytest.fixture
def one_host_job(tmp_path):
    """write(name="job", **training_overrides) -> path of a YAML file of ONE_HOST_JOB."""
    import copy

    import yaml

    def write(name: str = "job", **training):
        doc = copy.deepcopy(ONE_HOST_JOB)
        doc["spec"]["training"].update(training)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    return write
