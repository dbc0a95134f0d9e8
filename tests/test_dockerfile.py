"""The Dockerfile, without a docker engine: it parses, its targets exist, it pins what it installs,
runs as non-root, and every command it (and the chart) runs is one of the project's entry points."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = {
    "FROM",
    "RUN",
    "COPY",
    "ADD",
    "ENV",
    "ARG",
    "WORKDIR",
    "USER",
    "EXPOSE",
    "ENTRYPOINT",
    "CMD",
    "LABEL",
    "HEALTHCHECK",
    "SHELL",
    "VOLUME",
    "STOPSIGNAL",
    "ONBUILD",
}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARGs and stages by name; raises ValueError on an unknown instruction."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword not in INSTRUCTIONS:
            raise ValueError(f"unknown Dockerfile instruction {keyword!r} in: {line}")
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.IGNORECASE)
            if not match:
                raise ValueError(f"every stage must be named (FROM image AS name): {line}")
            current = stages[match[2]] = Stage(name=match[2], base=match[1])
        elif current is None:
            if keyword != "ARG":
                raise ValueError(f"only ARG may precede the first FROM: {line}")
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            current.instructions.append((keyword, args.strip()))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, final first."""
    result = [stages[name]]
    while result[-1].base in stages:
        result.append(stages[result[-1].base])
    return result


def exec_form(args: str) -> list[str]:
    import json

    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {args}"
    return value


def command_words(command: str) -> list[str]:
    """A shell command of a RUN line as words, without RUN's own leading options (--mount=...)."""
    words = shlex.split(command)
    while words and words[0].startswith("--mount="):
        words.pop(0)
    return words


def pip_requirements(run: str) -> list[str]:
    """Requirement specifiers of every `pip install` in a RUN line (options and paths dropped)."""
    found: list[str] = []
    for command in re.split(r"&&|;", run):
        words = command_words(command)
        if words[:2] != ["pip", "install"]:
            continue
        skip_next = False
        for word in words[2:]:
            if skip_next:
                skip_next = False
            elif word in ("--index-url", "--find-links", "-c", "--constraint", "-i"):
                skip_next = True
            elif not word.startswith("-"):
                found.append(word)
    return found


def test_dockerfile_has_operator_trainer_and_trainer_cuda_targets(dockerfile):
    _, stages = dockerfile
    assert {"operator", "trainer", "trainer-cuda"} <= set(stages)


def test_base_image_is_pinned_to_a_patch_release(dockerfile):
    global_args, stages = dockerfile
    bases = {s.base for s in stages.values() if s.base not in stages}
    for base in bases:
        image = global_args.get(base.strip("${}"), base) if base.startswith("$") else base
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?", image), (
            f"base image {image!r} must name an exact version"
        )


def test_every_pip_install_pins_exact_versions(dockerfile):
    _, stages = dockerfile
    requirements = [r for s in stages.values() for run in s.all("RUN") for r in pip_requirements(run)]
    assert requirements, "the Dockerfile installs nothing with pip"
    for requirement in requirements:
        assert "==" in requirement, f"{requirement!r} in the Dockerfile is not pinned with =="


def test_pinned_meshjob_version_is_the_project_version(dockerfile):
    _, stages = dockerfile
    version = project()["version"]
    assert all(project(d)["version"] == version for d in ("operator", "trainer", "bench"))
    pins = [
        r for s in stages.values() for run in s.all("RUN") for r in pip_requirements(run) if r.startswith("meshjob")
    ]
    assert pins and all(r.endswith(f"=={version}") for r in pins), pins


def test_meshjobs_own_distributions_come_only_from_the_built_wheels(dockerfile):
    """No name of ours is ever looked up on a public index (a dependency-confusion hazard)."""
    _, stages = dockerfile
    ours = 0
    for stage in stages.values():
        for run in stage.all("RUN"):
            for command in re.split(r"&&|;", run):
                words = command_words(command)
                if words[:2] == ["pip", "install"] and any(w.startswith("meshjob") for w in words):
                    ours += 1
                    assert "--no-index" in words and "/tmp/wheels" in words, command
                    assert ("build", "/wheels", "/tmp/wheels") in copied_from(stage), stage
    assert ours == 3  # operator, trainer, trainer-cuda


def copied_from(stage) -> set[tuple[str, str, str]]:
    """(stage, source, destination) of each `COPY --from=STAGE SOURCE DESTINATION` of `stage`."""
    found = set()
    for copy in stage.all("COPY"):
        words = shlex.split(copy)
        stages = [w.split("=", 1)[1] for w in words if w.startswith("--from=")]
        paths = [w for w in words if not w.startswith("--")]
        if stages and len(paths) == 2:
            found.add((stages[0], paths[0], paths[1]))
    return found


