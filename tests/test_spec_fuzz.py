"""Fuzz: random mutations of valid manifests and random YAML text never make the parser raise
anything but SpecError; whatever it accepts round-trips and passes the CRD schema too."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshjob.errors import SpecError
from meshjob.spec.crd import open_api_schema
from meshjob.spec.manifest import TrainingJob, job_to_dict, parse_job, parse_yaml
from meshjob.spec.safeyaml import load_documents
from meshjob_bench.fuzz import locations

EXAMPLE_TEXTS = [p.read_text() for p in sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))]
EXAMPLES = [load_documents(t)[0] for t in EXAMPLE_TEXTS]
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def with_nulls(schema: Any) -> Any:
    """OpenAPI `nullable: true` as draft-4 JSON Schema (type or null)."""
    if isinstance(schema, dict):
        out = {k: with_nulls(v) for k, v in schema.items()}
        if out.pop("nullable", False):
            out["type"] = [out["type"], "null"]
        return out
    return schema


def kubernetes_integer(checker: Any, value: Any) -> bool:
    """Kubernetes reads JSON numbers with an integral value (1e3, 2.0) as integers; Draft 4 does not."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


KubernetesValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    type_checker=jsonschema.Draft4Validator.TYPE_CHECKER.redefine("integer", kubernetes_integer),
)
SCHEMA = KubernetesValidator(with_nulls(open_api_schema()))

# values that sit near the rules (small ints, layouts, enum words) as well as arbitrary ones
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 12),
    st.integers(),
    st.floats(allow_nan=True),
    st.sampled_from(
        [
            "S0RR",
            "RRR",
            "S1RR",
            "S01RR",
            "RS0R",
            "S0,R,R",
            "gpt",
            "utransformer",
            "off",
            "skip0",
            "activation",
            "broadcast",
            "",
            "x",
        ]
    ),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(["from", "to", "send", "recv", "layers", "mesh", "dataParallelDim", "tensor"]),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)


@st.composite
def mutated_documents(draw) -> Any:
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    for _ in range(draw(st.integers(1, 3))):
        places = locations(doc)
        container, key = draw(st.sampled_from(places))
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if action == "set":
            container[key] = draw(values)
        elif action == "delete":
            del container[key]
        elif isinstance(container[key], dict):
            container[key][draw(st.text(max_size=8))] = draw(values)
        elif isinstance(container[key], list):
            container[key].append(draw(values))
    return doc


def check_accepted(job: TrainingJob, doc: Any) -> None:
    assert parse_job(job_to_dict(job)) == job
    assert [e.message for e in SCHEMA.iter_errors(doc)] == []


@FUZZ
@given(mutated_documents())
def test_mutated_manifest_is_accepted_consistently_or_rejected_with_spec_error(doc):
    try:
        job = parse_job(doc)
    except SpecError as err:
        assert err.errors and all(e.path and e.allowed for e in err.errors)
        return
    check_accepted(job, doc)


@FUZZ
@given(st.sampled_from(EXAMPLE_TEXTS), st.integers(0, 2000), st.integers(0, 20), st.text(max_size=12))
def test_edited_yaml_text_is_accepted_or_rejected_with_spec_error(text, at, cut, insert):
    at = at % (len(text) + 1)
    edited = text[:at] + insert + text[at + cut :]
    try:
        job = parse_yaml(edited)
    except SpecError as err:
        assert err.errors
        return
    check_accepted(job, load_documents(edited)[0])


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text_never_raises_anything_but_spec_error(text):
    try:
        parse_yaml(text)
    except SpecError as err:
        assert err.errors


@FUZZ
@given(values)
def test_arbitrary_documents_never_raise_anything_but_spec_error(doc):
    try:
        parse_job(doc)
    except SpecError as err:
        assert err.errors
