"""What a job reads from the machine it runs on, checked before any rank starts: its token files
(meshjob.spec.tokens), the Hugging Face config of spec.model.init (meshjob.spec.huggingface) and the
package of a custom model's entry point.

The plan layer only looks: it finds the entry point's top-level package without importing it,
because importing runs the user's code (and whatever it imports). The trainer, which runs that
code anyway, loads and calls the entry point before forking its ranks
(meshjob_trainer.custom.check_inputs), so a bad one is one clear error, not a traceback per rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence

from meshjob.errors import FieldError, SpecError
from meshjob.spec.huggingface import check_init
from meshjob.spec.model import ModelSpec, TrainingJob
from meshjob.spec.tokens import check_data_files


def check_entrypoint_package(model: ModelSpec) -> list[FieldError]:
    """The top-level package of spec.model.entrypoint is installed here (custom models only)."""
    if model.kind != "custom":
        return []
    top = model.entrypoint.split(":", 1)[0].split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        return [
            FieldError(
                "spec.model.entrypoint",
                model.entrypoint,
                f"an entry point whose package is installed: no package {top!r} on this machine "
                f"(pip install it into the trainer image: see the Dockerfile)",
            )
        ]
    return []


def check_inputs(job: TrainingJob) -> list[FieldError]:
    """Problems of the token files, the initial weights' config and the custom model's package
    (meshjob.spec.manifest.TrainingJob)."""
    return check_data_files(job) + check_init(job) + check_entrypoint_package(job.model)


def check_jobs_inputs(jobs: Sequence[TrainingJob], source: str) -> None:
    """SpecError listing the problems of every job's inputs; with several jobs (YAML documents) each
    problem names its document, as meshjob.spec.manifest.load_jobs does."""
    errors: list[FieldError] = []
    for i, job in enumerate(jobs):
        prefix = f"{source} document {i + 1}: " if len(jobs) > 1 else ""
        errors += [dataclasses.replace(e, path=prefix + e.path) for e in check_inputs(job)]
    if errors:
        raise SpecError(errors)