def test_the_build_stage_makes_a_wheel_of_every_distribution_the_images_install(dockerfile):
    _, stages = dockerfile
    (command,) = [c for run in stages["build"].all("RUN") for c in re.split(r"&&|;", run) if "pip wheel" in c]
    assert {".", "./operator", "./trainer"} <= set(shlex.split(command))


def project(folder: str = "") -> dict:
    """The [project] table of a distribution's pyproject.toml ("" is the root: meshjob)."""
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]


def dependency_names(folder: str) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in project(folder)["dependencies"]}


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_each_image_installs_its_own_distribution(dockerfile, target):
    _, stages = dockerfile
    installed = {r.split("==")[0] for run in stages[target].all("RUN") for r in pip_requirements(run)}
    assert {"meshjob", project(target)["name"]} <= installed
    others = {"operator", "trainer"} - {target}
    assert not {project(o)["name"] for o in others} & installed, f"target {target} installs another executor"


def _pinned(stages, target: str) -> dict[str, str]:
    """Distribution name -> pinned version, for what the target's pip installs name."""
    pins = {}
    for run in stages[target].all("RUN"):
        for requirement in pip_requirements(run):
            name, _, version = requirement.strip('"').partition("==")
            pins[re.sub(r"\[.*\]", "", name).lower()] = version
    return pins


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_image_pins_every_dependency_of_its_distribution(dockerfile, target):
    """An unpinned dependency would float; a missing one (cryptography) turns a feature off."""
    _, stages = dockerfile
    wanted = dependency_names(target) | dependency_names("")
    assert wanted <= set(_pinned(stages, target)), wanted - set(_pinned(stages, target))


def test_operator_distribution_declares_what_it_imports():
    assert {"cryptography", "aiohttp", "kopf"} <= dependency_names("operator")


def test_the_trainer_image_has_no_kubernetes_client_and_the_trainer_imports_none(dockerfile):
    """Trainers need no API access: neither the image nor the trainer package brings a client."""
    _, stages = dockerfile
    assert "kubernetes" not in _pinned(stages, "trainer")
    sources = (ROOT / "trainer" / "meshjob_trainer").rglob("*.py")
    assert not [p for p in sources if re.search(r"^\s*(from|import) kubernetes\b", p.read_text(), re.M)]


def test_operator_image_installs_no_torch(dockerfile):
    _, stages = dockerfile
    for stage in chain(stages, "operator"):
        for run in stage.all("RUN"):
            assert "torch" not in run, f"stage {stage.name} of the operator image installs torch"
    assert "torch" not in dependency_names("operator") | dependency_names("")


def test_trainer_image_installs_torch_2_13_0_cpu(dockerfile):
    _, stages = dockerfile
    runs = " ".join(run for s in chain(stages, "trainer") for run in s.all("RUN"))
    assert "torch==2.13.0" in runs and "--index-url" in runs
    assert any("whl/cpu" in a for a in stages["trainer"].all("ARG")), "torch must come from the CPU wheel index"


def test_trainer_cuda_image_installs_torch_2_13_0_from_a_cuda_wheel_index(dockerfile):
    _, stages = dockerfile
    runs = " ".join(run for s in chain(stages, "trainer-cuda") for run in s.all("RUN"))
    assert "torch==2.13.0" in runs and "--index-url" in runs
    assert any(re.search(r"whl/cu\d{3}$", a) for a in stages["trainer-cuda"].all("ARG")), (
        "torch must come from a CUDA wheel index (whl/cuNNN)"
    )


def test_trainer_cuda_image_pins_what_the_cpu_trainer_image_pins(dockerfile):
    """The same worker, only another torch build: the same distributions at the same versions."""
    _, stages = dockerfile
    assert _pinned(stages, "trainer-cuda") == _pinned(stages, "trainer")


@pytest.mark.parametrize("target", ["operator", "trainer", "trainer-cuda"])
def test_target_runs_as_numeric_non_root_user(dockerfile, target):
    _, stages = dockerfile
    users = [u for s in reversed(chain(stages, target)) for u in s.all("USER")]
    assert users, f"target {target} sets no USER"
    uid = users[-1].split(":")[0]
    # Kubernetes' runAsNonRoot can only verify a numeric UID.
    assert uid.isdigit() and int(uid) != 0, f"target {target} runs as {users[-1]!r}"


