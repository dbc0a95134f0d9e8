"""meshjob.search.algorithm: equals exhaustive enumeration on small spaces, keeps the fixed fields, says how much memory
is missing when nothing fits, and gives the same answer in another process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from meshjob.network.model import NetworkModel
from meshjob.search.algorithm import Infeasible, Problem, default_space, exhaustive, search
from meshjob.search.cluster import DEVICES, Cluster
from meshjob.search.inputs import base_job, read_fixed


def manifest(layers: int, hidden: int = 64, heads: int = 4, batch: int = 8, seq: int = 32, **spec) -> dict:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"kind": "gpt", "layers": layers, "hidden": hidden, "heads": heads, "vocab": 256, "seqLen": seq},
            "training": {"globalBatch": batch},
            **spec,
        },
    }


def problem(
    doc: dict, hosts: int, per_host: int, nic: float = 1e9 / 8, memory: int | None = None, device: str = "h100", **space
) -> Problem:
    profile = DEVICES[device]
    cluster = Cluster(
        hosts,
        per_host,
        profile,
        NetworkModel(nic_bytes_per_s=nic, intra_host_bytes_per_s=profile.link_bytes_per_s),
        memory,
    )
    fixed = read_fixed(doc)
    job = base_job(doc, per_host)
    return Problem(doc, job, cluster, fixed, replace(default_space(job, fixed, cluster), **space))


def random_case(seed: int) -> Problem:
    """A small random model and cluster (<= 8 devices, <= 8 layers) and a space an exhaustive run can afford."""
    rng = random.Random(seed)
    hosts, per_host = rng.choice([(1, 2), (2, 1), (2, 2), (1, 4)])
    layers = rng.randint(2, 4)
    hidden = rng.choice([64, 128])
    doc = manifest(layers, hidden=hidden, batch=rng.choice([4, 8]), seq=rng.choice([16, 64]))
    nic = rng.choice([1e8, 1e9, 1e10]) / 8
    kinds = tuple(rng.sample([("1f1b", 0), ("eager-1f1b", "auto"), ("gpipe", 0)], 2))
    return problem(
        doc,
        hosts,
        per_host,
        nic=nic,
        microbatches=(2, 4),
        schedules=kinds,
        strategies=("broadcast",),
        balancers=("greedy",),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_equals_exhaustive_enumeration_on_small_random_spaces(seed):
    p = random_case(seed)
    found = search(p, max_evaluations=10**6)
    assert found.proven
    assert found.best.step_s == pytest.approx(exhaustive(p).step_s, rel=1e-9)


def test_lower_bound_never_exceeds_the_simulated_step():
    p = random_case(3)
    for prediction in search(p, top=50, max_evaluations=10**6).ranked:
        assert prediction.bound_s <= prediction.step_s * (1 + 1e-9)


def test_fixed_fields_are_kept():
    doc = manifest(
        4,
        stages=[{"layers": [0, 1]}, {}],
        schedule={"kind": "gpipe", "weightGradDelay": 0},
        resharding={"strategy": "send_recv"},
    )
    doc["spec"]["training"]["microbatches"] = 2
    p = problem(doc, 2, 2, strategies=("send_recv",), balancers=("greedy",))
    for prediction in search(p, top=10, max_evaluations=10**6).ranked:
        c = prediction.candidate
        assert (len(c.layers), c.layers[0], c.microbatches, c.kind, c.delay, c.strategy) == (
            2,
            1,
            2,
            "gpipe",
            "0",
            "send_recv",
        )


def test_a_fixed_mesh_is_used_as_written():
    doc = manifest(4, stages=[{"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1}, {}])
    p = problem(doc, 2, 2, microbatches=(2,), strategies=("broadcast",), balancers=("greedy",))
    best = search(p, max_evaluations=10**6).best.candidate
    assert (best.choices[0].mesh, best.choices[0].tp_dim, best.choices[0].dp_dims) == ((1, 2), 1, ())


def test_a_model_too_large_for_the_cluster_reports_the_smallest_overflow():
    doc = manifest(4, hidden=1024, heads=8)
    with pytest.raises(Infeasible, match=r"smallest overflow found is [0-9.]+ GiB"):
        search(problem(doc, 1, 2, memory=2**20, microbatches=(2,)))


def test_the_written_manifest_passes_the_spec():
    from meshjob.plan.build import build_plan
    from meshjob.spec.manifest import parse_job

    p = random_case(4)
    best = search(p, max_evaluations=10**6).best
    job = parse_job(p.manifest(best.candidate))
    assert build_plan(job, p.cluster.host_list()).placement.world_size == best.candidate.devices


CHILD = """
import json, sys
sys.path[:0] = {path!r}
from tests.test_search import random_case
from meshjob.search.algorithm import search
r = search(random_case(5), max_evaluations=10**6)
print(json.dumps([r.best.step_s, r.best.candidate.label(), r.evaluated]))
"""


def test_the_search_is_deterministic_across_processes():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = search(random_case(5), max_evaluations=10**6)
    here = [r.best.step_s, r.best.candidate.label(), r.evaluated]
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(path=[root] + sys.path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=root,
    )
    assert json.loads(out.stdout) == here
