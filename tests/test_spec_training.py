"""The manifest's model families, data and training numerics: defaults, and every rule that ties
them to the rest of the job (each problem named by its field, with what is allowed)."""

from __future__ import annotations

import pytest
from test_spec import base, errors_of, mutate

from meshjob.spec.manifest import job_to_dict, parse_job


def fields(doc) -> dict[str, str]:
    return {e.path: e.allowed for e in errors_of(doc)}


def llama(doc=None, **model):
    doc = mutate(
        doc or base(),
        "spec.model",
        {"kind": "llama", "layers": 8, "hidden": 256, "heads": 8, "vocab": 1024, "seqLen": 128, **model},
    )
    return doc


def test_defaults_are_synthetic_data_fp32_no_recompute_no_clipping_constant_lr_plain_adamw():
    job = parse_job(base())
    assert job.data.kind == "synthetic" and job.data.path == ""
    t = job.training
    assert (t.precision, t.recompute, t.grad_clip, t.lr_schedule, t.eval_every) == ("fp32", "none", None, None, 0)
    assert (t.optimizer.kind, t.optimizer.zero_stage, t.optimizer.weight_decay) == ("adamw", 0, 0.01)
    assert job.model.tie_embeddings and job.model.kv_heads is None and job.model.ffn_width == 4 * 256


def test_every_new_field_reads_back_from_its_manifest_form():
    doc = llama(kvHeads=2, ffnHidden=512, tieEmbeddings=False, ropeTheta=5.0e5)
    doc = mutate(doc, "spec.data", {"kind": "tokens", "path": "t.bin", "valPath": "v.bin", "dtype": "uint32"})
    doc = mutate(doc, "spec.training.precision", "bf16")
    doc = mutate(doc, "spec.training.recompute", "full")
    doc = mutate(doc, "spec.training.gradClip", 1.0)
    doc = mutate(doc, "spec.training.lrSchedule", {"warmupSteps": 5, "minLr": 3.0e-5})
    doc = mutate(doc, "spec.training.evalEvery", 10)
    doc = mutate(doc, "spec.training.optimizer", {"kind": "adamw", "zeroStage": 1, "weightDecay": 0.1})
    doc = mutate(doc, "spec.stages[1].recompute", "none")
    job = parse_job(doc)
    assert parse_job(job_to_dict(job)) == job
    assert (job.model.key_value_heads, job.model.ffn_width, job.data.dtype) == (2, 512, "uint32")
    assert (job.recompute(0), job.recompute(1)) == ("full", "none")  # a stage overrides the job's setting
    assert job.training.lr_schedule.warmup_steps == 5 and job.training.optimizer.zero_stage == 1


def test_llama_ffn_width_defaults_to_eight_thirds_of_hidden_rounded_up_to_64():
    assert parse_job(llama()).model.ffn_width == 704  # 8/3 x 256 = 682.7


def test_kv_heads_must_divide_heads():
    assert fields(llama(kvHeads=3)) == {"spec.model.kvHeads": "a divisor of spec.model.heads (8)"}


def test_kv_heads_is_a_llama_feature():
    assert "llama" in fields(mutate(base(), "spec.model.kvHeads", 2))["spec.model.kvHeads"]


def test_rotary_embeddings_need_an_even_head_size():
    assert "even head size" in fields(llama(hidden=24, heads=8))["spec.model.heads"]


def test_tensor_parallel_degree_must_divide_llama_kv_heads_or_be_a_multiple_and_divide_vocab():
    # stage 0 runs tensor parallel 2 (mesh [1, 2], tensorParallelDim 1)
    assert parse_job(llama(kvHeads=1)).model.kv_heads == 1  # the one key/value head replicated on both ranks
    assert fields(llama(hidden=240, heads=6, kvHeads=3)) == {
        "spec.stages[0].mesh[1]": "a tensor-parallel degree dividing spec.model.kvHeads (3) or a multiple of it "
        "(each key/value head then replicated on degree / 3 ranks)"
    }
    assert "spec.model.vocab (1023)" in fields(llama(vocab=1023))["spec.stages[0].mesh[1]"]


def test_tensor_parallel_degree_must_divide_the_mlp_width():
    assert "spec.model.ffnHidden (101)" in fields(mutate(base(), "spec.model.ffnHidden", 101))["spec.stages[0].mesh[1]"]


def test_custom_model_needs_a_package_module_function_entrypoint():
    doc = mutate(base(), "spec.model", {"kind": "custom", "layers": 8, "entrypoint": "not an entry point"})
    doc = mutate(doc, "spec.stages[0].tensorParallelDim", None)
    assert "package.module:function" in fields(doc)["spec.model.entrypoint"]


def test_custom_model_runs_without_tensor_parallelism():
    doc = mutate(base(), "spec.model", {"kind": "custom", "layers": 8, "entrypoint": "pkg.model:build"})
    assert "tensor parallelism is for the built-in families" in fields(doc)["spec.stages[0].mesh[1]"]
    job = parse_job(mutate(doc, "spec.stages[0].tensorParallelDim", None))
    assert job.model.entrypoint == "pkg.model:build"


def test_entrypoint_and_config_belong_to_custom_models_only():
    doc = mutate(base(), "spec.model.entrypoint", "pkg.model:build")
    assert fields(mutate(doc, "spec.model.config", {"depth": 2})) == {
        "spec.model.entrypoint": "only with spec.model.kind custom",
        "spec.model.config": "only with spec.model.kind custom",
    }


def test_token_data_needs_a_path_and_evaluation_needs_a_validation_file():
    doc = mutate(base(), "spec.data", {"kind": "tokens"})
    doc = mutate(doc, "spec.training.evalEvery", 5)
    assert fields(doc) == {
        "spec.data.path": "a token file when spec.data.kind is tokens",
        "spec.data.valPath": "a validation token file when spec.training.evalEvery > 0",
    }


def test_synthetic_data_takes_no_files():
    assert "only with spec.data.kind tokens" in fields(mutate(base(), "spec.data", {"path": "x.bin"}))["spec.data.path"]


@pytest.mark.parametrize(
    "path,value,allowed",
    [
        ("spec.data", {"kind": "tokens", "path": "t.bin", "dtype": "int8"}, "one of uint16, uint32"),
        ("spec.training.precision", "fp16", "one of fp32, bf16"),
        ("spec.training.recompute", "selective", "one of none, full"),
        ("spec.stages[0].recompute", "some", "one of none, full"),
        ("spec.training.gradClip", 0, "a number > 0"),
        ("spec.training.optimizer", {"zeroStage": 2}, "an integer in 0..1"),
        ("spec.training.optimizer", {"kind": "sgd"}, "one of adamw"),
        ("spec.training.evalBatches", 0, "an integer in 1..1024"),
    ],
)
def test_enums_and_bounds_of_the_training_fields(path, value, allowed):
    assert list(fields(mutate(base(), path, value)).values()) == [allowed]


def test_warm_up_fits_in_the_run_and_the_floor_is_below_the_learning_rate():
    doc = mutate(base(), "spec.training.lrSchedule", {"warmupSteps": 21, "minLr": 1.0})
    assert fields(doc) == {
        "spec.training.lrSchedule.warmupSteps": "at most spec.training.steps (20)",
        "spec.training.lrSchedule.minLr": "at most spec.training.learningRate (0.0003)",
    }
