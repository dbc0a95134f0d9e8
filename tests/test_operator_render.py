"""Pure rendering of a TrainingJob's children, Node -> Host conversion, status rules (no server)."""

from __future__ import annotations

import datetime
import json
import pathlib
import re

import pytest
import yaml

from meshjob.cluster.nodes import host_pods
from meshjob.errors import SpecError
from meshjob.plan.build import build_plan
from meshjob.plan.placement import Host
from meshjob.plan.rendered import PlanInputs, RenderedDigest
from meshjob.spec.manifest import parse_job
from meshjob_operator import lifecycle, names, podsecurity, render
from meshjob_operator.reconcile import Draft, manifest, validate
from meshjob_operator.render import scale_quantity
from meshjob_operator.status import PodView, set_condition, status_placement
from meshjob_operator.testing import job_body

META = render.JobMeta(name="demo", namespace="team-a", uid="uid-123")
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)


def _rendered(hosts: int = 3, devices: int = 2, **overrides):
    body = job_body("demo", "team-a", hosts=hosts, devices_per_host=devices, **overrides)
    job = parse_job(manifest(body))
    plan = build_plan(job, [Host(f"node-{i}", devices, rack="r0") for i in range(hosts)])
    return body, job, plan, host_pods(plan.placement)


def _env(pod: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_one_pod_per_host_runs_meshjob_worker_for_its_devices():
    body, job, plan, pods = _rendered(hosts=3, devices=2)
    assert [p.index for p in pods] == [0, 1, 2]
    pod = render.pod(META, job, pods[2], pods)
    assert pod["metadata"]["name"] == "demo-host-2"
    assert pod["spec"]["containers"][0]["command"] == [
        "meshjob",
        "worker",
        "--job",
        "/etc/meshjob/job.yaml",
        "--nproc",
        "2",
        "--node-rank",
        "2",
    ]


def test_pod_env_follows_torchrun_and_kubeflow_names():
    body, job, plan, pods = _rendered(hosts=3, devices=2)
    env = _env(render.pod(META, job, pods[1], pods))
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "demo-host-0.demo.team-a.svc"
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "29500"
    assert env["WORLD_SIZE"] == str(plan.placement.world_size) == "6"
    assert env["NODE_RANK"] == env["PET_NODE_RANK"] == "1"
    assert env["PET_NNODES"] == "3" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["MESHJOB_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["MESHJOB_CHECKPOINT_DIR"] == "/ckpt"


def _plan_files(job, plan) -> dict[str, str]:
    """The ConfigMap's plan files, as the operator's planning process renders them."""
    from meshjob.plan import rendered

    return rendered.render(PlanInputs.of(job, plan.placement.hosts), plan)


def test_pod_is_pinned_to_its_host_by_required_node_affinity():
    body, job, plan, pods = _rendered(hosts=2)
    pod = render.pod(META, job, pods[1], pods)
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [pods[1].host]}]}
    ]


def test_children_carry_job_labels_and_a_controller_owner_reference():
    body, job, plan, pods = _rendered(hosts=2)
    children = [
        render.pod(META, job, pods[0], pods),
        render.service(META, job),
        render.configmap(META, body["spec"], _plan_files(job, plan)),
    ]
    for child in children:
        assert child["metadata"]["namespace"] == "team-a"
        assert child["metadata"]["labels"][names.JOB_LABEL] == "demo"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "meshjob.io/v1alpha1",
                "kind": "TrainingJob",
                "name": "demo",
                "uid": "uid-123",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert children[0]["metadata"]["labels"][names.HOST_INDEX_LABEL] == "0"


