"""meshjob.spec.manifest: the TrainingJob manifest (README), its defaults, and every validation rule."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from meshjob.errors import FieldError, SpecError
from meshjob.spec.manifest import (
    EdgeSpec,
    StageSpec,
    TrainingJob,
    job_to_dict,
    load_job,
    load_jobs,
    natural_layout,
    parse_job,
    parse_yaml,
)

DESIGN_EXAMPLE = """
apiVersion: meshjob.io/v1alpha1
kind: TrainingJob
metadata: {name: gpt-demo}
spec:
  image: meshjob/trainer:0.1.0
  model: {kind: gpt, layers: 8, hidden: 256, heads: 8, vocab: 1024, seqLen: 128}
  training: {steps: 20, globalBatch: 32, microbatches: 8, learningRate: 3.0e-4, seed: 0,
             checkpoint: {every: 10, path: /ckpt}}
  topology: {devicesPerHost: 2, hostLabel: kubernetes.io/hostname,
             rackLabel: topology.kubernetes.io/zone, deviceResource: cpu}
  stages:
    - {layers: [0, 4], mesh: [1, 2], dataParallelDim: 0, tensorParallelDim: 1}
    - {layers: [4, 8], mesh: [2, 1], dataParallelDim: 0}
  edges:
    - {from: 0, to: 1, send: S0RR, recv: S0RR}
  resharding: {strategy: broadcast, chunks: 16, balancer: greedy, budgetSeconds: 1.0}
  schedule: {kind: eager-1f1b, weightGradDelay: auto}
  runPolicy: {backoffLimit: 3, activeDeadlineSeconds: 3600, ttlSecondsAfterFinished: 600,
              cleanPodPolicy: Running, suspend: false}
  metrics: {port: 9400}
"""
DELETE = object()


def base() -> dict[str, Any]:
    return yaml.safe_load(DESIGN_EXAMPLE)


def mutate(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or DELETE) the value at a dotted path such as "spec.stages[1].mesh"."""
    doc = copy.deepcopy(doc)
    keys: list[Any] = []
    for part in path.split("."):
        name, _, rest = part.partition("[")
        keys.append(name)
        keys.extend(int(i) for i in rest.rstrip("]").split("][") if i) if rest else None
    node: Any = doc
    for key in keys[:-1]:
        node = node[key]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return doc


def errors_of(doc: Any) -> list[FieldError]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return info.value.errors


# --- the valid manifest ---------------------------------------------------------------------


def test_chunks_is_auto_by_default_or_the_integer_given():
    assert parse_job(mutate(base(), "spec.resharding.chunks", DELETE)).resharding.chunks == "auto"
    assert parse_job(mutate(base(), "spec.resharding.chunks", "auto")).resharding.chunks == "auto"
    assert parse_job(mutate(base(), "spec.resharding.chunks", 64)).resharding.chunks == 64
    for chunks in ("auto", 64):
        job = parse_job(mutate(base(), "spec.resharding.chunks", chunks))
        assert parse_job(job_to_dict(job)) == job


def test_design_example_parses_into_snake_case_dataclasses():
    job = parse_job(base())
    assert job.name == "gpt-demo" and job.namespace == "default"
    assert job.model.seq_len == 128 and job.training.global_batch == 32
    assert job.training.learning_rate == pytest.approx(3.0e-4)
    assert job.training.checkpoint.every == 10 and job.topology.devices_per_host == 2
    assert job.stages[0] == StageSpec(layers=(0, 4), mesh=(1, 2), data_parallel_dim=0, tensor_parallel_dim=1)
    assert job.resharding.budget_seconds == 1.0 and job.schedule.weight_grad_delay == "auto"
    assert job.run_policy.active_deadline_seconds == 3600 and job.run_policy.clean_pod_policy == "Running"
    assert job.activation_shape() == (4, 128, 256)


def test_omitted_sections_take_the_dataclass_defaults():
    doc = base()
    for key in ("image", "resharding", "schedule", "runPolicy", "metrics", "edges"):
        del doc["spec"][key]
    job = parse_job(doc)
    assert job.image == "meshjob/trainer:0.1.0" and job.resharding.strategy == "broadcast"
    assert job.schedule.kind == "eager-1f1b" and job.metrics.port == 9400
    assert job.run_policy.active_deadline_seconds is None


