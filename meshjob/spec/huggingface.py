"""Hugging Face Llama directories as the plan layer sees them: the config.json of spec.model.init checked against
spec.model before any rank starts, and the config.json `meshjob export huggingface` writes (the weights: the trainer).

A save_pretrained directory holds config.json (plain JSON: read here, no transformers import) and its weights,
model.safetensors or, when save_pretrained sharded them, model.safetensors.index.json and its shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshjob.errors import FieldError
from meshjob.spec.model import INIT_MODEL_KINDS, RMS_NORM_EPS, ModelSpec, TrainingJob

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # save_pretrained's map of tensor names to shard files
MODEL_TYPES = ("llama",)  # config.json model_type values whose weights meshjob's llama family takes
INIT_PATH = "spec.model.init.path"
# LlamaConfig's defaults, for the keys an older or hand-written config.json leaves out
DEFAULT_MAX_POSITIONS = 2048
DEFAULT_ROPE_THETA = 10000.0


def rope_theta(config: Mapping[str, Any]) -> float:
    """The rotary base: transformers 5 writes it in rope_parameters, earlier versions at the top level."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)))


def _rope_type(config: Mapping[str, Any]) -> str:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return str(params.get("rope_type", params.get("type", "default")))


def config_problems(model: ModelSpec, config: Mapping[str, Any], source: str) -> list[FieldError]:
    """Where a Hugging Face Llama config.json (read from `source`) disagrees with spec.model: each problem
    names the spec field and the value the config has, or spec.model.init.path for what meshjob cannot run."""

    def unsupported(what: str) -> FieldError:
        return FieldError(INIT_PATH, os.path.dirname(source), f"a Hugging Face Llama directory whose {source} {what}")

    if config.get("model_type") not in MODEL_TYPES:
        return [unsupported(f"has model_type {' or '.join(MODEL_TYPES)} (it has {config.get('model_type')!r})")]
    heads = config.get("num_attention_heads")
    fields: list[tuple[str, str, Any, Any]] = [  # (spec field, config key, spec value, config value)
        ("spec.model.hidden", "hidden_size", model.hidden, config.get("hidden_size")),
        ("spec.model.layers", "num_hidden_layers", model.layers, config.get("num_hidden_layers")),
        ("spec.model.heads", "num_attention_heads", model.heads, heads),
        ("spec.model.kvHeads", "num_key_value_heads", model.key_value_heads, config.get("num_key_value_heads", heads)),
        ("spec.model.vocab", "vocab_size", model.vocab, config.get("vocab_size")),
        ("spec.model.ffnHidden", "intermediate_size", model.ffn_width, config.get("intermediate_size")),
        ("spec.model.tieEmbeddings", "tie_word_embeddings", model.tie_embeddings, config.get("tie_word_embeddings")),
        ("spec.model.ropeTheta", "rope_theta", model.rope_theta, rope_theta(config)),
    ]
    errors = [
        FieldError(field, mine, f"{theirs!r}, the {key} of {source} (spec.model.init)")
        for field, key, mine, theirs in fields
        if mine != theirs and not (key == "tie_word_embeddings" and theirs is None and not mine)  # default False
    ]
    positions = config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    if isinstance(positions, int) and model.seq_len > positions:
        errors.append(
            FieldError(
                "spec.model.seqLen",
                model.seq_len,
                f"at most {positions}, the max_position_embeddings of {source} (spec.model.init)",
            )
        )
    head_dim = model.hidden // model.heads
    if config.get("head_dim", head_dim) != head_dim:
        errors.append(unsupported(f"has head_dim hidden_size / num_attention_heads (it has {config.get('head_dim')})"))
    if config.get("hidden_act", "silu") != "silu":
        errors.append(
            unsupported(f"has hidden_act silu, the SwiGLU of meshjob's llama (it has {config['hidden_act']!r})")
        )
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            errors.append(unsupported(f"has {key} false: meshjob's llama has no biases"))
    if config.get("rms_norm_eps", RMS_NORM_EPS) != RMS_NORM_EPS:
        errors.append(
            unsupported(f"has rms_norm_eps {RMS_NORM_EPS}, meshjob's RMSNorm's (it has {config['rms_norm_eps']})")
        )
    if _rope_type(config) != "default":
        errors.append(unsupported(f"has plain rotary embeddings, rope_type default (it has {_rope_type(config)!r})"))
    return errors


def check_init(job: TrainingJob) -> list[FieldError]:
    """Problems of spec.model.init's directory (none without it): its files, and its config against spec.model."""
    init, model = job.model.init, job.model
    if init is None or model.kind not in INIT_MODEL_KINDS:
        return []  # no init, or a kind the semantic checks already refused
    directory = Path(init.path)
    where = f"relative paths are read from the working directory {os.getcwd()}"
    source = str(directory / CONFIG)
    try:
        config = json.loads((directory / CONFIG).read_text())
    except OSError as err:
        return [
            FieldError(
                INIT_PATH, init.path, f"a save_pretrained directory with a readable {CONFIG} ({err.strerror}; {where})"
            )
        ]
    except ValueError as err:
        return [FieldError(INIT_PATH, init.path, f"a directory whose {CONFIG} is JSON ({err})")]
    if not isinstance(config, dict):
        return [FieldError(INIT_PATH, init.path, f"a directory whose {CONFIG} is a JSON object")]
    errors = config_problems(model, config, source)
    if not (directory / WEIGHTS).is_file() and not (directory / WEIGHTS_INDEX).is_file():
        errors.append(
            FieldError(
                INIT_PATH,
                init.path,
                f"a save_pretrained directory with {WEIGHTS} or {WEIGHTS_INDEX} "
                "(safetensors weights; save_pretrained writes them by default)",
            )
        )
    return errors


def llama_config(model: ModelSpec) -> dict[str, Any]:
    """The config.json of spec.model as a Hugging Face LlamaForCausalLM (fp32 weights)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.key_value_heads,
        "head_dim": model.hidden // model.heads,
        "intermediate_size": model.ffn_width,
        "vocab_size": model.vocab,
        "max_position_embeddings": model.seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": model.rope_theta,  # transformers before 5 reads it here
        "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": model.tie_embeddings,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
