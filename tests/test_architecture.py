"""The architecture holds: the import contracts, no import cycle in any package, the module map in
docs/architecture.md is the code's, and the static gate (ruff, import-linter, mypy) fails on a violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from module_map import DOC, with_map

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("meshjob", "meshjob_operator", "meshjob_trainer", "meshjob_bench", "meshjob_cluster")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work += [(node, j + 1), (nxt, 0)]
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def test_no_package_imports_in_a_cycle() -> None:
    assert _cycles(grimp.build_graph(*PACKAGES)) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "loopy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loopy import b\n")
    (pkg / "b.py").write_text("from loopy import c\n")
    (pkg / "c.py").write_text("from loopy import a\n")
    (pkg / "d.py").write_text("from loopy import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("loopy")) == [["loopy.a", "loopy.b", "loopy.c"]]


def test_the_import_contracts_hold() -> None:
    done = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_module_map_in_the_docs_is_the_codes() -> None:
    assert DOC.read_text() == with_map(DOC.read_text()), "stale: run python tests/module_map.py --write"


@pytest.fixture(scope="module")
def violated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the plan layer with one violation of each kind: an executor import in the network layer,
    an upward import, an untyped function, a line too long and an unused import."""
    tree = tmp_path_factory.mktemp("violated")
    shutil.copytree(ROOT / "meshjob", tree / "meshjob", ignore=shutil.ignore_patterns("__pycache__"))
    model = tree / "meshjob" / "network" / "model.py"
    model.write_text(model.read_text() + "\n\nimport torch  # noqa: E402\n")
    mesh = tree / "meshjob" / "layout" / "mesh.py"
    mesh.write_text(
        mesh.read_text() + "\n\nfrom meshjob.plan import build  # noqa: E402\n\n\ndef untyped(x):\n"
        f"    return [x, build]  # {'x' * 120}\n"
    )
    return tree


def test_import_linter_refuses_an_executor_import_and_an_upward_import(violated: Path) -> None:
    paths = [violated] + [ROOT / d for d in ("operator", "trainer", "bench", "cluster")]
    env = {**os.environ, "PYTHONPATH": ":".join(str(p) for p in paths)}
    done = subprocess.run(
        ["lint-imports", "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=violated,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode != 0
    assert "The plan layer is pure: no executor, no torch, no Kubernetes client BROKEN" in done.stdout
    assert "meshjob.network.model -> torch" in done.stdout
    assert "layered (a layer imports only those below it) BROKEN" in done.stdout
    assert "meshjob.layout.mesh -> meshjob.plan.build" in done.stdout


def test_ruff_refuses_a_long_line(violated: Path) -> None:
    done = subprocess.run(
        [
            "ruff",
            "check",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--output-format",
            "concise",
            "meshjob/layout/mesh.py",
        ],
        cwd=violated,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "E501" in done.stdout


def test_mypy_refuses_an_untyped_function_in_the_plan_layer(violated: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--no-incremental",
            "meshjob/layout/mesh.py",
        ],
        cwd=violated,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "Function is missing a type annotation" in done.stdout
