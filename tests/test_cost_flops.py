"""The roofline's counts (meshjob.costs.device_costs) against the real modules: FLOPs counted by torch's
FLOP counter over each family's stage forward, input gradient and weight gradient, parameters counted on
the stage, and the tensor-parallel all-reduces the layers issue, counted at the process group."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshjob.costs.device_costs import range_work, stage_work, tp_reductions
from meshjob.costs.devices import parse_device
from meshjob.spec.manifest import ModelSpec, parse_job
from meshjob.spec.model import TrainingSpec

MODELS = {
    "gpt": ModelSpec("gpt", layers=4, hidden=64, heads=4, vocab=96, seq_len=16),
    "utransformer": ModelSpec("utransformer", layers=4, hidden=64, heads=4, vocab=96, seq_len=16),
    "llama": ModelSpec("llama", layers=4, hidden=64, heads=8, vocab=96, seq_len=16, kv_heads=2),
    "llama-untied": ModelSpec(
        "llama", layers=4, hidden=64, heads=8, vocab=96, seq_len=16, kv_heads=2, ffn_hidden=96, tie_embeddings=False
    ),
}
SAMPLES = 3


def _flops(run) -> int:
    # the math attention: its matrix products are what the counter sees (CPU's fused kernel is not counted)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        run()
    return counter.get_total_flops()


def _inputs(module, model: ModelSpec, samples: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    inputs: dict[str, torch.Tensor] = {}
    for name in module.input_names():
        if name == "tokens":
            inputs[name] = torch.randint(0, model.vocab, (samples, model.seq_len), generator=g)
        else:
            inputs[name] = torch.randn(samples, model.seq_len, model.hidden, generator=g).requires_grad_(True)
    if module.is_last:
        inputs["targets"] = torch.randint(0, model.vocab, (samples, model.seq_len), generator=g)
    return inputs


def measured_passes(module, model: ModelSpec, samples: int, count=_flops) -> tuple:
    """count(F), count(I), count(W) of one microbatch through RealCompute's split backward."""
    from meshjob_trainer.compute import RealCompute

    compute = RealCompute(module, list(module.parameters()), split=True)
    inputs, out = _inputs(module, model, samples), {}
    forward = count(lambda: out.update(compute.forward(inputs)))
    roots = [out["loss"]] if module.is_last else list(out.values())
    grads = [None] if module.is_last else [torch.ones_like(t) for t in roots]
    stash = types.SimpleNamespace(
        inputs={k: v for k, v in inputs.items() if v.requires_grad}, param_groups=None, weight_grads=[]
    )
    input_grad = count(lambda: compute.input_grad(stash, roots, grads))
    weight_grad = count(lambda: compute.weight_grad(stash))
    return forward, input_grad, weight_grad


def modelled_passes(work) -> tuple[float, float, float]:
    """F, I, W FLOPs as the passes that run them: recompute's forward in I, the first stage's backward in W."""
    input_grad, weight_grad = work.input_grad_flops + work.recompute_flops, work.weight_grad_flops
    if work.whole_backward_in_weight_grad:
        input_grad, weight_grad = 0.0, input_grad + weight_grad
    return work.forward_flops, input_grad, weight_grad


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("recompute", [False, True])
def test_flops_and_parameters_are_the_real_modules(family, recompute):
    from meshjob_trainer.families import build_stage
    from meshjob_trainer.numerics import Numerics

    model = MODELS[family]
    training = TrainingSpec(global_batch=2 * SAMPLES, microbatches=2)
    for first, last in ((0, 2), (1, 3), (2, 4), (0, 4)):
        module = build_stage(model, first, last, seed=0, numerics=Numerics("fp32", recompute))
        work = range_work(model, training, first, last, 1, 1, recompute)
        measured = measured_passes(module, model, SAMPLES)
        assert modelled_passes(work) == pytest.approx(measured, rel=1e-12), (first, last)
        assert work.params == sum(p.numel() for p in module.parameters())


def test_a_custom_models_layer_is_counted_as_the_trainer_measures_it(monkeypatch):
    """The plan layer cannot see inside a user's blocks (a convolution LM here: about a third of a GPT
    layer's FLOPs); the trainer measures one, and a stage of its blocks costs what runs."""
    from meshjob_trainer.families import build_stage
    from meshjob_trainer.flops import measured_layer

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "custom_model"))
    model = ModelSpec("custom", layers=4, hidden=64, vocab=96, seq_len=16, entrypoint="conv_lm:build")
    training = TrainingSpec(global_batch=2 * SAMPLES, microbatches=2)
    layer = measured_layer(model, 0)
    module = build_stage(model, 1, 3, seed=0)
    work = range_work(model, training, 1, 3, 1, 1, layer=layer)
    assert modelled_passes(work) == pytest.approx(measured_passes(module, model, SAMPLES), rel=1e-12)
    assert work.params == sum(p.numel() for p in module.parameters())
    assert range_work(model, training, 1, 3, 1, 1).forward_flops > 2 * work.forward_flops  # the GPT estimate


