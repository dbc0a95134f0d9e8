"""Every manifest under examples/ is valid for both the CRD's openAPIV3Schema and parse_job,
and each example is what its name promises."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from meshjob.spec.crd import open_api_schema
from meshjob.spec.manifest import job_to_dict, load_job, parse_job

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
MAX_RANKS = 8  # the machines here have 2 cores


def validator() -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas follow JSON Schema draft 4 (boolean exclusiveMinimum)
    return jsonschema.Draft4Validator(open_api_schema())


def example(name: str):
    return load_job(str(EXAMPLES[0].parent / f"{name}.yaml"))


def test_the_three_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"gpt-demo", "utransformer-demo", "tiny"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_against_the_crd_schema(path):
    errors = [e.message for e in validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_parses_and_round_trips(path):
    job = load_job(str(path))
    assert parse_job(job_to_dict(job)) == job
    assert job.name == path.stem


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_fits_this_machine(path):
    assert load_job(str(path)).world_size <= MAX_RANKS


def test_crd_schema_rejects_what_parse_job_rejects_structurally():
    doc = yaml.safe_load((EXAMPLES[0].parent / "tiny.yaml").read_text())
    doc["spec"]["schedule"]["kind"] = "interleaved"
    doc["spec"]["stages"][0]["mesh"] = [1, 0]
    messages = sorted(e.message for e in validator().iter_errors(doc))
    assert len(messages) == 2 and any("interleaved" in m for m in messages)


def test_gpt_demo_has_four_stages_with_tensor_and_data_parallelism():
    job = example("gpt-demo")
    assert job.model.kind == "gpt" and len(job.stages) == 4
    assert sum(s.tensor_parallel == 2 for s in job.stages) == 2
    assert any(s.data_parallel > 1 for s in job.stages)
    assert job.training.steps <= 200  # the README main job: about a minute on 2 cores


def test_utransformer_demo_has_skip_edges_that_cross_stages():
    job = example("utransformer-demo")
    skips = [e for e in job.edges if e.tensor.startswith("skip")]
    assert skips and all(e.dst - e.src >= 1 for e in skips)
    assert any(e.dst - e.src > 1 for e in skips)  # not only neighbours: a DAG, not a chain


def test_tiny_is_two_stages_on_two_to_four_ranks():
    job = example("tiny")
    assert len(job.stages) == 2 and 2 <= job.world_size <= 4


def test_the_readme_manifest_is_a_valid_training_job():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"## A manifest\n\n```yaml\n(.*?)```", readme, re.S)
    assert block is not None, "README.md lost its '## A manifest' YAML block"
    assert parse_job(yaml.safe_load(block.group(1))).name == "gpt-demo"
