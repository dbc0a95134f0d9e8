"""Llama against Hugging Face: a job with spec.model.init starts from a LlamaForCausalLM's save_pretrained
weights and computes its logits and loss (one process, tensor parallel, pipelined, key/value heads
replicated); a config that disagrees with spec.model exits 2 naming the field; `meshjob export huggingface`
writes a checkpoint back so that LlamaForCausalLM.from_pretrained computes what meshjob does; and
`meshjob data prepare --tokenizer` tokenizes with a local tokenizers file."""

from __future__ import annotations

import array
import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from meshjob import cli
from meshjob.spec.huggingface import config_problems
from meshjob.spec.manifest import StageSpec, parse_job
from meshjob.spec.model import InitSpec, ModelSpec
from meshjob_trainer.data import TRAIN, make_data
from meshjob_trainer.families import build_stage
from meshjob_trainer.huggingface import hf_name
from meshjob_trainer.launch import launch
from meshjob_trainer.model import full_parameters
from meshjob_trainer.train import train_rank

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN, SEQ = 2, 32, 4, 2, 64, 64, 8
MODEL = {
    "kind": "llama",
    "layers": LAYERS,
    "hidden": HIDDEN,
    "heads": HEADS,
    "kvHeads": KV_HEADS,
    "vocab": VOCAB,
    "ffnHidden": FFN,
    "seqLen": SEQ,
}
ONE = [{"layers": [0, 2], "mesh": [1]}]
TP2 = [{"layers": [0, 2], "mesh": [1, 2], "tensorParallelDim": 1}]
TP4 = [{"layers": [0, 2], "mesh": [1, 4], "tensorParallelDim": 1}]  # 2 key/value heads on 4 ranks: replicated
PP2 = [{"layers": [0, 1], "mesh": [1]}, {"layers": [1, 2], "mesh": [1]}]
PP2_TP2 = [{"layers": [0, 1], "mesh": [1, 2], "tensorParallelDim": 1}, {"layers": [1, 2], "mesh": [1]}]


def save_llama(directory, tie: bool, seed: int = 0) -> None:
    """A tiny LlamaForCausalLM with random weights (norms too, so their names are checked) in `directory`."""
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{tie: directory} of two saved models, one with a tied output head."""
    dirs = {}
    for tie in (False, True):
        directory = tmp_path_factory.mktemp(f"llama-tie-{tie}")
        save_llama(directory, tie)
        dirs[tie] = str(directory)
    return dirs


def job_doc(path: str, stages, tie: bool, lr: float = 1e-2, steps: int = 1, checkpoint=None, **model):
    training = {"steps": steps, "globalBatch": 4, "microbatches": 2, "learningRate": lr, "seed": 0}
    if checkpoint is not None:
        training["checkpoint"] = checkpoint
    return {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "hf"},
        "spec": {
            "model": {**MODEL, "tieEmbeddings": tie, "init": {"kind": "huggingface", "path": path}, **model},
            "training": training,
            "topology": {"devicesPerHost": 4},
            "stages": stages,
            "resharding": {"strategy": "broadcast", "chunks": 1, "balancer": "greedy"},
            "schedule": {"kind": "1f1b", "weightGradDelay": 0},
        },
    }


@functools.cache
def hf_model(path: str):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def spec_model(path: str, tie: bool) -> ModelSpec:
    return ModelSpec("llama", LAYERS, HIDDEN, HEADS, VOCAB, SEQ, KV_HEADS, FFN, tie, init=InitSpec("huggingface", path))


def stage_logits(stages, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (this rank's vocabulary slice) of stages chained in this process."""
    with torch.no_grad():
        x = stages[0].embed(tokens)
        for stage in stages:
            for i in range(stage.first, stage.last):
                x = stage.blocks[str(i)](x)
        return stages[-1].logits(x)