def test_operator_fields_scheduling_and_service_account_are_parsed():
    doc = mutate(base(), "spec.scheduling", {"gang": True, "queue": "team-q", "topologyLevel": "rack"})
    job = parse_job(mutate(doc, "spec.serviceAccountName", "trainer"))
    assert job.scheduling.gang and job.scheduling.queue == "team-q" and job.scheduling.topology_level == "rack"
    assert job.scheduling.scheduler_name == "" and job.service_account_name == "trainer"


def test_namespace_comes_from_metadata():
    assert parse_job(mutate(base(), "metadata.namespace", "team-a")).namespace == "team-a"


def test_other_kubernetes_metadata_and_status_are_ignored():
    doc = mutate(base(), "metadata.uid", "1234")
    doc = mutate(doc, "metadata.labels", {"a": "b"})
    doc["status"] = {"phase": "Running"}
    assert parse_job(doc).name == "gpt-demo"


@pytest.mark.parametrize(
    "mesh, dp, expected",
    [
        ((2, 1), 0, "S0RR"),
        ((1, 2), 1, "S1RR"),
        ((1, 2), 0, "RRR"),
        ((2, 2), None, "RRR"),
        ((2, 2, 2), 2, "S2RR"),
    ],
)
def test_natural_layout_shards_batch_over_the_data_parallel_dim_only(mesh, dp, expected):
    assert natural_layout(StageSpec(layers=(0, 1), mesh=mesh, data_parallel_dim=dp)) == expected


def test_default_edges_are_the_chain_with_natural_layouts():
    doc = mutate(base(), "spec.edges", DELETE)
    assert parse_job(doc).edges == (EdgeSpec(0, 1, "RRR", "S0RR", "activation"),)


def test_utransformer_adds_skip_edges_between_the_stages_of_layer_i_and_layer_L_minus_1_minus_i():
    doc = mutate(base(), "spec.model.kind", "utransformer")
    doc = mutate(doc, "spec.edges", DELETE)
    doc = mutate(
        doc,
        "spec.stages",
        [
            {"layers": [0, 3], "mesh": [2, 1], "dataParallelDim": 0},
            {"layers": [3, 5], "mesh": [1, 2]},
            {"layers": [5, 8], "mesh": [1, 1]},
        ],
    )
    edges = parse_job(doc).edges
    # layers 0,1,2 -> 7,6,5 (stage 0 -> 2); layer 3 -> 4 stays inside stage 1
    assert [(e.src, e.dst, e.tensor) for e in edges] == [
        (0, 1, "activation"),
        (1, 2, "activation"),
        (0, 2, "skip0"),
        (0, 2, "skip1"),
        (0, 2, "skip2"),
    ]
    assert all(e.send == "S0RR" for e in edges if e.src == 0)


def test_user_edge_layouts_are_stored_in_canonical_form():
    doc = mutate(base(), "spec.edges", [{"from": 0, "to": 1, "send": "S0,R,S1", "recv": "S0,R,R"}])
    assert parse_job(doc).edges == (EdgeSpec(0, 1, "S0RS1", "S0RR", "activation"),)


def test_user_edge_without_layouts_gets_the_natural_ones():
    doc = mutate(base(), "spec.edges", [{"from": 0, "to": 1}])
    assert parse_job(doc).edges == (EdgeSpec(0, 1, "RRR", "S0RR"),)


def test_job_to_dict_round_trips_through_parse_job():
    job = parse_job(mutate(base(), "spec.resources", {"limits": {"cpu": "1"}}))
    again = parse_job(job_to_dict(job))
    assert again == job and again.resources == {"limits": {"cpu": "1"}}


def test_job_to_dict_uses_the_manifest_names():
    spec = job_to_dict(parse_job(base()))["spec"]
    assert spec["model"]["seqLen"] == 128 and spec["edges"][0]["from"] == 0
    assert spec["stages"][1] == {"layers": [4, 8], "mesh": [2, 1], "dataParallelDim": 0}


# --- bad specs: every message names the path, the value and what is allowed -------------------

