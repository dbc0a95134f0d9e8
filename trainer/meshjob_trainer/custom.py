"""User models (spec.model.kind: custom): meshjob runs a model it did not write, pipelined and data
parallel (tensor parallelism is for the built-in families: it needs to know the layers' insides).

The user's package exposes an entry point, named in spec.model.entrypoint as "package.module:function":

    def build(config: dict, model: meshjob.spec.manifest.ModelSpec) -> CustomModel

config is spec.model.config as written; model gives layers, hidden, vocab and seqLen. It returns
the embedding (tokens (batch, seq) int64 -> (batch, seq, hidden)), spec.model.layers blocks (each
(batch, seq, hidden) -> the same shape), the head (-> logits (batch, seq, vocab)) and the shape of
one sequence's tensor between blocks, which must be (seqLen, hidden): the plan reshards exactly
that tensor between stages. meshjob cuts the blocks by stages[].layers and computes the loss (token
cross-entropy) from the head's logits. Every rank builds the whole model with the same seed and keeps
its stage's part, so the initial weights agree everywhere. A parameter the embedding and the head
share (tied weights) is kept equal across the first and the last stage like the built-in families'.

An example lives in examples/custom_model/; the Dockerfile says how to add such a package to the
trainer image. check_custom() loads, builds and runs the model on one sequence before any rank
starts, so a bad entry point is one error that names the field, not a traceback on every rank.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshjob.errors import FieldError, SpecError
from meshjob.spec.manifest import ModelSpec
from meshjob_trainer.model import PipelineStage
from meshjob_trainer.numerics import Numerics

FIELD = "spec.model.entrypoint"


@dataclass
class CustomModel:
    embedding: nn.Module  # tokens (batch, seq) -> (batch, seq, hidden)
    blocks: Sequence[nn.Module]  # spec.model.layers of them, each (batch, seq, hidden) -> the same
    head: nn.Module  # (batch, seq, hidden) -> logits (batch, seq, vocab)
    boundary: tuple[int, ...]  # one sequence's tensor between blocks: (seqLen, hidden)


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """The function named "package.module:function"; SpecError naming spec.model.entrypoint otherwise."""
    module_name, _, attr = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure of the user's import is this field's problem
        raise _error(
            entrypoint,
            f"an importable module: importing {module_name!r} raised "
            f"{type(err).__name__}: {err} (is the package installed in the trainer image?)",
        ) from err
    function = getattr(module, attr, None)
    if not callable(function):
        raise _error(entrypoint, f"a function of module {module_name!r}: it has no callable {attr!r}")
    return function


def _error(value: Any, allowed: str, field: str = FIELD) -> SpecError:
    return SpecError([FieldError(field, value, allowed)])


def build_custom(model: ModelSpec, seed: int) -> CustomModel:
    """Call the entry point with the job's seed (the same weights on every rank) and check what it returns."""
    function = load_entrypoint(model.entrypoint)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            parts = function(dict(model.config), model)
        except Exception as err:  # noqa: BLE001
            raise _error(
                model.entrypoint,
                f"an entry point that builds the model from spec.model.config: it raised {type(err).__name__}: {err}",
            ) from err
    _check_parts(model, parts)
    return parts


def _check_parts(model: ModelSpec, parts: Any) -> None:
    missing = [a for a in ("embedding", "blocks", "head", "boundary") if not hasattr(parts, a)]
    if missing:
        raise _error(
            model.entrypoint,
            f"an entry point returning meshjob_trainer.custom.CustomModel: "
            f"{type(parts).__name__} lacks {', '.join(missing)}",
        )
    modules = [("embedding", parts.embedding), ("head", parts.head)] + [
        (f"blocks[{i}]", b) for i, b in enumerate(parts.blocks)
    ]
    for name, module in modules:
        if not isinstance(module, nn.Module):
            raise _error(
                model.entrypoint, f"an entry point whose {name} is a torch.nn.Module, not {type(module).__name__}"
            )
    if len(parts.blocks) != model.layers:
        raise _error(
            model.layers,
            f"the number of blocks the entry point {model.entrypoint} returns ({len(parts.blocks)})",
            "spec.model.layers",
        )
    if tuple(parts.boundary) != (model.seq_len, model.hidden):
        raise _error(
            model.entrypoint,
            f"an entry point whose boundary shape is (spec.model.seqLen, "
            f"spec.model.hidden) = ({model.seq_len}, {model.hidden}), the tensor the "
            f"plan moves between stages; it returned {tuple(parts.boundary)}",
        )


def _shared_parameters(parts: CustomModel) -> set[int]:
    """ids of the parameters the embedding and the head share (tied weights)."""
    return {id(p) for p in parts.embedding.parameters()} & {id(p) for p in parts.head.parameters()}


def check_custom(model: ModelSpec, seed: int) -> None:
    """Build the model and run one sequence through it on the CPU; SpecError naming the field to
    fix when anything is wrong. Run before any rank starts."""
    parts = build_custom(model, seed)
    tokens = torch.zeros(1, model.seq_len, dtype=torch.long)
    expected = (1, model.seq_len, model.vocab)
    try:
        with torch.no_grad():
            x = parts.embedding(tokens)
            for block in parts.blocks:
                x = block(x)
            logits = parts.head(x)
    except Exception as err:  # noqa: BLE001
        raise _error(
            model.entrypoint,
            f"a model whose forward runs on one sequence of spec.model.seqLen "
            f"({model.seq_len}) tokens: it raised {type(err).__name__}: {err}",
        ) from err
    if tuple(logits.shape) != expected:
        raise _error(
            model.entrypoint,
            f"a head returning logits (batch, spec.model.seqLen, spec.model.vocab) = "
            f"{expected} for one sequence; it returned {tuple(logits.shape)}",
        )


class CustomStage(PipelineStage):
    """Blocks [first, last) of a user's model, with its embedding on the first stage and its head
    (and meshjob's loss) on the last."""

    def __init__(self, config: ModelSpec, first: int, last: int, seed: int, numerics: Numerics = Numerics()):
        super().__init__(config, first, last, numerics)
        parts = build_custom(config, seed)
        shared = _shared_parameters(parts)
        if self.is_first:
            self.embedding = parts.embedding
        self.blocks = nn.ModuleDict({str(i): parts.blocks[i] for i in range(first, last)})
        if self.is_last:
            self.head = parts.head
        holder = self.embedding if self.is_first else (self.head if self.is_last else None)
        cut = self.is_first != self.is_last
        self._tied = [p for p in holder.parameters() if id(p) in shared] if cut and holder is not None else []

    def tied_weights(self) -> list[nn.Parameter]:
        return self._tied

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