TOKENS = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("tie", [False, True])
def test_one_process_and_two_pipeline_stages_give_the_logits_of_hugging_face(hf_dirs, tie):
    path = hf_dirs[tie]
    model = spec_model(path, tie)
    expected = hf_logits(path, TOKENS)
    whole = [build_stage(model, 0, LAYERS, seed=7)]
    torch.testing.assert_close(stage_logits(whole, TOKENS), expected, rtol=0, atol=1e-5)
    cut = [build_stage(model, 0, 1, seed=7), build_stage(model, 1, LAYERS, seed=7)]
    torch.testing.assert_close(stage_logits(cut, TOKENS), expected, rtol=0, atol=1e-5)


def _tp_logits_worker(env, path: str, tie: bool, tp: int):
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.parallel import build_groups

    init_distributed(env, timeout_s=30)
    spec = StageSpec(layers=(0, LAYERS), mesh=(1, tp), tensor_parallel_dim=1)
    groups = build_groups([spec], [Mesh.grid((1, tp))], env.rank)
    logits = stage_logits([build_stage(spec_model(path, tie), 0, LAYERS, seed=7, tp=groups.tp)], TOKENS)
    dist.destroy_process_group()
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_give_the_logits_of_hugging_face(hf_dirs, gang, tp):
    """Each rank computes its vocabulary slice; at 4 ranks each of the 2 key/value heads is on 2 ranks."""
    path = hf_dirs[False]
    slices = gang(tp, functools.partial(_tp_logits_worker, path=path, tie=False, tp=tp), timeout_s=60)
    torch.testing.assert_close(torch.cat(slices, dim=-1), hf_logits(path, TOKENS), rtol=0, atol=1e-5)


def hf_loss(path: str, job) -> float:
    """The mean token cross-entropy of HF's logits over the job's first global batch, as meshjob batches it."""
    data, t = make_data(job, TRAIN), job.training
    total = 0.0
    for mb in range(t.microbatches):
        batch = data.microbatch(0, mb, t.microbatches)
        logits = hf_logits(path, batch.tokens)
        total += F.cross_entropy(logits.reshape(-1, VOCAB), batch.targets.reshape(-1), reduction="sum").item()
    return total / (t.global_batch * job.model.seq_len)


def run_job(job, checkpoint_dir=None):
    world = job.world_size
    target = functools.partial(train_rank, job=job, checkpoint_dir=checkpoint_dir)
    return launch(world, lambda ctx: target(ctx.env), timeout_s=90).raise_on_failure().values


@pytest.mark.slow
@pytest.mark.parametrize(
    "stages,tie", [(ONE, False), (TP2, True), (PP2, True), (TP4, False)], ids=["tp1", "tp2", "pp2", "tp4-kv-replicated"]
)
def test_a_job_with_init_trains_from_the_loss_of_hugging_face(hf_dirs, stages, tie):
    """A real job (gloo ranks, the plan's schedule and resharding): its first step's loss is HF's."""
    path = hf_dirs[tie]
    job = parse_job(job_doc(path, stages, tie))
    reported = [r.losses[0] for r in run_job(job) if r.losses]  # every rank of the last stage
    assert reported and reported == pytest.approx([hf_loss(path, job)] * len(reported), abs=1e-5)


# --- a config that disagrees -------------------------------------------------------------------