def test_pod_security_context_is_restricted():
    body, job, plan, pods = _rendered(hosts=2)
    pod = render.pod(META, job, pods[0], pods)
    container = pod["spec"]["containers"][0]["securityContext"]
    assert container["runAsNonRoot"] and container["readOnlyRootFilesystem"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert {"/tmp", "/etc/meshjob", "/ckpt"} <= mounts  # writable scratch despite the read-only root


def test_resources_scale_per_device_and_request_the_device_resource():
    body, job, plan, pods = _rendered(
        hosts=2, devices=2, resources={"requests": {"memory": "1Gi", "cpu": "500m"}, "limits": {"memory": "2Gi"}}
    )
    res = render.pod(META, job, pods[0], pods)["spec"]["containers"][0]["resources"]
    assert res["requests"]["memory"] == "2Gi" and res["limits"]["memory"] == "4Gi"
    assert res["requests"]["cpu"] == "2"  # the device resource (cpu) wins over the per-device cpu request


def test_gpu_device_resource_sets_equal_requests_and_limits():
    body, job, plan, pods = _rendered(hosts=2, devices=2)
    job = parse_job(
        manifest(
            {**body, "spec": {**body["spec"], "topology": {"devicesPerHost": 2, "deviceResource": "nvidia.com/gpu"}}}
        )
    )
    res = render.resources(job, 2)
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "2"


def test_pod_declares_rendezvous_and_one_metrics_port_per_local_rank():
    model = {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seqLen": 16}
    body, job, plan, pods = _rendered(hosts=2, devices=4, model=model)
    ports = {
        p["name"]: p["containerPort"] for p in render.pod(META, job, pods[1], pods)["spec"]["containers"][0]["ports"]
    }
    base = job.metrics.port
    assert pods[1].devices == 4
    assert ports == {
        "rendezvous": 29500,
        "metrics": base,
        "metrics-1": base + 1,
        "metrics-2": base + 2,
        "metrics-3": base + 3,
    }


def test_metrics_port_names_fit_the_15_character_limit_for_16_local_ranks():
    body, job, plan, pods = _rendered(hosts=2)
    names_ = [p["name"] for p in render.metrics_ports(job, 16)]
    assert names_[0] == "metrics" and names_[-1] == "metrics-15" and len(set(names_)) == 16
    assert all(len(n) <= 15 for n in names_)


def test_trainer_pods_carry_no_service_account_token():
    """Trainers need no API access: a trainer can change nothing in the cluster."""
    body, job, plan, pods = _rendered(hosts=2)
    spec = render.pod(META, job, pods[0], pods)["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec


def test_a_service_account_the_spec_names_is_the_pods_identity_with_its_token():
    body, job, plan, pods = _rendered(hosts=2, serviceAccountName="team-sa")
    spec = render.pod(META, job, pods[0], pods)["spec"]
    assert spec["serviceAccountName"] == "team-sa" and spec["automountServiceAccountToken"] is True


def test_headless_service_publishes_not_ready_pods_for_rendezvous():
    body, job, plan, pods = _rendered(hosts=2)
    svc = render.service(META, job)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {names.JOB_LABEL: "demo"}
    pod = render.pod(META, job, pods[0], pods)
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"] and pod["spec"]["hostname"] == "demo-host-0"


def test_configmap_holds_the_plans_inputs_and_its_digest():
    body, job, plan, pods = _rendered(hosts=3)
    cm = render.configmap(META, body["spec"], _plan_files(job, plan))
    assert parse_job(yaml.safe_load(cm["data"]["job.yaml"])) == parse_job(
        {**manifest(body), "metadata": {"name": "demo", "namespace": "team-a"}}
    )
    assert [h["name"] for h in yaml.safe_load(cm["data"]["hosts.yaml"])] == [h.name for h in plan.placement.hosts]
    rendered = json.loads(cm["data"]["plan.json"])
    assert rendered["digest"] == plan.digest() and rendered["nic_bytes_per_s"] == plan.nic_bytes_per_s
    assert "boundaries" not in rendered  # the plan itself does not travel: it would not fit at scale


def test_a_worker_rebuilds_the_very_plan_from_the_configmaps_files(tmp_path):
    from meshjob.plan import rendered

    body, job, plan, pods = _rendered(hosts=3)
    cm = render.configmap(META, body["spec"], _plan_files(job, plan))
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    inputs, expected = rendered.load(
        str(tmp_path / "job.yaml"), str(tmp_path / "hosts.yaml"), str(tmp_path / "plan.json")
    )
    assert isinstance(expected, RenderedDigest)
    expected.check(inputs.build())  # raises when the digests differ


def test_gang_scheduling_adds_a_podgroup_and_the_scheduler():
    body, job, plan, pods = _rendered(
        hosts=3, scheduling={"gang": True, "queue": "research", "topologyLevel": "topology.kubernetes.io/zone"}
    )
    pod = render.pod(META, job, pods[0], pods)
    assert pod["spec"]["schedulerName"] == render.DEFAULT_GANG_SCHEDULER
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == "topology.kubernetes.io/zone"
    assert render.podgroup(META, pods)["spec"] == {"minMember": 3}


def test_gang_scheduling_uses_the_scheduler_the_spec_names():
    body, job, plan, pods = _rendered(hosts=2, scheduling={"gang": True, "schedulerName": "volcano"})
    assert render.pod(META, job, pods[0], pods)["spec"]["schedulerName"] == "volcano"


def test_no_scheduling_fields_means_the_default_scheduler():
    body, job, plan, pods = _rendered(hosts=2)
    pod = render.pod(META, job, pods[0], pods)
    assert "schedulerName" not in pod["spec"]
    assert not any(k.startswith(("kueue", "scheduling")) for k in pod["metadata"]["labels"])


def test_bad_scheduling_fields_are_named_with_what_is_allowed():
    with pytest.raises(SpecError) as err:
        validate(job_body("demo", scheduling={"gang": "yes", "queue": 3, "priority": 1}))
    text = str(err.value)
    assert "spec.scheduling.gang: 'yes' is invalid: true or false" in text
    assert "spec.scheduling.queue: 3 is invalid: a string" in text
    assert "spec.scheduling.priority" in text


def test_the_operator_reads_scheduling_and_service_account_from_the_parsed_job():
    job = validate(job_body("demo", scheduling={"gang": True}, serviceAccountName="team-sa"))
    assert job.scheduling.gang and job.service_account_name == "team-sa"


def test_status_placement_names_the_node_of_each_mesh_row():
    body, job, plan, pods = _rendered(hosts=2)
    rows = status_placement(plan.placement.to_json(), {"node-0": "kube-node-0", "node-1": "kube-node-1"})
    assert {(r["stage"], r["node"]) for r in rows} == {(0, "kube-node-0"), (1, "kube-node-1")}
    assert sorted(r for row in rows for r in row["devices"]) == list(range(plan.placement.world_size))


@pytest.mark.parametrize(
    "value, factor, expected",
    [
        ("2Gi", 3, "6Gi"),
        ("500m", 2, "1000m"),
        ("1.5", 2, "3"),
        (4, 2, "8"),
        ("0.25", 2, "0.5"),
        ("100n", 3, "300n"),
        ("1e3", 2, "2000"),
        ("1.5Ki", 2, "3Ki"),
    ],
)
def test_quantities_scale_keeping_their_unit(value, factor, expected):
    assert scale_quantity(value, factor) == expected


def test_bad_quantity_is_named_with_the_path():
    with pytest.raises(ValueError, match=r"spec.resources.requests.memory: '2 gigs' is invalid"):
        scale_quantity("2 gigs", 2, "spec.resources.requests.memory")


def test_condition_transition_time_moves_only_when_the_status_flips():
    later = NOW + datetime.timedelta(minutes=5)
    first = set_condition([], "Running", True, "AllPodsRunning", "a", NOW)
    same = set_condition(first, "Running", True, "AllPodsRunning", "b", later)
    flipped = set_condition(same, "Running", False, "Restarting", "c", later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"] and same[0]["message"] == "b"
    assert flipped[0]["lastTransitionTime"] != first[0]["lastTransitionTime"]
    with pytest.raises(ValueError, match="one of Created"):
        set_condition([], "Exploded", True, "x", "y", NOW)


def _pod(index: int, phase: str, deleting: bool = False) -> PodView:
    return PodView(name=f"demo-host-{index}", index=index, phase=phase, deleting=deleting, owner_uid="u")


@pytest.mark.parametrize("policy, expected", [("All", [0, 1, 2]), ("Running", [1, 2]), ("None", [])])
def test_clean_pod_policy_picks_pods_to_delete(policy, expected):
    pods = [_pod(0, "Succeeded"), _pod(1, "Running"), _pod(2, "Pending"), _pod(3, "Running", deleting=True)]
    assert [p.index for p in lifecycle.cleanup_targets(pods, policy)] == expected


def test_progress_is_read_from_a_trainers_metrics_exposition():
    from meshjob_operator import progress

    text = (
        'meshjob_step{trainingjob="demo",stage="0"} 40.0\n'
        'meshjob_last_checkpoint_step{trainingjob="demo",stage="0"} 30.0\n'
        "# TYPE meshjob_step_seconds histogram\n"
        'meshjob_step_seconds_bucket{le="+Inf",trainingjob="demo",stage="0"} 40.0\n'
        'meshjob_step_seconds_count{trainingjob="demo",stage="0"} 40.0\n'
        'meshjob_step_seconds_sum{trainingjob="demo",stage="0"} 20.0\n'
    )
    reading = progress.parse(text)
    assert reading == progress.Reading(step=40, checkpoint_step=30, mean_step_s=0.5)
    assert progress.status(reading, 100, NOW) == {
        "step": 40,
        "total": 100,
        "percent": 40,
        "eta": "2026-01-01T12:00:30Z",
    }  # 60 steps x 0.5 s
    assert progress.parse("") == progress.Reading()


def test_the_trainers_own_exporter_has_what_the_operator_reads():
    """A contract test: the trainer's metrics (meshjob_trainer.metrics) as the operator parses them."""
    from prometheus_client import generate_latest

    from meshjob_operator import progress
    from meshjob_trainer.events import CheckpointWritten, StepFinished
    from meshjob_trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics("demo", 0, "host-0", 0)
    metrics.emit(StepFinished(stage=0, step=3, seconds=0.25, tokens=128, loss=2.0))
    metrics.emit(StepFinished(stage=0, step=4, seconds=0.75, tokens=128, loss=1.5))
    metrics.emit(CheckpointWritten(stage=0, step=4, seconds=0.1))
    reading = progress.parse(generate_latest(metrics.registry).decode())
    assert reading == progress.Reading(step=4, checkpoint_step=4, mean_step_s=0.5)


def test_success_needs_every_expected_pod():
    assert lifecycle.all_succeeded([_pod(0, "Succeeded"), _pod(1, "Succeeded")], 2)
    assert not lifecycle.all_succeeded([_pod(0, "Succeeded")], 2)
    assert lifecycle.missing_indices([_pod(1, "Running")], 3) == [0, 2]


def test_status_draft_patches_only_what_changed_and_deletes_cleared_fields():
    draft = Draft({"phase": "Running", "restartPending": True, "step": 3, "kopf": {"x": 1}})
    draft["phase"] = "Running"
    draft["restartPending"] = None
    draft["step"] = 4
    assert draft.changes() == {"restartPending": None, "step": 4}


@pytest.mark.parametrize(
    "status, temporary",
    [
        (409, True),
        (429, True),
        (500, True),
        (503, True),
        (504, True),
        (400, False),
        (403, False),
        (404, False),
        (422, False),
    ],
)
def test_api_errors_say_whether_they_pass_by_themselves(status, temporary):
    from meshjob_operator.kube import ApiError

    assert ApiError(status, "POST", "/api/v1/namespaces/x/pods", "boom").temporary is temporary


def test_an_api_error_keeps_the_servers_reason_and_message():
    from meshjob_operator.kube import _api_error

    text = json.dumps(
        {
            "kind": "Status",
            "status": "Failure",
            "reason": "Forbidden",
            "code": 403,
            "message": 'pods "j-host-0" is forbidden: exceeded quota: zero',
        }
    )
    err = _api_error(403, "POST", "/api/v1/namespaces/x/pods", text)
    assert (err.status, err.reason, err.message) == (
        403,
        "Forbidden",
        'pods "j-host-0" is forbidden: exceeded quota: zero',
    )
    assert _api_error(502, "GET", "/x", "<html>bad gateway</html>").reason == "HTTP502"


def test_retries_back_off_exponentially_up_to_a_cap():
    from meshjob_operator.handlers import MAX_BACKOFF_S, backoff_s

    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert backoff_s(50) == MAX_BACKOFF_S


def test_a_bad_resource_quantity_is_an_invalid_spec():
    body = job_body("demo", resources={"requests": {"memory": "2 gigs"}})
    with pytest.raises(SpecError, match=r"spec.resources.requests.memory: '2 gigs' is invalid"):
        validate(body)


def _operator_args(*argv: str):
    import argparse

    from meshjob_operator import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli, parser.parse_args(list(argv))


def test_operator_cli_defaults_watch_the_whole_cluster_with_metrics_and_webhook():
    _, args = _operator_args()
    assert args.namespace == [] and args.metrics_port == 9401 and args.webhook and args.peering is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--metrics-port", "70000"), "--metrics-port=70000 is invalid: a TCP port 1-65535 (or 0 for off)"),
        (("--webhook-port", "0"), "--webhook-port=0 is invalid: a TCP port 1-65535"),
        (("--peering", "p", "--standalone"), "--peering and --standalone exclude each other"),
        (("--webhook-cert", "c.pem"), "--webhook-cert needs its partner: give both --webhook-cert and --webhook-key"),
        (("--webhook-key", "k.pem"), "--webhook-key needs its partner"),
    ],
)
def test_operator_cli_rejects_bad_flags_naming_them(argv, message):
    cli, args = _operator_args(*argv)
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.run(args)


def test_self_signed_webhook_certificate_names_the_host_and_addresses_and_is_its_own_ca():
    from cryptography import x509

    from meshjob_operator.certs import self_signed_certificate

    cert_pem, key_pem = self_signed_certificate(["meshjob-webhook.ops.svc", "0.0.0.0", "127.0.0.1"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["meshjob-webhook.ops.svc"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]  # 0.0.0.0 left out
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.subject == cert.issuer and b"PRIVATE KEY" in key_pem


def test_self_signed_certificate_without_any_usable_name_is_refused():
    from meshjob_operator.certs import self_signed_certificate

    with pytest.raises(ValueError, match="no usable host name or address"):
        self_signed_certificate(["0.0.0.0"])


def test_webhook_without_a_certificate_that_can_be_made_is_off_with_a_warning(monkeypatch, caplog):
    import logging

    from meshjob_operator import certs

    def no_cryptography(*_args, **_kwargs):
        raise ImportError("No module named 'cryptography'")

    monkeypatch.setattr(certs, "self_signed_certificate", no_cryptography)
    logger = logging.getLogger("test-webhook")
    with caplog.at_level(logging.WARNING, logger="test-webhook"):
        server = certs.webhook_server(addr="0.0.0.0", port=9443, host=None, cert=None, key=None, ca=None, logger=logger)
    assert server is None
    assert "admission webhook off" in caplog.text and "cryptography" in caplog.text


def test_webhook_with_given_files_uses_them_and_needs_no_self_signed_certificate(monkeypatch):
    from meshjob_operator import certs

    monkeypatch.setattr(certs, "self_signed_certificate", lambda *a, **k: pytest.fail("must not self-sign"))
    server = certs.webhook_server(
        addr="0.0.0.0",
        port=9443,
        host="wh.ops.svc",
        cert="/tls/tls.crt",
        key="/tls/tls.key",
        ca="/tls/ca.crt",
        logger=None,
    )  # type: ignore[arg-type]
    assert (server.certfile, server.pkeyfile, server.cafile, server.host) == (
        "/tls/tls.crt",
        "/tls/tls.key",
        "/tls/ca.crt",
        "wh.ops.svc",
    )


def test_a_job_without_an_image_runs_the_operators_trainer_image(monkeypatch):
    from meshjob_operator.reconcile import TRAINER_IMAGE_ENV, validate

    doc = yaml.safe_load(open("examples/tiny.yaml"))
    doc["spec"].pop("image", None)
    monkeypatch.setenv(TRAINER_IMAGE_ENV, "registry.example/meshjob/trainer:9.9")
    assert validate(doc).image == "registry.example/meshjob/trainer:9.9"
    doc["spec"]["image"] = "mine:1"
    assert validate(doc).image == "mine:1"


def test_the_api_client_asks_for_credentials_on_every_request_so_rotated_tokens_are_used():
    """kubernetes' refresh hook (in-cluster tokens, exec plugins) runs whenever the header is built."""
    import kubernetes

    from meshjob_operator.kube import _auth_headers

    config = kubernetes.client.Configuration()
    tokens = iter(["first", "second"])

    def rotate(cfg):
        cfg.api_key["authorization"] = f"Bearer {next(tokens)}"

    config.refresh_api_key_hook = rotate
    assert _auth_headers(config) == {"Authorization": "Bearer first"}
    assert _auth_headers(config) == {"Authorization": "Bearer second"}


# --- spec.podTemplate and the checkpoint volume ----------------------------------------------------

TEMPLATE = {
    "metadata": {"labels": {"team": "vision", names.JOB_LABEL: "not-mine"}, "annotations": {"owner": "ana"}},
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"pool": "gpu"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gen", "operator": "In", "values": ["h100"]}]},
                        {"matchExpressions": [{"key": "gen", "operator": "In", "values": ["a100"]}]},
                    ]
                }
            },
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        },
        "priorityClassName": "training-high",
        "imagePullSecrets": [{"name": "regcred"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
        "containers": [
            {
                "name": "trainer",
                "env": [{"name": "HF_HOME", "value": "/data/hf"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                "resources": {"limits": {"memory": "8Gi"}},
            }
        ],
    },
}


def test_the_pod_template_is_merged_onto_every_trainer_pod():
    body, job, plan, pods = _rendered(hosts=2, podTemplate=TEMPLATE)
    pod = render.pod(META, job, pods[1], pods)
    spec, (trainer,) = pod["spec"], pod["spec"]["containers"]
    assert pod["metadata"]["labels"]["team"] == "vision" and pod["metadata"]["annotations"]["owner"] == "ana"
    assert pod["metadata"]["labels"][names.JOB_LABEL] == "demo"  # the operator's own keys win
    assert spec["tolerations"] == TEMPLATE["spec"]["tolerations"] and spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["priorityClassName"] == "training-high" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}} in spec["volumes"]
    assert {"name": "config", "configMap": {"name": "demo-plan"}} in spec["volumes"]
    assert trainer["env"][-1] == {"name": "HF_HOME", "value": "/data/hf"} and "MASTER_ADDR" in _env(pod)
    assert {"name": "data", "mountPath": "/data"} in trainer["volumeMounts"]
    assert trainer["resources"]["limits"]["memory"] == "8Gi" and trainer["resources"]["requests"]["cpu"] == "2"


def test_the_host_pin_is_added_to_every_required_node_affinity_term():
    body, job, plan, pods = _rendered(hosts=2, podTemplate=TEMPLATE)
    affinity = render.pod(META, job, pods[1], pods)["spec"]["affinity"]
    pin = {"key": "kubernetes.io/hostname", "operator": "In", "values": [pods[1].host]}
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][-1] for t in terms] == [pin, pin]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["h100"], ["a100"]]
    assert "podAntiAffinity" in affinity