def test_the_trainer_pods_the_operator_renders_run_as_the_trainer_images_user(dockerfile):
    """The image's files and the pod's volumes (fsGroup) belong to one user: the one the image declares."""
    from meshjob_operator.render import RUN_AS_USER

    _, stages = dockerfile
    for target in ("trainer", "trainer-cuda"):
        users = [u for s in reversed(chain(stages, target)) for u in s.all("USER")]
        assert users[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}", target


@pytest.mark.parametrize(
    "target,subcommand", [("operator", "operator"), ("trainer", "worker"), ("trainer-cuda", "worker")]
)
def test_entrypoint_is_the_projects_real_command(dockerfile, target, subcommand):
    _, stages = dockerfile
    command = exec_form(stages[target].all("ENTRYPOINT")[-1]) + exec_form(stages[target].all("CMD")[-1])
    assert command == ["meshjob", subcommand]
    scripts = project()["scripts"]
    assert scripts["meshjob"] == "meshjob.cli:main"
    result = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", *command[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"`meshjob {subcommand} --help` failed:\n{result.stderr[-2000:]}"


def _context_files() -> list[str]:
    """Files of the repository that .dockerignore lets into the build context."""
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    kept = []
    for path in tracked:
        included = True
        for pattern in patterns:  # last match wins, as in Docker
            negate = pattern.startswith("!")
            pat = pattern[1:] if negate else pattern
            pat = pat.rstrip("/")
            if (
                fnmatch.fnmatch(path, pat)
                or fnmatch.fnmatch(path, pat + "/*")
                or fnmatch.fnmatch(path, pat.replace("**/", "*/"))
                or (pat.startswith("**/") and fnmatch.fnmatch(Path(path).name, pat[3:]))
            ):
                included = negate
        if included:
            kept.append(path)
    return kept


def test_dockerignore_keeps_tests_charts_and_git_out_of_the_context():
    kept = _context_files()
    assert kept, ".dockerignore excludes everything"
    for path in kept:
        assert not path.startswith(("tests/", "charts/", "bench/", ".git")), path
        assert not path.startswith("examples/") or path.startswith("examples/data/") and path.endswith(".bin"), path
        assert "__pycache__" not in path


def test_trainer_image_holds_the_readme_jobs_token_files_where_its_relative_paths_point(dockerfile):
    """examples/gpt-demo.yaml reads examples/data/*.bin relative to the working directory, /app in the image."""
    from meshjob.spec.manifest import load_job

    _, stages = dockerfile
    copied = [
        source
        for args in stages["trainer"].all("COPY")
        if not args.startswith("--from")
        for source in shlex.split(args)[:-1]
    ]
    data = load_job(str(ROOT / "examples" / "gpt-demo.yaml")).data
    assert {data.path, data.val_path} <= set(copied)
    assert any(args.startswith("/app") for args in stages["base"].all("WORKDIR"))


def test_every_copy_source_is_in_the_build_context(dockerfile):
    _, stages = dockerfile
    kept = _context_files()
    for stage in stages.values():
        for args in stage.all("COPY"):
            if args.startswith("--from"):
                continue
            for source in shlex.split(args)[:-1]:
                assert any(k == source or k.startswith(source.rstrip("/") + "/") for k in kept), (
                    f"COPY {source} in stage {stage.name}: not in the build context (.dockerignore)"
                )


@pytest.mark.slow
def test_wheels_built_from_the_context_hold_each_distributions_package(tmp_path):
    """What the build stage does: three wheels from only the files the context holds."""
    context = tmp_path / "context"
    for path in _context_files():
        target = context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / path).read_bytes())
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--wheel-dir",
            str(wheels),
            str(context),
            str(context / "operator"),
            str(context / "trainer"),
        ],
        check=True,
        timeout=180,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    expected = {
        "meshjob-": ("meshjob/cli.py", "meshjob/plan/build.py"),
        "meshjob_operator-": ("meshjob_operator/handlers.py",),
        "meshjob_trainer-": ("meshjob_trainer/metrics.py", "meshjob_trainer/commands/worker.py"),
    }
    for prefix, modules in expected.items():
        (wheel,) = wheels.glob(f"{prefix}[0-9]*.whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        for module in modules:
            assert module in names, f"{module} missing from {wheel.name}"
        assert not any(n.startswith("operator/") or n == "operator.py" for n in names), "shadows the stdlib"
    (core,) = wheels.glob("meshjob-[0-9]*.whl")
    names = zipfile.ZipFile(core).namelist()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "meshjob = meshjob.cli:main" in zipfile.ZipFile(core).read(entry_points).decode()