def write_job(tmp_path, doc) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("command", [["plan"], ["run", "--no-netns", "--quiet"]])
def test_a_config_that_disagrees_with_the_model_exits_2_naming_the_field(hf_dirs, tmp_path, capsys, command):
    doc = job_doc(hf_dirs[False], ONE, tie=False, hidden=64)
    assert cli.main([command[0], write_job(tmp_path, doc), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "spec.model.hidden: 64 is invalid: 32, the hidden_size of" in err and "config.json" in err


def test_every_disagreement_is_named():
    model = spec_model("/x", tie=False)
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "intermediate_size": 128,
        "max_position_embeddings": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "hidden_act": "gelu",
    }
    text = "\n".join(str(e) for e in config_problems(model, config, "/x/config.json"))
    for field in ("layers", "kvHeads", "ffnHidden", "tieEmbeddings", "ropeTheta", "seqLen"):
        assert f"spec.model.{field}:" in text
    assert "rms_norm_eps 1e-05" in text and "hidden_act silu" in text
    assert "model_type llama" in str(config_problems(model, {"model_type": "mistral"}, "/x/config.json")[0])


def test_a_missing_directory_and_a_family_without_init_are_refused(tmp_path, capsys):
    doc = job_doc(str(tmp_path / "nowhere"), ONE, tie=False)
    assert cli.main(["plan", write_job(tmp_path, doc)]) == 2
    assert "spec.model.init.path:" in capsys.readouterr().err
    doc["spec"]["model"] = {**doc["spec"]["model"], "kind": "gpt", "kvHeads": HEADS}
    assert cli.main(["plan", write_job(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert "spec.model.init:" in err and "llama only" in err


# --- export ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_of_a_job_that_did_not_move_writes_the_weights_it_started_from(hf_dirs, tmp_path):
    """Learning rate 1e-30 (the spec wants > 0): Adam's steps vanish below fp32's resolution of the weights."""
    path = hf_dirs[True]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    doc = job_doc(path, PP2_TP2, tie=True, lr=1e-30, steps=2, checkpoint={"every": 2, "path": str(ckpt)})
    run_job(parse_job(doc), checkpoint_dir=str(ckpt))
    assert (
        cli.main(["export", "huggingface", write_job(tmp_path, doc), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    )
    original = safetensors_torch.load_file(f"{path}/model.safetensors")
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(hf_logits(str(out), TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_export_of_trained_weights_gives_meshjobs_logits(hf_dirs, tmp_path):
    path = hf_dirs[False]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    doc = job_doc(path, PP2_TP2, tie=False, lr=1e-2, steps=2, checkpoint={"every": 2, "path": str(ckpt)})
    job = parse_job(doc)
    results = run_job(job, checkpoint_dir=str(ckpt))
    assert (
        cli.main(["export", "huggingface", write_job(tmp_path, doc), "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    )
    trained = full_parameters([r.params for r in results])
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert set(exported) == {hf_name(name) for name in trained}
    for name, tensor in trained.items():
        torch.testing.assert_close(exported[hf_name(name)], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(exported["lm_head.weight"], hf_model(path).lm_head.weight)  # it trained
    model = dataclasses.replace(job.model, init=InitSpec("huggingface", str(out)))
    meshjob = stage_logits([build_stage(model, 0, LAYERS, seed=0)], TOKENS)
    torch.testing.assert_close(hf_logits(str(out), TOKENS), meshjob, rtol=0, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == KV_HEADS


def test_export_refuses_another_family(tmp_path, capsys):
    doc = job_doc("/x", ONE, tie=False)
    doc["spec"]["model"] = {"kind": "gpt", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seqLen": 8}
    assert cli.main(["export", "huggingface", write_job(tmp_path, doc), "--checkpoint", "c", "--out", "o"]) == 2
    assert "spec.model.kind: 'gpt' is invalid: llama" in capsys.readouterr().err


# --- data prepare --tokenizer ------------------------------------------------------------------


def test_data_prepare_tokenizes_with_a_local_tokenizers_file(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "the cat sat on the mat. the dog sat on the log.\n" * 20
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(text)
    args = ["data", "prepare", str(tmp_path / "text.txt"), "--out", str(tmp_path / "train.bin")]
    assert (
        cli.main([*args, "--val-out", str(tmp_path / "val.bin"), "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
    )
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    written = array.array("H", (tmp_path / "train.bin").read_bytes() + (tmp_path / "val.bin").read_bytes())
    assert written.tolist() == ids and len(ids) < len(text)  # whole words, not bytes
    assert f"spec.model.vocab >= {tokenizer.get_vocab_size()}" in capsys.readouterr().out
    assert cli.main([*args, "--tokenizer", str(tmp_path / "missing.json")]) == 2
    assert "--tokenizer:" in capsys.readouterr().err
