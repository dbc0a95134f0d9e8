"""`meshjob export huggingface job.yaml --checkpoint DIR --out DIR`: a llama job's newest checkpoint as a
Hugging Face directory (config.json, model.safetensors) that LlamaForCausalLM.from_pretrained loads."""

from __future__ import annotations

import argparse

from meshjob.errors import FieldError, SpecError
from meshjob.spec.manifest import load_job
from meshjob.spec.model import INIT_MODEL_KINDS

HELP = "export a checkpoint: meshjob export huggingface job.yaml --checkpoint DIR --out DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    p = sub.add_parser(
        "huggingface",
        help="write a llama job's checkpoint as a Hugging Face save_pretrained directory",
        description="write the newest checkpoint of a llama job (every rank's shards joined) as config.json and "
        "model.safetensors, which transformers' LlamaForCausalLM.from_pretrained loads",
    )
    p.add_argument("job", help="the TrainingJob YAML the checkpoint was written by")
    p.add_argument("--checkpoint", required=True, help="the job's checkpoint folder (spec.training.checkpoint.path)")
    p.add_argument("--out", required=True, help="the directory to write")


def run(args: argparse.Namespace) -> int:
    from meshjob_trainer.checkpoint import CheckpointMismatch
    from meshjob_trainer.huggingface import export_huggingface  # imports torch: `meshjob export --help` must not

    job = load_job(args.job)
    if job.model.kind not in INIT_MODEL_KINDS:
        raise SpecError(
            [FieldError("spec.model.kind", job.model.kind, f"{' or '.join(INIT_MODEL_KINDS)}: the families exported")]
        )
    try:
        step = export_huggingface(job, args.checkpoint, args.out)
    except CheckpointMismatch as err:
        raise SpecError([FieldError("--checkpoint", args.checkpoint, f"a checkpoint of {args.job}: {err}")]) from None
    except OSError as err:
        raise SpecError([FieldError("--out", args.out, f"a directory that can be written ({err.strerror})")]) from None
    print(f"{args.out}: the weights of step {step} of {job.name} (config.json, model.safetensors)")
    return 0
