"""`spec.stages: auto`: only the search path takes it, the search on a cluster's hosts is deterministic
across processes, and a started auto job compares with what was chosen for it (meshjob.cluster.auto_stages)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshjob import cli
from meshjob.cluster import auto_stages
from meshjob.errors import PlacementError
from meshjob.plan.placement import Host
from meshjob.search.algorithm import Infeasible
from meshjob.spec.manifest import SpecError, job_to_dict, parse_job

ROOT = Path(__file__).resolve().parents[1]
NIC = 125e6
MODEL = {"kind": "gpt", "layers": 4, "hidden": 4096, "heads": 32, "vocab": 64, "seqLen": 16}


def auto_doc(**spec) -> dict:
    doc = {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "auto"},
        "spec": {
            "model": dict(MODEL),
            "training": {"steps": 2, "globalBatch": 8},
            "topology": {"devicesPerHost": 2},
            "stages": "auto",
        },
    }
    doc["spec"].update(spec)
    return doc


def hosts(n: int, devices: int = 2) -> list[Host]:
    return [Host(f"node-{i}", devices) for i in range(n)]


def test_parse_job_refuses_stages_auto_naming_the_field_and_the_search():
    with pytest.raises(SpecError) as err:
        parse_job(auto_doc())
    assert "spec.stages: 'auto' is invalid" in str(err.value) and "meshjob tune" in str(err.value)


@pytest.mark.parametrize("value", [5, "many", "AUTO", True, {"layers": [0, 4]}, []])
def test_stages_other_than_auto_or_a_list_are_refused_naming_the_field(value):
    from meshjob_operator.reconcile import validate

    for parse in (parse_job, validate):  # meshjob plan's and the operator's reading
        with pytest.raises(SpecError, match=r"spec\.stages"):
            parse(auto_doc(stages=value))


def test_meshjob_plan_on_an_auto_manifest_exits_2_saying_how_to_choose_stages(tmp_path, capsys):
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(auto_doc()))
    assert cli.main(["plan", str(path)]) == 2
    assert "spec.stages" in capsys.readouterr().err


def test_the_search_path_accepts_stages_auto_and_validates_every_other_field():
    job = auto_stages.parse_searchable(auto_doc())
    assert auto_stages.wants_search(auto_doc()) and not auto_stages.wants_search(auto_doc(stages=[]))
    assert job.model.layers == 4 and len(job.stages) == 1  # a placeholder until the search runs
    with pytest.raises(SpecError, match=r"spec\.model\.heads"):
        auto_stages.parse_searchable(auto_doc(model={**MODEL, "heads": 0}))
    with pytest.raises(SpecError, match=r"spec\.edges"):
        auto_stages.parse_searchable(auto_doc(edges=[{"from": 0, "to": 1}]))
    with pytest.raises(SpecError, match=r"spec\.model\.kind"):
        auto_stages.parse_searchable(auto_doc(model={"kind": "custom", "layers": 2, "entrypoint": "a.b:c"}))


def test_the_search_cluster_is_the_hosts_with_the_smallest_hosts_devices():
    cluster = auto_stages.search_cluster([Host("a", 4), Host("b", 2), Host("c", 0)], NIC)
    assert (cluster.hosts, cluster.devices_per_host, cluster.network.nic_bytes_per_s) == (2, 2, NIC)
    with pytest.raises(PlacementError, match="no usable host"):
        auto_stages.search_cluster([Host("a", 0)], NIC)


def test_the_chosen_manifest_is_a_valid_job_with_the_status_naming_its_choices():
    tuned = auto_stages.tune(auto_doc(), auto_stages.search_cluster(hosts(2), NIC))
    job = tuned.job()
    status = tuned.status()
    assert status["stages"] == job_to_dict(job)["spec"]["stages"]
    assert status["microbatches"] == job.training.microbatches and status["cluster"]["hosts"] == 2
    assert status["schedule"]["kind"] == job.schedule.kind and status["predictedStepSeconds"] > 0
    assert job.world_size <= 4 and "predicted step" in tuned.message()


def test_fields_the_manifest_sets_are_kept_by_the_search():
    doc = auto_doc(
        schedule={"kind": "gpipe", "weightGradDelay": 0}, training={"steps": 2, "globalBatch": 8, "microbatches": 4}
    )
    job = auto_stages.tune(doc, auto_stages.search_cluster(hosts(2), NIC)).job()
    assert (job.schedule.kind, job.schedule.weight_grad_delay, job.training.microbatches) == ("gpipe", 0, 4)


def test_a_model_that_fits_no_device_is_infeasible_with_the_smallest_overflow():
    doc = auto_doc(model={**MODEL, "layers": 32, "hidden": 16384, "heads": 64})
    with pytest.raises(Infeasible, match="smallest overflow found is"):
        auto_stages.tune(doc, auto_stages.search_cluster(hosts(1, 1), NIC))


SEARCH_IN_A_PROCESS = """
import json, sys
from meshjob.cluster import auto_stages
from meshjob.plan.placement import Host
doc = json.loads(sys.argv[1])
hosts = [Host(f"node-{i}", 2) for i in range(3)]
print(json.dumps(auto_stages.tune(doc, auto_stages.search_cluster(hosts, 125e6)).status(), sort_keys=True))
"""


def test_the_search_chooses_the_same_in_every_process():
    doc = auto_doc(model={**MODEL, "layers": 6})
    runs = [
        subprocess.run(
            [sys.executable, "-c", SEARCH_IN_A_PROCESS, json.dumps(doc)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        for _ in range(2)
    ]
    here = auto_stages.tune(doc, auto_stages.search_cluster(hosts(3), NIC)).status()
    assert runs[0] == runs[1] == json.dumps(here, sort_keys=True) + "\n"


def test_a_started_auto_job_equals_its_started_spec_until_a_fixed_field_is_edited():
    doc = auto_doc()
    started = auto_stages.tune(doc, auto_stages.search_cluster(hosts(2), NIC)).job()
    same = auto_stages.as_started(auto_stages.parse_searchable(doc), doc, started)
    assert job_to_dict(same) == job_to_dict(started)
    edited = auto_doc(model={**MODEL, "hidden": 2048})
    changed = auto_stages.as_started(auto_stages.parse_searchable(edited), edited, started)
    assert changed.model.hidden == 2048 and changed.stages == started.stages


def test_the_operator_validates_an_auto_job_and_refuses_bad_ones_naming_the_field():
    from meshjob_operator.reconcile import validate

    assert len(validate(auto_doc()).stages) == 1
    with pytest.raises(SpecError, match=r"spec\.stages"):
        validate(auto_doc(stages="many"))


EXAMPLE = ROOT / "examples" / "kubernetes" / "gpt-auto.yaml"


def test_the_auto_example_is_valid_for_the_crd_and_the_search_and_tunes_to_a_valid_job():
    import jsonschema

    from meshjob.spec.crd import open_api_schema

    doc = yaml.safe_load(EXAMPLE.read_text())
    assert list(jsonschema.Draft4Validator(open_api_schema()).iter_errors(doc)) == []
    entry = auto_stages.read_for_cluster(doc)
    assert entry.search == doc and entry.job.name == EXAMPLE.stem
    job = auto_stages.tune(doc, auto_stages.search_cluster(hosts(4), NIC)).job()
    assert parse_job(job_to_dict(job)) == job and job.world_size <= 8


def test_plan_cluster_shows_the_operators_choice_for_an_auto_manifest():
    from kubernetes.utils.quantity import parse_quantity

    from meshjob.commands.plan import plan_on_cluster
    from meshjob_operator.testing import node_body

    doc = auto_doc()
    nodes = [node_body(f"node-{i}", 2) for i in range(3)]
    entry = auto_stages.read_for_cluster(doc)
    shown = plan_on_cluster(entry.job, nodes, [], NIC, entry.search)
    expected = auto_stages.tune_on_nodes(entry.job, doc, nodes, parse_quantity, NIC)
    assert shown["tuned"] == expected.status()
    assert sum(p["devices"] for p in shown["cluster"]["pods"]) == expected.job().world_size
    with pytest.raises(PlacementError, match="no usable host.*left out: node-0 \\(not Ready\\)"):
        auto_stages.tune_on_nodes(entry.job, doc, [node_body("node-0", 2, ready=False)], parse_quantity, NIC)


SEARCHED = [("training", "microbatches"), ("schedule", "kind"), ("resharding", "strategy"), ("resharding", "balancer")]


def with_field(doc: dict, section: str, key: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["spec"].setdefault(section, {})[key] = value
    return doc


def without_field(doc: dict, section: str, key: str) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["spec"].get(section, {}).pop(key, None)
    return doc


TINY = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())


@pytest.mark.parametrize("section,key", SEARCHED)
def test_parse_job_refuses_auto_in_a_searched_field_naming_it_and_the_search(section, key):
    with pytest.raises(SpecError) as err:
        parse_job(with_field(TINY, section, key, "auto"))
    assert len(err.value.errors) == 1 and err.value.errors[0].path == f"spec.{section}.{key}"
    assert "meshjob tune" in str(err.value) and "spec.stages: auto" in str(err.value)


def test_meshjob_plan_and_run_exit_2_naming_a_field_left_to_the_search(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_field(TINY, "training", "microbatches", "auto")))
    for command in ("plan", "run"):
        assert cli.main([command, str(path)]) == 2
        assert "spec.training.microbatches: 'auto' is invalid" in capsys.readouterr().err


def test_weight_grad_delay_and_chunks_auto_are_plan_values_not_a_search():
    doc = with_field(with_field(TINY, "schedule", "weightGradDelay", "auto"), "resharding", "chunks", "auto")
    assert not auto_stages.wants_search(doc)
    assert auto_stages.read_for_cluster(doc).search is None and parse_job(doc).resharding.chunks == "auto"


@pytest.mark.parametrize("section,key", SEARCHED)
def test_the_search_treats_auto_in_a_field_like_the_field_left_out(section, key):
    cluster = auto_stages.search_cluster(hosts(2), NIC)
    auto = with_field(auto_doc(), section, key, "auto")
    left_out = without_field(auto_doc(), section, key)
    assert auto_stages.wants_search(auto)
    assert auto_stages.parse_searchable(auto) == auto_stages.parse_searchable(left_out)
    assert auto_stages.tune(auto, cluster).status() == auto_stages.tune(left_out, cluster).status()


def test_auto_in_a_field_with_stages_written_searches_that_field_keeping_the_stages():
    doc = with_field(TINY, "training", "microbatches", "auto")
    entry = auto_stages.read_for_cluster(doc)  # the operator's reading: a search, with the stages as written
    assert entry.search == doc and entry.job.stages == parse_job(TINY).stages
    tiny = parse_job(TINY)
    tuned = auto_stages.tune(doc, auto_stages.search_cluster(hosts(4, tiny.topology.devices_per_host), NIC))
    chosen = tuned.job()
    assert [(s.layers, s.mesh) for s in chosen.stages] == [(s.layers, s.mesh) for s in tiny.stages]
    assert tuned.status()["microbatches"] == chosen.training.microbatches
    assert tiny.training.global_batch % chosen.training.microbatches == 0
    assert (chosen.schedule.kind, chosen.resharding.strategy) == (tiny.schedule.kind, tiny.resharding.strategy)


def test_auto_in_a_field_with_a_stage_mesh_the_search_cannot_place_is_refused_naming_the_mesh():
    doc = with_field(TINY, "training", "microbatches", "auto")
    doc["spec"]["stages"][0]["mesh"] = [1, 1, 2]
    doc["spec"]["stages"][0].pop("tensorParallelDim", None)
    doc["spec"]["stages"][0].pop("dataParallelDim", None)
    with pytest.raises(SpecError, match=r"spec\.stages\[0\]\.mesh"):
        auto_stages.read_for_cluster(doc)