BAD = [
    # id, mutations (path, value), expected path, expected value, words in "allowed"
    ("api-version", [("apiVersion", "meshjob.io/v1")], "apiVersion", "meshjob.io/v1", "meshjob.io/v1alpha1"),
    ("kind", [("kind", "Job")], "kind", "Job", "TrainingJob"),
    ("name-not-dns1035", [("metadata.name", "Gpt_Demo")], "metadata.name", "Gpt_Demo", "DNS-1035"),
    ("name-starts-with-a-digit", [("metadata.name", "1gpt")], "metadata.name", "1gpt", "starting with a letter"),
    ("name-too-long-for-its-pods", [("metadata.name", "g" * 54)], "metadata.name", "g" * 54, "at most 53"),
    ("name-missing", [("metadata.name", DELETE)], "metadata.name", None, "DNS-1035"),
    ("namespace", [("metadata.namespace", "NS!")], "metadata.namespace", "NS!", "DNS-1123"),
    ("top-level-typo", [("sepc2", 1)], "sepc2", 1, "did you mean 'spec'"),
    ("spec-typo", [("spec.stagse", [])], "spec.stagse", [], "did you mean 'stages'"),
    ("model-typo", [("spec.model.hiden", 1)], "spec.model.hiden", 1, "did you mean 'hidden'"),
    ("spec-not-mapping", [("spec", [1])], "spec", [1], "a mapping with fields"),
    ("model-kind", [("spec.model.kind", "bert")], "spec.model.kind", "bert", "one of gpt, utransformer"),
    ("layers-zero", [("spec.model.layers", 0)], "spec.model.layers", 0, "an integer in 1..1024"),
    ("heads-string", [("spec.model.heads", "eight")], "spec.model.heads", "eight", "an integer in 1..1024"),
    ("heads-divide-hidden", [("spec.model.heads", 7)], "spec.model.heads", 7, "a divisor of spec.model.hidden (256)"),
    ("bool-is-no-integer", [("spec.training.steps", True)], "spec.training.steps", True, "an integer"),
    (
        "microbatches-divide-batch",
        [("spec.training.microbatches", 5)],
        "spec.training.microbatches",
        5,
        "a divisor of spec.training.globalBatch (32)",
    ),
    ("learning-rate-zero", [("spec.training.learningRate", 0)], "spec.training.learningRate", 0, "a number > 0"),
    (
        "learning-rate-string",
        [("spec.training.learningRate", "fast")],
        "spec.training.learningRate",
        "fast",
        "a number > 0",
    ),
    (
        "checkpoint-path-needed",
        [("spec.training.checkpoint.path", "")],
        "spec.training.checkpoint.path",
        "",
        "non-empty path when spec.training.checkpoint.every > 0",
    ),
    ("image-empty", [("spec.image", "")], "spec.image", "", "a string of 1 to 1024 characters"),
    ("stages-empty", [("spec.stages", [])], "spec.stages", [], "a list of 1 to 128 items"),
    ("stages-missing", [("spec.stages", DELETE)], "spec.stages", None, "required"),
    ("stage-gap", [("spec.stages[1].layers", [5, 8])], "spec.stages[1].layers", [5, 8], "[4, n) with 4 < n <= 8"),
    ("stage-empty-range", [("spec.stages[1].layers", [4, 4])], "spec.stages[1].layers", [4, 4], "a non-empty range"),
    (
        "stage-past-model",
        [("spec.stages[1].layers", [4, 9])],
        "spec.stages[1].layers",
        [4, 9],
        "ending at most at spec.model.layers (8)",
    ),
    (
        "stages-short-of-model",
        [("spec.stages[1].layers", [4, 6])],
        "spec.stages[1].layers",
        [4, 6],
        "ending at spec.model.layers (8)",
    ),
    ("layers-not-a-pair", [("spec.stages[0].layers", [0])], "spec.stages[0].layers", [0], "exactly 2"),
    ("stage-layers-missing", [("spec.stages[0].layers", DELETE)], "spec.stages[0].layers", None, "required"),
    (
        "mesh-four-dims",
        [("spec.stages[0].mesh", [1, 1, 1, 1])],
        "spec.stages[0].mesh",
        [1, 1, 1, 1],
        "a list of 1 to 3 items, each an integer in 1..4096",
    ),
    ("mesh-zero-dim", [("spec.stages[0].mesh", [0, 2])], "spec.stages[0].mesh[0]", 0, "an integer in 1..4096"),
    (
        "mesh-exceeds-host",
        [("spec.stages[0].mesh", [1, 4])],
        "spec.stages[0].mesh",
        [1, 4],
        "spec.topology.devicesPerHost (2)",
    ),
    ("mesh-too-large", [("spec.stages[1].mesh", [4096, 2])], "spec.stages[1].mesh", [4096, 2], "at most 4096 devices"),
    (
        "mesh-dim-too-large",
        [("spec.stages[1].mesh", [5000, 1])],
        "spec.stages[1].mesh[0]",
        5000,
        "an integer in 1..4096",
    ),
    (
        "dp-dim-out-of-range",
        [("spec.stages[1].dataParallelDim", 2)],
        "spec.stages[1].dataParallelDim",
        2,
        "a mesh dim in 0..1",
    ),
    (
        "dp-equals-tp",
        [("spec.stages[0].dataParallelDim", 1)],
        "spec.stages[0].tensorParallelDim",
        1,
        "other than dataParallelDim (1)",
    ),
    (
        "tp-degree-divides-heads",
        [("spec.topology.devicesPerHost", 3), ("spec.stages[0].mesh", [1, 3])],
        "spec.stages[0].mesh[1]",
        3,
        "dividing spec.model.heads (8)",
    ),
    (
        "dp-degree-divides-microbatch",
        [("spec.stages[1].mesh", [3, 1])],
        "spec.stages[1].mesh[0]",
        3,
        "dividing the microbatch size 4",
    ),
    (
        "strategy",
        [("spec.resharding.strategy", "bcast")],
        "spec.resharding.strategy",
        "bcast",
        "one of send_recv, local_allgather, global_allgather, broadcast, signal",
    ),
    (
        "balancer",
        [("spec.resharding.balancer", "random")],
        "spec.resharding.balancer",
        "random",
        "one of naive, load_balance, dfs, greedy",
    ),
    ("chunks-zero", [("spec.resharding.chunks", 0)], "spec.resharding.chunks", 0, "auto or an integer in 1..4096"),
    (
        "chunks-word",
        [("spec.resharding.chunks", "max")],
        "spec.resharding.chunks",
        "max",
        "auto or an integer in 1..4096",
    ),
    ("budget-negative", [("spec.resharding.budgetSeconds", -1)], "spec.resharding.budgetSeconds", -1, "a number > 0"),
    (
        "schedule-kind",
        [("spec.schedule.kind", "interleaved")],
        "spec.schedule.kind",
        "interleaved",
        "one of gpipe, 1f1b, eager-1f1b",
    ),
    (
        "weight-grad-delay-old-off",
        [("spec.schedule.weightGradDelay", "off")],
        "spec.schedule.weightGradDelay",
        "off",
        "'off' is no longer accepted: write 0",
    ),
    (
        "weight-grad-delay-old-on",
        [("spec.schedule.weightGradDelay", "on")],
        "spec.schedule.weightGradDelay",
        "on",
        "'on' is no longer accepted: write 1 (one delayed W per stage) or auto",
    ),
    (
        "weight-grad-delay-unquoted-off",
        [("spec.schedule.weightGradDelay", False)],
        "spec.schedule.weightGradDelay",
        False,
        "false is what YAML makes of unquoted off/no: write 0",
    ),
    (
        "weight-grad-delay-unquoted-on",
        [("spec.schedule.weightGradDelay", True)],
        "spec.schedule.weightGradDelay",
        True,
        "true is what YAML makes of unquoted on/yes: write 1",
    ),
    (
        "weight-grad-delay-negative",
        [("spec.schedule.weightGradDelay", -1)],
        "spec.schedule.weightGradDelay",
        -1,
        "auto or an integer in 0..4095",
    ),
    (
        "weight-grad-delay-word",
        [("spec.schedule.weightGradDelay", "always")],
        "spec.schedule.weightGradDelay",
        "always",
        "auto or an integer in 0..4095",
    ),
    (
        "clean-pod-policy",
        [("spec.runPolicy.cleanPodPolicy", "Always")],
        "spec.runPolicy.cleanPodPolicy",
        "Always",
        "one of All, Running, None",
    ),
    (
        "backoff-negative",
        [("spec.runPolicy.backoffLimit", -1)],
        "spec.runPolicy.backoffLimit",
        -1,
        "an integer in 0..2147483647",
    ),
    ("suspend-not-bool", [("spec.runPolicy.suspend", "yes")], "spec.runPolicy.suspend", "yes", "true or false"),
    ("port-range", [("spec.metrics.port", 70000)], "spec.metrics.port", 70000, "an integer in 1..65535"),
    (
        "scheduling-gang-not-bool",
        [("spec.scheduling", {"gang": "yes"})],
        "spec.scheduling.gang",
        "yes",
        "true or false",
    ),
    ("scheduling-typo", [("spec.scheduling", {"queu": "q"})], "spec.scheduling.queu", "q", "did you mean 'queue'"),
    ("resources-not-mapping", [("spec.resources", "4 cpus")], "spec.resources", "4 cpus", "a mapping"),
    ("edge-backwards", [("spec.edges", [{"from": 1, "to": 1}])], "spec.edges[0].to", 1, "a stage after from (1)"),
    ("edge-missing-stage", [("spec.edges", [{"from": 0, "to": 5}])], "spec.edges[0].to", 5, "a stage index in 0..1"),
    (
        "edge-not-in-model",
        [("spec.edges", [{"from": 0, "to": 1, "tensor": "skip0"}])],
        "spec.edges[0]",
        {"from": 0, "to": 1, "tensor": "skip0"},
        "an edge of the model: 0->1 activation",
    ),
    (
        "edge-listed-twice",
        [("spec.edges", [{"from": 0, "to": 1}, {"from": 0, "to": 1}])],
        "spec.edges[1]",
        {"from": 0, "to": 1, "tensor": "activation"},
        "each edge listed once",
    ),
    (
        "edge-tensor-name",
        [("spec.edges", [{"from": 0, "to": 1, "tensor": "act"}])],
        "spec.edges[0].tensor",
        "act",
        "matching ^(activation|skip[0-9]+)$",
    ),
    ("edge-typo", [("spec.edges", [{"from": 0, "too": 1}])], "spec.edges[0].too", 1, "did you mean 'to'"),
    (
        "send-syntax",
        [("spec.edges", [{"from": 0, "to": 1, "send": "S0X"}])],
        "spec.edges[0].send",
        "S0X",
        "R (replicated) or S<mesh dims>",
    ),
    (
        "send-token-count",
        [("spec.edges", [{"from": 0, "to": 1, "send": "S0R"}])],
        "spec.edges[0].send",
        "S0R",
        "3 tokens",
    ),
    (
        "send-mesh-dim-reused",
        [("spec.edges", [{"from": 0, "to": 1, "send": "S1S1R"}])],
        "spec.edges[0].send",
        "S1S1R",
        "each mesh dim at most once",
    ),
    (
        "send-mesh-dim-missing",
        [("spec.edges", [{"from": 0, "to": 1, "send": "S2RR"}])],
        "spec.edges[0].send",
        "S2RR",
        "mesh dims 0..1",
    ),
    (
        "send-not-divisible",
        [("spec.model.seqLen", 127), ("spec.edges", [{"from": 0, "to": 1, "send": "RS1R"}])],
        "spec.edges[0].send",
        "RS1R",
        "divisible",
    ),
    (
        "recv-less-sharded-than-natural",
        [("spec.edges", [{"from": 0, "to": 1, "recv": "RRR"}])],
        "spec.edges[0].recv",
        "RRR",
        "at least as sharded as the destination stage 1's natural layout S0RR",
    ),
    (
        "send-other-sharding-than-natural",
        [
            ("spec.stages[0].mesh", [2, 1]),
            ("spec.stages[0].tensorParallelDim", DELETE),
            ("spec.edges", [{"from": 0, "to": 1, "send": "RS0R"}]),
        ],
        "spec.edges[0].send",
        "RS0R",
        "at least as sharded as the source stage 0's natural layout S0RR",
    ),
]