@pytest.mark.parametrize(
    "template, path, allowed",
    [
        (
            {"spec": {"volumes": [{"name": "scratch", "hostPath": {"path": "/data"}}]}},
            "spec.podTemplate.spec.volumes[0].hostPath",
            "no hostPath",
        ),
        (
            {"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}},
            "spec.podTemplate.spec.volumes[0].name",
            "a name the operator does not use",
        ),
        (
            {
                "spec": {
                    "containers": [{"name": "trainer", "volumeMounts": [{"name": "x", "mountPath": "/etc/meshjob"}]}]
                }
            },
            "spec.podTemplate.spec.containers[trainer].volumeMounts",
            "a mount path the operator does not use",
        ),
        (
            {"spec": {"containers": [{"name": "trainer", "env": [{"name": "MASTER_ADDR", "value": "evil"}]}]}},
            "spec.podTemplate.spec.containers[trainer].env",
            "a variable the operator does not set",
        ),
        (
            {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "1"}}}]}},
            "spec.podTemplate.spec.containers[trainer].resources.requests",
            "spec.topology.deviceResource",
        ),
        ({"metadata": {"labels": {"replicas": 3}}}, "spec.podTemplate.metadata.labels.replicas", "a string"),
    ],
)
def test_a_template_the_merge_cannot_take_is_an_invalid_spec_naming_the_field(template, path, allowed):
    with pytest.raises(SpecError) as err:
        validate(job_body("demo", podTemplate=template))
    assert path in str(err.value) and allowed in str(err.value)


