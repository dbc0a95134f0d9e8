"""`meshjob` command line: a thin dispatcher over one module per subcommand.

Each module in meshjob.commands exports HELP (one line), add_arguments(parser) and
run(args) -> int. Modules are imported only when their subcommand runs, so `meshjob plan`
never imports torch or kubernetes. Bad input exits 2 with a message that names the field.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from meshjob.errors import PlacementError, SpecError, UsageError

# subcommand -> (module, the distribution that ships it). The plan layer's own commands live in
# meshjob.commands; the others come with the executor they run, installed separately.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("meshjob.commands.plan", "meshjob"),
    "crd": ("meshjob.commands.crd", "meshjob"),
    "simulate": ("meshjob.commands.simulate", "meshjob"),
    "tune": ("meshjob.commands.tune", "meshjob"),
    "data": ("meshjob.commands.data", "meshjob"),
    "run": ("meshjob_trainer.commands.run", "meshjob-trainer"),
    "worker": ("meshjob_trainer.commands.worker", "meshjob-trainer"),
    "export": ("meshjob_trainer.commands.export", "meshjob-trainer"),
    "bench": ("meshjob_bench.cli", "meshjob-bench"),
    "operator": ("meshjob_operator.cli", "meshjob-operator"),
    "cluster": ("meshjob_cluster.cli", "meshjob-cluster"),
}
HELPS: dict[str, str] = {
    "plan": "show the plan for a TrainingJob: placement, resharding tasks, schedules",
    "crd": "print the TrainingJob CustomResourceDefinition generated from the spec model",
    "run": "run a TrainingJob on this machine on an emulated cluster",
    "bench": "benchmarks: resharding strategies (and their re-simulation and comparison), pipeline schedules, "
    "planner, operator, input fuzzing, memory, end to end, tune",
    "simulate": "predict step time, bubbles and resharding time of a plan at any scale",
    "tune": "choose stages, meshes, parallel degrees, microbatches, schedule and resharding for a cluster",
    "data": "prepare token files: meshjob data prepare TEXT --out train.bin [--val-out val.bin]",
    "worker": "one trainer process per device (what a trainer pod runs)",
    "export": "export a checkpoint: meshjob export huggingface job.yaml --checkpoint DIR --out DIR",
    "operator": "the Kubernetes operator (kopf)",
    "cluster": "a local Kubernetes cluster where meshjob's pods run: up, down, status",
}


def command_module(name: str) -> ModuleType:
    """The module of subcommand `name`; a missing distribution is a usage error that says what to install."""
    module, distribution = COMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or module.split(".")[0] != err.name.split(".")[0]:
            raise  # a dependency of an installed command is missing: its own traceback says which
        raise SystemExit(
            f"meshjob {name}: needs the {distribution} distribution, which is not installed "
            f"(from a checkout: pip install ./{distribution.removeprefix('meshjob-')})"
        ) from err


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshjob", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in HELPS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            command_module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = command_module(args.command)
    try:
        return int(module.run(args) or 0)
    except (SpecError, PlacementError, UsageError) as err:
        print(f"meshjob {args.command}: invalid input:\n{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`meshjob plan x --json | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
