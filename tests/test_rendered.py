"""The operator ships the plan's inputs and digest; a worker rebuilds from them and refuses a plan
whose digest differs, naming both digests and the parts that differ."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from meshjob.plan import rendered
from meshjob.plan.placement import Host
from meshjob.plan.rendered import PlanInputs, PlanMismatch
from meshjob.spec.manifest import load_job

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"
HOSTS = (Host("n0", 2, "r0"), Host("n1", 2, "r0"), Host("n2", 2, "r1"))


def write_rendered(folder: Path, inputs: PlanInputs) -> dict[str, str]:
    files = rendered.render(inputs, inputs.build())
    files[rendered.JOB_FILE] = TINY.read_text()
    for name, text in files.items():
        (folder / name).write_text(text)
    return {name: str(folder / name) for name in files}


def load(paths: dict[str, str]):
    return rendered.load(paths[rendered.JOB_FILE], paths[rendered.HOSTS_FILE], paths[rendered.PLAN_FILE])


def test_the_inputs_read_back_from_the_files_give_the_same_plan(tmp_path):
    inputs = PlanInputs.of(load_job(str(TINY)), HOSTS, nic_bytes_per_s=2.5e7)
    again, expected = load(write_rendered(tmp_path, inputs))
    assert again == inputs
    assert expected.digest == again.build().digest() == inputs.build().digest()
    expected.check(again.build())


def test_the_rendered_plan_holds_inputs_and_digests_not_the_plan():
    inputs = PlanInputs.of(load_job(str(TINY)), HOSTS)
    doc = json.loads(rendered.render(inputs, inputs.build())[rendered.PLAN_FILE])
    assert set(doc) == {"nic_bytes_per_s", "cost_model", "digest", "sections"}
    assert set(doc["sections"]) >= {"placement", "boundaries", "schedules"}


def test_a_plan_built_from_other_hosts_is_refused_naming_both_digests_and_what_differs(tmp_path):
    inputs = PlanInputs.of(load_job(str(TINY)), HOSTS)
    paths = write_rendered(tmp_path, inputs)
    theirs = inputs.build().digest()
    edited = [{"name": h.name, "devices": h.devices, "rack": "elsewhere"} for h in HOSTS]
    Path(paths[rendered.HOSTS_FILE]).write_text(yaml.safe_dump(edited))
    again, expected = load(paths)
    ours = again.build().digest()
    with pytest.raises(PlanMismatch) as err:
        expected.check(again.build())
    message = str(err.value)
    assert ours != theirs and ours in message and theirs in message
    differing = re.search(r"\(digest \w+\) in ([a-z_, ]+):", message).group(1).split(", ")
    assert "hosts" in differing and "schedules" not in differing  # the racks moved, the schedules did not


def test_a_named_rendered_plan_that_is_missing_is_an_error_not_a_skip(tmp_path):
    with pytest.raises(PlanMismatch, match=r"nope.json cannot be read .*it was named \(MESHJOB_PLAN\)"):
        rendered.load(str(TINY), "", str(tmp_path / "nope.json"))


def test_a_rendered_plan_without_its_digest_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"nic_bytes_per_s": 1e8, "cost_model": {}}))
    with pytest.raises(PlanMismatch, match="lacks digest, sections"):
        rendered.load(str(TINY), "", str(path))