def test_llama_is_counted_with_swiglu_and_grouped_query_attention_not_as_a_gpt_block():
    llama = MODELS["llama"]
    training = TrainingSpec(global_batch=2, microbatches=1)
    as_gpt = dataclasses.replace(llama, kind="gpt")
    own, gpt = range_work(llama, training, 1, 2, 1, 1), range_work(as_gpt, training, 1, 2, 1, 1)
    h, f, kv = llama.hidden, llama.ffn_width, llama.key_value_heads * llama.hidden // llama.heads
    tokens, s = training.microbatch_size * llama.seq_len, llama.seq_len
    assert own.forward_flops == 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * tokens * s * h
    assert own.forward_flops != gpt.forward_flops


def test_full_recompute_adds_the_blocks_forward_to_the_input_gradient_pass():
    doc = {
        "apiVersion": "meshjob.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "rc"},
        "spec": {
            "model": {
                "kind": "llama",
                "layers": 4,
                "hidden": 256,
                "heads": 8,
                "kvHeads": 2,
                "vocab": 512,
                "seqLen": 256,
            },
            "training": {"globalBatch": 8, "microbatches": 4, "recompute": "full"},
            "topology": {"devicesPerHost": 1},
            "stages": [{"layers": [0, 2], "mesh": [1, 1]}, {"layers": [2, 4], "mesh": [1, 1]}],
        },
    }
    job = parse_job(doc)
    device = parse_device("h100")
    from meshjob.costs.device_costs import emulated_cost

    without = parse_job({**doc, "spec": {**doc["spec"], "training": {**doc["spec"]["training"], "recompute": "none"}}})
    for stage in (0, 1):
        on, off = emulated_cost(job, stage, device), emulated_cost(without, stage, device)
        assert on.recompute_s > 0 and on.stage.forward_s == off.stage.forward_s
        assert on.stage.backward_s == pytest.approx(off.stage.backward_s + on.recompute_s)
    blocks = stage_work(job, 1)
    assert blocks.recompute_flops < blocks.forward_flops  # the head is not recomputed


# --- tensor-parallel all-reduces ------------------------------------------------------------------------


def tp_job(kind: str, recompute: str, precision: str = "fp32", kv_heads: int = 1):
    model = {"kind": kind, "layers": 6, "hidden": 32, "heads": 4, "vocab": 64, "seqLen": 8}
    if kind == "llama":
        model["kvHeads"] = kv_heads
    return parse_job(
        {
            "apiVersion": "meshjob.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "tp"},
            "spec": {
                "model": model,
                "training": {"globalBatch": 4, "microbatches": 2, "recompute": recompute, "precision": precision},
                "topology": {"devicesPerHost": 2},
                "stages": [{"layers": [a, a + 2], "mesh": [1, 2], "tensorParallelDim": 1} for a in (0, 2, 4)],
            },
        }
    )


# (kind, recompute, precision, kvHeads); one key/value head on two ranks is replicated (weight gradients summed)
TP_JOBS = [("gpt", "none", "fp32", 1), ("llama", "full", "fp32", 2), ("llama", "none", "bf16", 1)]


