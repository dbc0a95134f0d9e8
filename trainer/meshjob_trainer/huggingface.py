"""Hugging Face Llama weights: spec.model.init loaded into a llama stage's shards, and a checkpoint's shards
written back as a save_pretrained directory (`meshjob export huggingface`).

A LlamaForCausalLM and meshjob's llama (meshjob_trainer.llama) compute the same function with the same
matrices: the same rotary convention (rotate_half over channel halves), RMSNorm, SwiGLU and attention
scaling, so weights move across by name alone, unpermuted. A stage loads the full tensors of its own layers
and keeps the shard each parameter's ShardInfo names, so pipeline stages and tensor-parallel ranks take
what they would have built from the seed. The config.json side is the plan layer's (meshjob.spec.huggingface).
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from meshjob.errors import FieldError, SpecError
from meshjob.layout.mesh import Mesh
from meshjob.spec.huggingface import CONFIG, WEIGHTS, WEIGHTS_INDEX, llama_config
from meshjob.spec.manifest import TrainingJob
from meshjob_trainer.checkpoint import Checkpointer, spec_fingerprint, survey
from meshjob_trainer.llama import LlamaStage
from meshjob_trainer.model import PipelineStage, full_parameters
from meshjob_trainer.parallel import ShardInfo, TPGroup, shard_info, take_shard

# meshjob's names inside block i -> Hugging Face's inside model.layers.i
BLOCK_NAMES = {
    "ln_1.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
OUTER_NAMES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The Hugging Face LlamaForCausalLM name of meshjob llama parameter `name` (blocks.3.attn.q.weight ->
    model.layers.3.self_attn.q_proj.weight)."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{BLOCK_NAMES[rest]}"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ModuleNotFoundError as err:  # a dev dependency: a trainer image without it says what to install
        raise SpecError(
            [
                FieldError(
                    "spec.model.init", "huggingface", "a trainer with safetensors installed (pip install safetensors)"
                )
            ]
        ) from err
    return safetensors


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or save_pretrained's shards and their index)."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    with _safetensors().safe_open(directory / WEIGHTS, framework="pt") as f:
        return dict.fromkeys(f.keys(), directory / WEIGHTS)


def load_pretrained(stage: PipelineStage, directory: str | Path) -> None:
    """Overwrite every parameter of a llama stage with its shard of the Hugging Face weights in `directory`."""
    directory = Path(directory)
    files = _weight_files(directory)
    with ExitStack() as stack, torch.no_grad():
        opened: dict[Path, Any] = {}
        for name, param in stage.named_parameters():
            key = hf_name(name)
            if key not in files:
                raise SpecError(
                    [
                        FieldError(
                            "spec.model.init.path", str(directory), f"weights holding {key} (for meshjob's {name})"
                        )
                    ]
                )
            path = files[key]
            if path not in opened:
                opened[path] = stack.enter_context(_safetensors().safe_open(path, framework="pt"))
            full = opened[path].get_tensor(key)
            part = take_shard(full, shard_info(param))
            if part.shape != param.shape:
                raise SpecError(
                    [
                        FieldError(
                            "spec.model.init.path",
                            str(directory),
                            f"weights whose {key} has the shape spec.model gives it ({tuple(full.shape)} found)",
                        )
                    ]
                )
            param.copy_(part)


# --- export ----------------------------------------------------------------------------------


def _stage_ranks(job: TrainingJob) -> Iterator[tuple[int, int, TPGroup]]:
    """(stage, global rank, TP coordinates) of one rank per tensor-parallel index of every stage: global
    ranks run stage by stage, row-major over each mesh (meshjob.plan.placement); data-parallel and redundant
    ranks hold the same weights, so the first of each suffices."""
    first_rank = 0
    for stage, spec in enumerate(job.stages):
        mesh = Mesh.grid(spec.mesh, first_rank)
        seen: set[int] = set()
        for rank in mesh.ranks:
            dim = spec.tensor_parallel_dim
            tp = TPGroup() if dim is None else TPGroup(None, mesh.index_of(rank)[dim], spec.mesh[dim])
            if tp.rank not in seen:
                seen.add(tp.rank)
                yield stage, rank, tp
        first_rank += spec.size


def checkpoint_weights(job: TrainingJob, directory: str | Path) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest checkpoint in `directory` every rank can load: its step and the full weights by meshjob name."""
    world = job.world_size
    found = survey(directory, world)
    if found.resume_step is None:
        why = "; ".join(found.skipped) or "no complete checkpoint"
        raise SpecError([FieldError("--checkpoint", str(directory), f"a folder with a complete checkpoint ({why})")])
    step = found.resume_step
    model = dataclasses.replace(job.model, init=None)  # the skeleton's values are replaced: nothing to load
    shards: list[dict[str, tuple[torch.Tensor, ShardInfo]]] = []
    for stage, rank, tp in _stage_ranks(job):
        ck = Checkpointer(Path(directory), rank, world, spec_fingerprint(job, world))
        ck.check_fingerprint(step)  # CheckpointMismatch: written for another job
        state = torch.load(io.BytesIO(ck.read_payload(step)), map_location="cpu", weights_only=True)["model"]
        first, last = job.stages[stage].layers
        skeleton = LlamaStage(model, first, last, job.training.seed, tp)  # names every shard and its ShardInfo
        shards.append({name: (state[name], shard_info(p)) for name, p in skeleton.named_parameters()})
    return step, full_parameters(shards)


def export_huggingface(job: TrainingJob, checkpoint: str | Path, out: str | Path) -> int:
    """Write the newest checkpoint of a llama job as a Hugging Face directory (config.json, model.safetensors);
    returns the checkpoint's step."""
    step, weights = checkpoint_weights(job, checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(name): w.float().contiguous() for name, w in weights.items()}
    _safetensors().torch.save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(llama_config(job.model), indent=2) + "\n")
    return step
