"""`meshjob` command line: a thin dispatcher over one module per subcommand.

Each module in meshjob.commands exports HELP (one line), add_arguments(parser) and
run(args) -> int. Modules are imported only when their subcommand runs, so `meshjob plan`
never imports torch or kubernetes. Bad input exits 2 with a message that names the field.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from meshjob.errors import PlacementError, SpecError, UsageError

# subcommand -> module in meshjob.commands (the module may live in an executor package)
COMMANDS: dict[str, str] = {
    "plan": "meshjob.commands.plan",
    "crd": "meshjob.commands.crd",
    "run": "meshjob.commands.run",
    "bench": "meshjob.commands.bench",
    "simulate": "meshjob.commands.simulate",
    "worker": "meshjob.trainer.cli",
    "operator": "meshjob.operator.cli",
}
HELPS: dict[str, str] = {
    "plan": "show the plan for a TrainingJob: placement, resharding tasks, schedules",
    "crd": "print the TrainingJob CustomResourceDefinition generated from the spec model",
    "run": "run a TrainingJob on this machine on an emulated cluster",
    "bench": "benchmarks: resharding strategies, pipeline schedules, planner",
    "simulate": "predict step time, bubbles and resharding time of a plan at any scale",
    "worker": "one trainer process per device (what a trainer pod runs)",
    "operator": "the Kubernetes operator (kopf)",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshjob", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in HELPS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            importlib.import_module(COMMANDS[name]).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except (SpecError, PlacementError, UsageError) as err:
        print(f"meshjob {args.command}: invalid input:\n{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