@pytest.mark.parametrize("mutations, path, value, allowed", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_error_names_path_value_and_allowed(mutations, path, value, allowed):
    doc = base()
    for where, what in mutations:
        doc = mutate(doc, where, what)
    errors = errors_of(doc)
    matching = [e for e in errors if e.path == path]
    assert matching, f"no error at {path}; got {[str(e) for e in errors]}"
    error = matching[0]
    assert error.value == value and type(error.value) is type(value)
    assert allowed in error.allowed, error.allowed
    assert str(error).startswith(f"{path}: {value!r} is invalid: ")


def test_bad_spec_table_covers_at_least_twenty_kinds():
    assert len({b[0] for b in BAD}) >= 20


def test_all_errors_are_reported_at_once():
    doc = mutate(base(), "kind", "Job")
    doc = mutate(doc, "spec.model.heads", 7)
    doc = mutate(doc, "spec.stages[1].mesh", [2, 1, 1, 1])
    doc = mutate(doc, "spec.metrics.port", 0)
    doc = mutate(doc, "spec.resharding.chunks", "many")
    paths = {e.path for e in errors_of(doc)}
    assert paths == {"kind", "spec.model.heads", "spec.stages[1].mesh", "spec.metrics.port", "spec.resharding.chunks"}


def test_a_field_that_failed_its_type_check_raises_no_follow_up_errors():
    # heads is no integer: "heads divides hidden" and the tensor-parallel rule must stay silent
    errors = errors_of(mutate(base(), "spec.model.heads", "8"))
    assert [e.path for e in errors] == ["spec.model.heads"]


def test_spec_error_message_lists_every_field():
    doc = mutate(mutate(base(), "spec.metrics.port", 0), "spec.schedule.kind", "x")
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    assert "spec.metrics.port: 0 is invalid" in str(info.value)
    assert "spec.schedule.kind: 'x' is invalid" in str(info.value)


def test_document_that_is_not_a_mapping_is_a_spec_error():
    assert errors_of(["a", "list"])[0].path == "document"


# --- YAML files ------------------------------------------------------------------------------


def test_load_job_reads_a_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(DESIGN_EXAMPLE)
    assert load_job(str(path)) == parse_job(base())


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: meshjob.io/v1alpha1\nkind: TrainingJob\nspec: {model: [1, 2}\n")
    with pytest.raises(SpecError) as info:
        load_job(str(path))
    assert info.value.errors[0].path.startswith(f"{path}:3:")


def test_missing_file_is_a_spec_error_naming_it(tmp_path):
    with pytest.raises(SpecError) as info:
        load_job(str(tmp_path / "nope.yaml"))
    assert info.value.errors[0].path == str(tmp_path / "nope.yaml")


def test_parse_yaml_of_several_documents_is_a_spec_error():
    with pytest.raises(SpecError):
        parse_yaml(DESIGN_EXAMPLE + "\n---\n" + DESIGN_EXAMPLE)


def test_learning_rate_1e_minus_3_is_a_float_as_kubectl_reads_it():
    job = parse_yaml(DESIGN_EXAMPLE.replace("learningRate: 3.0e-4", "learningRate: 1e-3"))
    assert job.training.learning_rate == 0.001


def test_weight_grad_delay_is_auto_or_a_number_of_microbatches():
    for value, expected in (("auto", "auto"), ("0", 0), ("3", 3), ("'auto'", "auto")):
        job = parse_yaml(DESIGN_EXAMPLE.replace("weightGradDelay: auto", f"weightGradDelay: {value}"))
        assert job.schedule.weight_grad_delay == expected


@pytest.mark.parametrize(
    "written, hint",
    [
        ("on", "write 1 (one delayed W per stage) or auto"),
        ("off", "write 0 (no delay"),
        ("'on'", "write 1"),
        ("'off'", "write 0"),
        ("yes", "write 1"),
        ("no", "write 0"),
    ],
)
def test_old_weight_grad_delay_spellings_are_refused_saying_what_to_write(written, hint):
    with pytest.raises(SpecError) as info:
        parse_yaml(DESIGN_EXAMPLE.replace("weightGradDelay: auto", f"weightGradDelay: {written}"))
    [error] = info.value.errors
    assert error.path == "spec.schedule.weightGradDelay" and hint in error.allowed


def test_load_jobs_reads_one_job_per_document(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(DESIGN_EXAMPLE + "---\n" + DESIGN_EXAMPLE.replace("name: gpt-demo", "name: second"))
    assert [job.name for job in load_jobs(str(path))] == ["gpt-demo", "second"]


def test_load_jobs_names_the_document_of_each_problem(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(DESIGN_EXAMPLE + "---\n" + DESIGN_EXAMPLE.replace("heads: 8", "heads: 7"))
    with pytest.raises(SpecError) as info:
        load_jobs(str(path))
    assert [e.path for e in info.value.errors] == [f"{path} document 2: spec.model.heads"]


def test_load_job_refuses_several_documents_saying_plan_takes_them(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(DESIGN_EXAMPLE + "---\n" + DESIGN_EXAMPLE)
    with pytest.raises(SpecError, match="2 documents.*exactly one TrainingJob document.*meshjob plan"):
        load_job(str(path))


def test_dash_reads_the_manifest_from_stdin(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(DESIGN_EXAMPLE.encode())))
    assert load_job("-") == parse_job(base())


def test_a_file_that_is_not_utf8_is_a_spec_error_naming_it(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="UTF-8"):
        load_job(str(path))


def test_trainingjob_helpers_count_ranks_and_find_layer_stages():
    job: TrainingJob = parse_job(base())
    assert job.world_size == 4
    assert [job.stage_of_layer(i) for i in (0, 3, 4, 7)] == [0, 0, 1, 1]