def test_only_the_trainer_container_can_be_templated():
    with pytest.raises(
        SpecError, match=r"spec.podTemplate.spec.containers\[0\].name: 'sidecar' is invalid: one of trainer"
    ):
        validate(job_body("demo", podTemplate={"spec": {"containers": [{"name": "sidecar"}]}}))


@pytest.mark.parametrize(
    "volume, allowed",
    [
        ({"hostPath": {"path": "/ckpt"}}, "no hostPath"),
        ({"emptyDir": {}, "nfs": {"server": "x", "path": "/ckpt"}}, "exactly one volume source"),
    ],
)
def test_a_checkpoint_volume_is_one_source_and_never_a_host_path(volume, allowed):
    body = job_body("demo")
    body["spec"]["training"]["checkpoint"]["volume"] = volume
    with pytest.raises(SpecError, match=allowed):
        validate(body)


def test_checkpoints_go_to_the_volume_the_spec_names_else_an_empty_dir_never_a_host_path():
    body, job, plan, pods = _rendered(hosts=2)
    volumes = {v["name"]: v for v in render.pod(META, job, pods[0], pods)["spec"]["volumes"]}
    assert volumes["checkpoint"] == {"name": "checkpoint", "emptyDir": {}}
    body["spec"]["training"]["checkpoint"]["volume"] = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    job = validate(body)
    pod = render.pod(META, job, pods[0], pods)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoint"] == {"name": "checkpoint", "persistentVolumeClaim": {"claimName": "ckpt"}}
    assert {"name": "checkpoint", "mountPath": "/ckpt"} in pod["spec"]["containers"][0]["volumeMounts"]
    assert pod["spec"]["securityContext"]["fsGroup"] == render.RUN_AS_USER  # the non-root trainer may write


