"""meshjob.search.stage_model: the search's stage costs are meshjob.costs.device_costs' (what emulated compute
waits), its
objective includes the optimizer step, and a data-parallel stage's gradient ring moves the gradients the
emulated trainer all-reduces."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshjob.costs.device_costs import range_work, work_cost
from meshjob.costs.devices import DeviceProfile
from meshjob.network.model import NetworkModel
from meshjob.search.algorithm import Candidate, Problem, default_space
from meshjob.search.cluster import Cluster, TuneDevice
from meshjob.search.inputs import base_job, read_fixed
from meshjob.search.stage_model import StageChoice, stage_figures

# a device whose roofline is bound by memory bandwidth for these shapes: a FLOPs-only model would miss it
SLOW_MEMORY = DeviceProfile("slow-memory", tflops=100.0, memory_gbytes_per_s=50.0)


def doc(**spec) -> dict:
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seqLen": 64},
            "training": {"globalBatch": 8},
            **spec,
        },
    }


def cluster(hosts: int = 2, per_host: int = 2, profile: DeviceProfile = SLOW_MEMORY) -> Cluster:
    device = TuneDevice(profile, 80 * 2**30, 450e9)
    return Cluster(hosts, per_host, device, NetworkModel(intra_host_bytes_per_s=device.link_bytes_per_s))


def test_stage_compute_and_optimizer_step_are_device_costs_on_the_clusters_device():
    d = doc()
    job = base_job(d, 2)
    for profile in (SLOW_MEMORY, replace(SLOW_MEMORY, memory_gbytes_per_s=5000.0)):
        own = work_cost(range_work(job.model, job.training, 1, 3, 2, 1), profile)
        got = stage_figures(job.model, job.training, cluster(profile=profile), 1, 3, StageChoice((1, 2), (1,), None))
        assert got.cost == own.stage
        assert got.optimizer_s == own.optimizer_s > 0


def test_the_search_objective_includes_the_optimizer_step():
    d = doc(stages=[{"layers": [0, 4], "mesh": [1, 1]}], schedule={"kind": "gpipe", "weightGradDelay": 0})
    d["spec"]["training"]["microbatches"] = 1
    c = cluster()
    job = base_job(d, c.devices_per_host)
    fixed = read_fixed(d)
    p = Problem(d, job, c, fixed, default_space(job, fixed, c))
    one = StageChoice((1, 1), (), None)
    prediction = p.predict(Candidate(1, "gpipe", "0", (4,), (one,)))
    own = work_cost(range_work(job.model, job.training, 0, 4, 1, 1), c.device.profile)
    assert prediction.step_s == pytest.approx(own.stage.forward_s + own.stage.backward_s + own.optimizer_s)


def test_a_ring_across_hosts_moves_the_devices_gradients_through_each_nic_once_per_device_on_it():
    job = base_job(doc(), 2)
    c = cluster(hosts=4)
    choice = StageChoice((4, 2), (0,), 1)
    fig = stage_figures(job.model, job.training, c, 0, 4, choice)
    params = work_cost(range_work(job.model, job.training, 0, 4, 4, 2), c.device.profile).params
    assert fig.sync.flows == 2
    assert fig.sync.nic_s == pytest.approx(2 * 3 / 4 * 4 * params * 2 / c.network.nic_bytes_per_s)
    assert fig.tail_s == pytest.approx(fig.allreduce_s + fig.optimizer_s)


def test_a_gradient_ring_inside_a_host_runs_at_the_networks_intra_host_rate_a_tensor_parallel_one_on_the_device_link():
    job = base_job(doc(), 2)
    slow_loopback = replace(cluster(), network=NetworkModel(intra_host_bytes_per_s=1e9))
    fast = cluster()
    dp = StageChoice((1, 2), (1,), None)
    assert (
        stage_figures(job.model, job.training, slow_loopback, 0, 4, dp).allreduce_s
        > 10 * stage_figures(job.model, job.training, fast, 0, 4, dp).allreduce_s
    )
    tp = StageChoice((1, 2), (), 1)
    assert (
        stage_figures(job.model, job.training, slow_loopback, 0, 4, tp).cost
        == stage_figures(job.model, job.training, fast, 0, 4, tp).cost
    )
