"""Imports match folders: three executor distributions beside the pure plan layer, none shadowing the
standard library, each importing only what its image installs."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_operator_from_the_repository_root_is_the_standard_library_with_no_site_packages():
    out = python(
        "-S",
        "-c",
        "import operator, collections; print(operator.__file__); "
        "print(operator.itemgetter(1)([0, 42]), collections.OrderedDict.__name__)",
    )
    assert out.returncode == 0, out.stderr
    path, values = out.stdout.splitlines()
    assert Path(path).parent == Path(subprocess.__file__).parent, f"operator came from {path}"
    assert values.split() == ["42", "OrderedDict"]


def test_no_folder_of_the_repository_root_is_a_regular_package_named_like_a_stdlib_module():
    shadowing = [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name in sys.stdlib_module_names]
    assert not shadowing


@pytest.mark.parametrize(
    "module,forbidden",
    [
        ("meshjob.plan.build", ("torch", "kubernetes", "kopf", "meshjob_trainer", "meshjob_operator")),
        ("meshjob.cli", ("torch", "kubernetes", "kopf")),
        ("meshjob_operator.handlers", ("torch", "meshjob_trainer")),
    ],
)
def test_a_layer_imports_nothing_its_image_lacks(module, forbidden):
    out = python("-c", f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} imported {out.stdout.strip()}"


def test_benchmarks_import_without_path_edits_from_anywhere(tmp_path):
    out = python(
        "-c",
        "import meshjob_bench.planner, meshjob_bench.resharding, meshjob_bench.pipeline, "
        "meshjob_bench.operator; print('ok')",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert not [
        line
        for p in (ROOT / "bench" / "meshjob_bench").glob("*.py")
        for line in p.read_text().splitlines()
        if "sys.path.insert" in line
    ]


def test_a_broken_benchmark_module_fails_loudly(monkeypatch):
    import meshjob_bench.cli as bench_cli

    def broken(name: str):
        raise ImportError(f"meshjob_bench.{name} is broken")

    monkeypatch.setattr(bench_cli, "_bench_module", broken)
    import argparse

    with pytest.raises(ImportError, match="broken"):
        bench_cli.add_arguments(argparse.ArgumentParser())


def test_a_command_whose_distribution_is_missing_says_what_to_install(monkeypatch, capsys):
    from meshjob import cli

    monkeypatch.setitem(cli.COMMANDS, "worker", ("meshjob_not_installed.commands.worker", "meshjob-trainer"))
    with pytest.raises(SystemExit, match=r"needs the meshjob-trainer distribution.*pip install \./trainer"):
        cli.main(["worker", "--help"])


def test_the_top_level_help_of_every_command_is_the_commands_own_help():
    # meshjob.cli keeps a copy so that `meshjob --help` imports no command; the copy must not drift
    from meshjob import cli

    assert set(cli.HELPS) == set(cli.COMMANDS)
    for name, (module, _) in cli.COMMANDS.items():
        assert cli.HELPS[name] == importlib.import_module(module).HELP, name