@pytest.mark.parametrize(
    "example", sorted(p.name for p in (pathlib.Path(__file__).parents[1] / "examples").glob("*.yaml"))
)
def test_every_example_renders_pods_that_pass_pod_security_restricted(example):
    doc = yaml.safe_load((pathlib.Path(__file__).parents[1] / "examples" / example).read_text())
    job = validate(doc)
    plan = build_plan(job)
    pods = host_pods(plan.placement)
    for host_pod in pods:
        assert podsecurity.violations(render.pod(render.JobMeta.of(doc), job, host_pod, pods)) == []


def test_the_restricted_checks_catch_what_the_profile_forbids():
    """The checker fails a pod that breaks the profile: a host path, root, a privileged container, and each
    baseline-only or restricted-only control at the level that has it."""
    body, job, plan, pods = _rendered(hosts=2)
    pod = render.pod(META, job, pods[0], pods)
    pod["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    pod["spec"]["securityContext"]["runAsUser"] = 0
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    found = {v.path for v in podsecurity.violations(pod)}
    assert {
        "spec.volumes[h].hostPath",
        "spec.securityContext.runAsUser",
        "spec.containers[trainer].securityContext.privileged",
    } <= found
    assert "spec.securityContext.runAsUser" not in {v.path for v in podsecurity.violations(pod, podsecurity.BASELINE)}
    assert "spec.volumes[h].hostPath" in {v.path for v in podsecurity.violations(pod, podsecurity.BASELINE)}
    assert podsecurity.violations(pod, podsecurity.PRIVILEGED) == []


# The issue's pod: a template that Pod Security "restricted" refuses five ways (meshjob's two refusals included).
INSECURE_TEMPLATE = {
    "metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}},
    "spec": {
        "volumes": [
            {"name": "share", "nfs": {"server": "nas", "path": "/"}},
            {"name": "code", "gitRepo": {"repository": "https://example.com/x.git"}},
        ],
        "priorityClassName": "system-node-critical",
        "tolerations": [{"operator": "Exists"}],
    },
}
INSECURE_FIELDS = {
    "spec.podTemplate.metadata.annotations[container.apparmor.security.beta.kubernetes.io/trainer]": "baseline",
    "spec.podTemplate.spec.volumes[0].nfs": "restricted",
    "spec.podTemplate.spec.volumes[1].gitRepo": "restricted",
    "spec.podTemplate.spec.priorityClassName": "baseline",
    "spec.podTemplate.spec.tolerations[0]": "baseline",
}


@pytest.mark.parametrize("level", ["restricted", "baseline", "privileged"])
def test_a_template_that_breaks_the_namespaces_pod_security_level_is_an_invalid_spec_naming_each_field(level):
    """Restricted (the default) refuses all five, naming the field, what is allowed and the namespace label that
    would allow it; baseline lets the volumes through; privileged everything."""
    refused = {f for f, lowest in INSECURE_FIELDS.items() if level == "restricted" or lowest == level == "baseline"}
    body = job_body("demo", "ml", podTemplate=INSECURE_TEMPLATE)
    if not refused:
        assert validate(body, level).pod_template.spec.priority_class_name == "system-node-critical"
        return
    with pytest.raises(SpecError) as err:
        validate(body, level)
    assert {e.path for e in err.value.errors} == refused
    text = str(err.value)
    assert f"namespace ml enforces Pod Security {level!r}" in text
    assert "runtime/default or localhost/<profile>" in text and "a toleration naming the taint's key" in text
    assert "meshjob.io/pod-security=privileged" in text
    if level == "restricted":
        assert "persistentVolumeClaim" in text and "meshjob.io/pod-security=baseline to allow this" in text


def test_a_checkpoint_volume_of_a_type_restricted_refuses_is_named_as_the_checkpoint_volume():
    body = job_body("demo")
    body["spec"]["training"]["checkpoint"]["volume"] = {"nfs": {"server": "nas", "path": "/ckpt"}}
    with pytest.raises(SpecError) as err:
        validate(body)
    assert [e.path for e in err.value.errors] == ["spec.training.checkpoint.volume.nfs"]
    assert validate(body, podsecurity.BASELINE).training.checkpoint.volume == {
        "nfs": {"server": "nas", "path": "/ckpt"}
    }


@pytest.mark.parametrize(
    "labels, level",
    [
        ({}, "restricted"),
        ({"pod-security.kubernetes.io/enforce": "baseline"}, "baseline"),
        ({"pod-security.kubernetes.io/enforce": "privileged"}, "privileged"),
        ({"pod-security.kubernetes.io/enforce": "privileged", "meshjob.io/pod-security": "restricted"}, "restricted"),
        ({"meshjob.io/pod-security": "baseline"}, "baseline"),
        ({"meshjob.io/pod-security": "none", "pod-security.kubernetes.io/enforce": "sure"}, "restricted"),
    ],
)
def test_a_namespaces_level_is_its_meshjob_label_else_kubernetes_enforce_label_else_restricted(labels, level):
    assert podsecurity.namespace_level(labels) == level
