"""The model family of a job: one pipeline stage of a gpt, utransformer, llama or custom model
(every one a model.PipelineStage), and the checks of what a job reads from this machine."""

from __future__ import annotations

from meshjob.errors import SpecError
from meshjob.spec.huggingface import check_init
from meshjob.spec.manifest import ModelSpec, TrainingJob
from meshjob.spec.tokens import check_data_files
from meshjob_trainer.custom import CustomStage, check_custom
from meshjob_trainer.huggingface import load_pretrained
from meshjob_trainer.llama import LlamaStage
from meshjob_trainer.model import PipelineStage, StageModule
from meshjob_trainer.numerics import Numerics
from meshjob_trainer.parallel import TPGroup


def build_stage(
    model: ModelSpec, first: int, last: int, seed: int, tp: TPGroup = TPGroup(), numerics: Numerics = Numerics()
) -> PipelineStage:
    """Layers [first, last) of the model (the whole model when first=0, last=layers), its weights from the
    seed or, with spec.model.init, from those files."""
    if model.kind == "llama":
        stage = LlamaStage(model, first, last, seed, tp, numerics)
        if model.init is not None:
            load_pretrained(stage, model.init.path)
        return stage
    if model.kind == "custom":
        if tp.size > 1:
            raise ValueError(
                f"a custom model runs without tensor parallelism; got a tensor-parallel group of {tp.size}"
            )
        return CustomStage(model, first, last, seed, numerics)
    return StageModule(model, first, last, seed, tp, numerics)


def check_inputs(job: TrainingJob) -> None:
    """SpecError naming the field when a token file is bad, spec.model.init's config disagrees with
    spec.model, or the custom model does not load, build and run on one sequence: what `meshjob run`
    and `meshjob worker` check before any rank starts."""
    problems = check_data_files(job) + check_init(job)
    if problems:
        raise SpecError(problems)
    if job.model.kind == "custom":
        check_custom(job.model, job.training.seed)
