"""`spec.stages: auto` in the cluster: the operator runs meshjob tune's search on the Nodes it would place on,
creates the pods of the plan it chose, and records the choice (status.tuned, a StagesChosen Event), the choice
`meshjob plan --cluster` shows beforehand; a model
that fits no plan fails the job (reason Infeasible) with a Warning Event naming the smallest overflow.

Run against kmock and, when KUBEBUILDER_ASSETS names a folder with kube-apiserver, against a real
kube-apiserver v1.20 with the generated CRD (which must take `stages: auto`), as the operator scenarios are.
"""

from __future__ import annotations

import pytest
import yaml
from operator_harness import (  # noqa: F401 - the fixtures: kmock and a real API server
    add_nodes,
    apiserver,
    cluster,
    condition,
    delete_and_wait,
    env_of,
    operator,
    plan_on_cluster,
    prepare_namespace,
    scenario_job,
    wait_pods,
    wait_status,
)

from meshjob.cluster import auto_stages
from meshjob.cluster.nodes import host_pods
from meshjob.plan.placement import Host
from meshjob.plan.rendered import DEFAULT_NIC_BYTES_PER_S, PlanInputs
from meshjob.spec.manifest import parse_job
from meshjob_operator.reconcile import manifest
from meshjob_operator.testing import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]

# fp32 weights, gradients and AdamW state of 8 layers of width 8192 take about 100 GiB: more than one
# 80 GiB device holds, so the search spreads the model over several devices (and pods)
SPREAD = {"kind": "gpt", "layers": 8, "hidden": 8192, "heads": 64, "vocab": 64, "seqLen": 16}
# 32 layers of width 16384 on one device: no plan fits
TOO_BIG = {"kind": "gpt", "layers": 32, "hidden": 16384, "heads": 64, "vocab": 64, "seqLen": 16}


def auto_job(tag: str, model: dict, devices: int = 2) -> dict:
    """The scenario job with its stages, microbatches, schedule and resharding strategy left to the search."""
    body = scenario_job(tag, devices=devices)
    spec = body["spec"]
    spec["stages"] = "auto"
    spec["model"] = dict(model)
    spec["training"].pop("microbatches")
    spec.pop("schedule")
    spec["resharding"] = {"chunks": 2}
    return body


async def chosen_events(cluster, tag: str, reason: str, type_: str) -> list[dict]:
    async def found() -> list[dict] | None:
        return [
            e
            for e in await cluster.events(tag)
            if e.get("reason") == reason and e.get("type") == type_ and e.get("involvedObject", {}).get("name") == tag
        ] or None

    return await eventually(found, what=f"a {type_} Event {reason}")


async def test_stages_auto_creates_the_pods_of_the_chosen_plan_and_records_the_choice(cluster, operator, tmp_path):
    tag = "auto-chosen"
    await prepare_namespace(cluster, tag)
    nodes = await add_nodes(cluster, tag, 3)
    body = auto_job(tag, SPREAD)
    shown = await plan_on_cluster(cluster, body, tmp_path)
    await cluster.create_job(body)
    # the same search in this process, on the same hosts: the operator's child must choose the same
    expected = auto_stages.tune(
        manifest(body), auto_stages.search_cluster([Host(n, 2) for n in nodes], DEFAULT_NIC_BYTES_PER_S)
    )
    chosen = expected.job()
    assert len(chosen.stages) > 1  # the model fits no single device
    wanted = host_pods(PlanInputs.of(chosen, [Host(n, 2) for n in nodes]).build().placement)

    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Created", "phase Created")
    assert status["tuned"] == expected.status() == shown["tuned"]  # `meshjob plan --cluster` too
    assert status["hosts"] == len(wanted)
    pods = await wait_pods(cluster, tag, len(wanted))
    assert {env_of(p)["WORLD_SIZE"] for p in pods} == {str(chosen.world_size)}
    # what the ranks read: the ConfigMap's job.yaml names the chosen stages, not `auto`
    cm = await cluster.get("configmaps", f"{tag}-plan", tag)
    ran = parse_job(yaml.safe_load(cm["data"]["job.yaml"]))
    assert ran.stages == chosen.stages and ran.training.microbatches == chosen.training.microbatches
    assert ran.schedule == chosen.schedule and ran.resharding == chosen.resharding
    events = await chosen_events(cluster, tag, "StagesChosen", "Normal")
    assert events[0]["message"] == expected.message()[:1000]
    # the stored spec still says auto: the choice lives in status and in the plan's ConfigMap
    assert (await cluster.job(tag, tag))["spec"]["stages"] == "auto"
    await delete_and_wait(cluster, tag)


async def test_stages_auto_that_fits_nowhere_fails_with_the_smallest_overflow(cluster, operator):
    tag = "auto-infeasible"
    await prepare_namespace(cluster, tag)
    await add_nodes(cluster, tag, 1, devices=1)
    await cluster.create_job(auto_job(tag, TOO_BIG, devices=1))
    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Failed", "phase Failed")
    failed = condition(status, "Failed")
    assert failed["reason"] == "Infeasible" and "smallest overflow found is" in failed["message"]
    events = await chosen_events(cluster, tag, "Infeasible", "Warning")
    assert "smallest overflow found is" in events[0]["message"]
    assert await cluster.pods(tag, tag) == [] and "tuned" not in status
    await delete_and_wait(cluster, tag)


async def test_microbatches_auto_with_stages_written_runs_the_chosen_plan_and_records_the_microbatches(
    cluster, operator
):
    tag = "auto-microbatches"
    await prepare_namespace(cluster, tag)
    nodes = await add_nodes(cluster, tag, 2)
    body = scenario_job(tag)
    body["spec"]["training"]["microbatches"] = "auto"
    await cluster.create_job(body)
    # the search with the stages as written, on the same hosts: the operator's child must choose the same
    expected = auto_stages.tune(
        manifest(body), auto_stages.search_cluster([Host(n, 2) for n in nodes], DEFAULT_NIC_BYTES_PER_S)
    )
    chosen = expected.job()
    assert chosen.stages == parse_job(scenario_job(tag)).stages  # kept as written
    wanted = host_pods(PlanInputs.of(chosen, [Host(n, 2) for n in nodes]).build().placement)

    status = await wait_status(cluster, tag, lambda s: s.get("phase") == "Created", "phase Created")
    assert status["tuned"] == expected.status()
    assert status["tuned"]["microbatches"] == chosen.training.microbatches
    pods = await wait_pods(cluster, tag, len(wanted))
    assert {env_of(p)["WORLD_SIZE"] for p in pods} == {str(chosen.world_size)}
    cm = await cluster.get("configmaps", f"{tag}-plan", tag)
    ran = parse_job(yaml.safe_load(cm["data"]["job.yaml"]))  # what the ranks read: a count, not `auto`
    assert ran.training.microbatches == chosen.training.microbatches and ran.stages == chosen.stages
    assert (await cluster.job(tag, tag))["spec"]["training"]["microbatches"] == "auto"
    await delete_and_wait(cluster, tag)
