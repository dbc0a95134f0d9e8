"""The README's commands, as written. Its quick start is the two commands the project promises (set up and run the
main job; run the tests), each naming files that exist. Its "On Kubernetes" commands run on a real kube-apiserver
with ServiceAccount admission on (as on every real cluster): the chart as `helm install` renders it (its CRD, the
operator's account and RBAC, the operator run with the chart's command line as that account), then each `kubectl`
line of the README in a fresh namespace. No kubelet runs: the test plays it, and the job's pods reach Running."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from prometheus_harness import Envtest, chart_operator, envtest_dir, node, wait_until

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def readme_commands(heading: str = "## On Kubernetes") -> list[list[str]]:
    """The shell commands of the first bash block under a README heading (continued lines joined, comments
    dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```bash") + len("```bash")
    commands, pending = [], ""
    for line in section[start : section.index("```", start)].splitlines():
        line = "" if line.lstrip().startswith("#") else line.split(" #")[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
        elif pending or line.strip():
            commands.append(shlex.split(pending + line))
            pending = ""
    return commands


def helm_values(argv: list[str]) -> dict[str, Any]:
    """--set a.b=true,c=x of a helm command line as nested values."""
    values: dict[str, Any] = {}
    for i, arg in enumerate(argv):
        if arg == "--set":
            for pair in argv[i + 1].split(","):
                path, value = pair.split("=", 1)
                *parents, leaf = path.split(".")
                target = values
                for key in parents:
                    target = target.setdefault(key, {})
                target[leaf] = {"true": True, "false": False}.get(value, value)
    return values


def test_the_quick_start_is_set_up_and_run_the_main_job_then_run_the_tests():
    commands = readme_commands("## Quick start")
    assert commands == [
        ["bash", "tests/setup.sh", "&&", "meshjob", "run", "examples/gpt-demo.yaml"],
        ["bash", "tests/run.sh"],
    ]
    for path in ("tests/setup.sh", "tests/run.sh", "examples/gpt-demo.yaml"):
        assert (ROOT / path).is_file(), path


def test_the_readme_lists_helm_install_then_the_kubectl_commands():
    commands = readme_commands()
    tools = [c[0] for c in commands]
    assert tools.count("helm") == 1 and tools.index("helm") < tools.index("kubectl")
    assert any(c[:2] == ["kubectl", "apply"] and "examples/gpt-demo.yaml" in c for c in commands)


def test_the_readmes_own_commands_give_running_pods_in_a_fresh_namespace(tmp_path):
    assets = envtest_dir()
    if assets is None:
        pytest.skip("needs a real kube-apiserver: set KUBEBUILDER_ASSETS (tests/run.sh does)")
    commands = readme_commands()
    (helm,) = [c for c in commands if c[0] == "helm"]
    assert helm[:4] == ["helm", "install", "meshjob", "charts/meshjob"] and "meshjob-system" in helm
    kubectl = [c for c in commands if c[0] == "kubectl"]
    with Envtest(assets, tmp_path) as envtest, chart_operator(envtest, tmp_path, helm_values(helm)) as operator:
        hosts = [f"host-{i}" for i in range(4)]  # gpt-demo: 4 hosts of devicesPerHost 2
        envtest.apply([node(name, 2) for name in hosts])
        for name in hosts:  # a node's status is its own subresource; a Ready node loses the not-ready taint
            envtest.kubectl(
                "patch",
                "node",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": node(name, 2)["status"]}),
            )
            envtest.kubectl("patch", "node", name, "--type=merge", "-p", json.dumps({"spec": {"taints": None}}))
        namespace = ""
        for command in kubectl:
            args = [a for a in command[1:] if a != "-w"]  # the README watches; the test looks once, later
            if args[:2] == ["create", "namespace"]:
                namespace = args[2]
                envtest.kubectl(*args, cwd=ROOT)
                envtest.wait_for_default_service_account(namespace)  # as a user finds a namespace
            elif args[0] == "apply":
                envtest.kubectl(*args, cwd=ROOT)
        assert namespace, "the README creates the namespace its job runs in"

        def pods() -> list[dict[str, Any]]:
            operator.check()
            out = envtest.kubectl("get", "pods", "-n", namespace, "-l", "meshjob.io/job-name=gpt-demo", "-o", "json")
            return json.loads(out.stdout)["items"]

        created = wait_until(lambda: len(pods()) == 4 and pods(), 60, "the job's 4 host pods")
        for pod in created:  # play the kubelet
            envtest.kubectl(
                "patch",
                "pod",
                "-n",
                namespace,
                pod["metadata"]["name"],
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": {"phase": "Running"}}),
            )

        def phase() -> str:
            out = envtest.kubectl("get", "tj", "-n", namespace, "gpt-demo", "-o", "jsonpath={.status.phase}")
            return out.stdout

        wait_until(lambda: phase() == "Running", 60, "phase Running")
        table = envtest.kubectl(*[a for a in kubectl[-1][1:] if a != "-w"]).stdout.split("\n")[0].split()
        assert table == ["NAME", "PHASE", "STEP", "PROGRESS", "LOSS", "HOSTS", "RESTARTS", "AGE"]
        assert all(p["spec"]["automountServiceAccountToken"] is False for p in created)
        volumes = {v["name"]: v for v in created[0]["spec"]["volumes"]}
        assert volumes["checkpoint"]["persistentVolumeClaim"]["claimName"] == "gpt-demo-checkpoints"