def _tp_rank(env):
    """Per job and stage: the all-reduce bytes of F, I, W of the real stage and of EmulatedCompute, per call."""
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.compute import DeadlineClock, EmulatedCompute
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.families import build_stage
    from meshjob_trainer.numerics import PRECISION_DTYPES, Numerics
    from meshjob_trainer.parallel import build_groups

    init_distributed(env, timeout_s=30)
    issued: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        issued.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    def count(run) -> list[int]:
        issued.clear()
        run()
        return list(issued)

    dist.all_reduce = counting
    out = {}
    for kind, recompute, precision, kv_heads in TP_JOBS:
        job = tp_job(kind, recompute, precision, kv_heads)
        dtype = PRECISION_DTYPES[precision]
        groups = build_groups(job.stages[:1], [Mesh.grid((1, 2))], env.rank, dtype)
        samples = job.training.microbatch_size
        for stage, spec in enumerate(job.stages):
            module = build_stage(job.model, *spec.layers, 0, groups.tp, Numerics.of(job, stage))
            real = measured_passes(module, job.model, samples, count)
            emulated = EmulatedCompute(
                module,
                types.SimpleNamespace(stage=types.SimpleNamespace(forward_s=0.0, input_grad_s=0.0, weight_grad_s=0.0)),
                (samples, job.model.seq_len, job.model.hidden),
                dtype,
                tp=groups.tp,
                reductions=tp_reductions(job, stage),
                clock=DeadlineClock(sleep=lambda s: None),
            )
            stash = types.SimpleNamespace(inputs={})
            passes = (
                count(lambda e=emulated: e.forward({})),
                count(lambda e=emulated, s=stash: e.input_grad(s, [], [])),
                count(lambda e=emulated, s=stash: e.weight_grad(s)),
            )
            out[(kind, recompute, precision, kv_heads, stage)] = (real, passes, emulated.tp_bytes)
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_emulated_compute_all_reduces_over_the_tp_group_what_the_real_layers_do(gang):
    """gpt, llama with one key/value head on two ranks (replicated: its weight gradients are summed in W), llama
    with full recompute (the forward's reductions again in I), bf16 (the activations' reductions in bf16). The
    bytes each all-reduce call hands the group; its ring sends 2 (t - 1) / t of them from each rank."""
    for result in gang(2, _tp_rank, timeout_s=90):
        for (kind, recompute, precision, kv_heads, stage), (real, emulated, total) in result.items():
            r = tp_reductions(tp_job(kind, recompute, precision, kv_heads), stage)
            model = tuple(sorted(a.nbytes for a in p) for p in (r.forward, r.input_grad, r.weight_grad))
            # the same all-reduces in each pass (in the first stage's W, recompute interleaves them per block)
            assert tuple(sorted(p) for p in real) == model == tuple(sorted(p) for p in emulated), (kind, stage)
            assert total == r.nbytes > 0


# --- on the wire: a private loopback (a network namespace of its own) carries only this gang's bytes ---------


def _loopback_tx_bytes() -> int:
    # /proc/net/dev is the reader's namespace's (/sys/class/net is the one sysfs was mounted in)
    for line in open("/proc/net/dev"):
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no loopback interface")


def wire_job():
    job = tp_job("llama", "full", "bf16", 1)  # every kind of reduction: activations, the loss, replicated k and v
    return dataclasses.replace(job, model=dataclasses.replace(job.model, hidden=256, seq_len=128))


def _wire_rank(env) -> list[int]:
    """Per stage: the loopback bytes of 4 microbatches' F, I and W of EmulatedCompute on two TP ranks."""
    import torch.distributed as dist

    from meshjob.layout.mesh import Mesh
    from meshjob_trainer.compute import DeadlineClock, EmulatedCompute
    from meshjob_trainer.dist import init_distributed
    from meshjob_trainer.model import PipelineStage
    from meshjob_trainer.parallel import build_groups

    init_distributed(env, timeout_s=30)
    job = wire_job()
    groups = build_groups(job.stages[:1], [Mesh.grid((1, 2))], env.rank, torch.bfloat16)
    zero = types.SimpleNamespace(stage=types.SimpleNamespace(forward_s=0.0, input_grad_s=0.0, weight_grad_s=0.0))
    stash, out = types.SimpleNamespace(inputs={}), []
    for stage, spec in enumerate(job.stages):
        reductions = tp_reductions(job, stage)
        emulated = EmulatedCompute(
            PipelineStage(job.model, *spec.layers), zero, (1,), torch.bfloat16, tp=groups.tp,
            reductions=reductions, clock=DeadlineClock(sleep=lambda s: None),
        )  # fmt: skip
        dist.barrier()
        before = _loopback_tx_bytes()
        dist.barrier()
        for _ in range(4):
            emulated.forward({}), emulated.input_grad(stash, [], []), emulated.weight_grad(stash)
        dist.barrier()
        out.append(_loopback_tx_bytes() - before)
    dist.destroy_process_group()
    return out


def wire_main() -> None:
    """Run inside a fresh network namespace: print each stage's loopback bytes as JSON."""
    from meshjob_trainer.launch import launch

    print(json.dumps(launch(2, lambda ctx: _wire_rank(ctx.env), timeout_s=60).raise_on_failure().values[0]))


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_the_tp_all_reduces_of_emulated_compute_cross_the_wire_as_the_model_counts_them():
    """Two ranks' ring all-reduce sends each rank's payload once ((2 (t - 1) / t) x t = 2 payloads at t = 2)
    on the one loopback both use; TCP's headers and acknowledgements add well under 2% at these sizes."""
    here = Path(__file__).resolve().parent
    script = f"ip link set lo up && {sys.executable} -c 'import {Path(__file__).stem} as t; t.wire_main()'"
    run = subprocess.run(["unshare", "-n", "sh", "-c", script], cwd=here, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    wire = json.loads(run.stdout.strip().splitlines()[-1])
    for stage, nbytes in enumerate(wire):
        payload = 2 * 4 * tp_reductions(wire_job(), stage).nbytes  # both ranks, 4 microbatches
        assert payload <= nbytes <= 1.02 * payload, (stage, nbytes / payload)
