"""Memory per rank: parameters, optimizer state and activations for fp32 vs bf16, recompute off vs
on, ZeRO stage 0 vs 1 (issue 12's measurement), against what each should be.

Every variant trains a Llama model as one stage on DP data-parallel ranks (real processes, gloo)
under GPipe, so all M microbatches are stashed at the peak, and measures on every rank:

  parameters   bytes of the stage's parameters            expected: 4 x the analytic parameter count
  optimizer    bytes of AdamW's state after a step        expected: 2 x 4 bytes per element it updates
                                                          (all of them; ZeRO-1: 1/DP of them) + its step counters
  activations  peak bytes of every tensor the forward and backward of one step create and keep alive at
               once (a TorchDispatchMode follows each storage from creation to release); the gradients
               are allocated before, so what is counted is activations and their temporaries
  stashed      microbatches forwarded and not yet backwarded at the peak (the executor's count)

and, for the activations, the structure they should follow: without recompute, M x (L blocks x
A_block + A_rest); with recompute, M x (L x the block input + A_rest) + at most one block's A_block
being recomputed, where A_block is the bytes one block saves for the backward of one microbatch and
A_rest those of the embedding and the head (measured with saved-tensor hooks on one microbatch).
What a step holds beyond its stash is the backward's temporaries (activation gradients, the
loss's softmax), without recompute as with it, plus with recompute the block being recomputed.
Targets (issue 12): ZeRO-1's optimizer bytes per rank are 1/DP of ZeRO-0's within 5%; with
recompute the peak activations are at most one block's (A_block) per stashed microbatch. Reported
beside them: what recompute holds beyond its stash, less what the same step holds beyond its stash
without recompute, in blocks (the recomputed block; its backward's temporaries come at the
recompute peak, not at the end of the forwards where the peak without recompute is).

Per schedule (gpipe, 1f1b, eager-1f1b, and eager-1f1b with weightGradDelay auto), recompute off and on: a
3-stage Llama whose stages each run their own action list alone in this process (a loopback stands in for the
neighbours), measured the same way: the busiest stage's peak activations, the step's compute summed over the
stages, and the block forwards per block and microbatch (target with recompute: 2, also under the split backward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from meshjob.plan.build import build_plan
from meshjob.spec.api import API_VERSION, KIND
from meshjob.spec.manifest import ModelSpec, TrainingJob, parse_job
from meshjob_trainer.calibrate import Arrived
from meshjob_trainer.launch import launch

FLOAT32 = 4
VARIANTS = [
    (precision, recompute, zero) for precision in ("fp32", "bf16") for recompute in ("none", "full") for zero in (0, 1)
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=int, default=4, help="data-parallel ranks of the stage (default 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, fp32 only")
    parser.add_argument("--out", default="bench/results", help="folder for memory.json and memory.png")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages torch ops create while active that are still alive, and their peak.
    The storages of `exclude` (the parameters and gradients) are not counted when an op returns a view
    of them (a linear layer's transposed weight)."""

    def __init__(self, exclude: Any = ()) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in exclude:
            self._seen[t.untyped_storage()] = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:  # views and in-place results share a storage: counted once
                    self._seen[storage] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def saved_bytes(run: Any, params: Any) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `run()` executes (those of
    `params` and their views excluded: they are not activations)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def llama_parameters(m: ModelSpec) -> int:
    """The analytic parameter count of a tied-embedding Llama (meshjob_trainer.llama)."""
    head_dim = m.hidden // m.heads
    attention = 2 * m.hidden * m.hidden + 2 * m.hidden * m.key_value_heads * head_dim
    block = attention + 3 * m.hidden * m.ffn_width + 2 * m.hidden
    return m.layers * block + m.vocab * m.hidden + m.hidden


def _llama_job(name: str, size: tuple[int, int, int], training: dict[str, Any], spec: dict[str, Any]) -> TrainingJob:
    """The benchmark's Llama (hidden, seq, layers = `size`; 4 heads, 2 KV heads) with these training fields
    and the rest of the spec (topology, stages, schedule)."""
    hidden, seq, layers = size
    model = {"kind": "llama", "layers": layers, "hidden": hidden, "heads": 4, "kvHeads": 2, "vocab": 256, "seqLen": seq}
    training = {"steps": 2, "learningRate": 1e-3, "seed": 0, **training}
    return parse_job(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name},
            "spec": {"model": model, "training": training, **spec},
        }
    )


def bench_job(precision: str, recompute: str, zero: int, dp: int, quick: bool) -> TrainingJob:
    hidden, seq, layers = (32, 16, 2) if quick else (128, 64, 4)
    training = {
        "globalBatch": 4 * dp,
        "microbatches": 4,
        "precision": precision,
        "recompute": recompute,
        "optimizer": {"zeroStage": zero},
    }
    return _llama_job(
        "bench-memory",
        (hidden, seq, layers),
        training,
        {
            "topology": {"devicesPerHost": dp},
            "stages": [{"layers": [0, layers], "mesh": [1, dp], "dataParallelDim": 1}],
            "schedule": {"kind": "gpipe", "weightGradDelay": 0},
        },
    )


SCHEDULES: list[tuple[str, int | str]] = [("gpipe", 0), ("1f1b", 0), ("eager-1f1b", 0), ("eager-1f1b", "auto")]
PIPELINE_STAGES = 3


def pipeline_job(schedule: str, delay: int | str, recompute: str, quick: bool, precision: str = "fp32") -> TrainingJob:
    """A Llama cut into PIPELINE_STAGES stages of one device: the per-schedule measurement's job."""
    hidden, seq, layers_per_stage, microbatches = (32, 16, 2, 4) if quick else (128, 64, 2, 8)
    layers = PIPELINE_STAGES * layers_per_stage
    stages = [
        {"layers": [s * layers_per_stage, (s + 1) * layers_per_stage], "mesh": [1, 1]} for s in range(PIPELINE_STAGES)
    ]
    training = {
        "globalBatch": 2 * microbatches,
        "microbatches": microbatches,
        "precision": precision,
        "recompute": recompute,
    }
    return _llama_job(
        "bench-memory-schedules",
        (hidden, seq, layers),
        training,
        {
            "topology": {"devicesPerHost": 1},
            "stages": stages,
            "schedule": {"kind": schedule, "weightGradDelay": delay},
        },
    )


class Loopback:
    """A stage's transport without its neighbours: a receive gives a fixed random tensor of the
    boundary's shape (made before the measured step), a send is dropped or, with `keep`, recorded."""

    def __init__(self, shape: tuple[int, ...], keep: bool = False) -> None:
        self.shape, self.keep = shape, keep
        self.sent: dict[tuple[str, int, bool], torch.Tensor] = {}
        self._received: dict[tuple[str, int, bool], torch.Tensor] = {}

    def start(self, key: Any, mb: int, local: torch.Tensor | None) -> Arrived:
        at = (key.tensor, mb, key.grad)
        if local is not None:
            if self.keep:
                self.sent[at] = local.detach().clone()
            return Arrived(None)
        if at not in self._received:
            seed = zlib.crc32(f"{key.tensor}:{mb}:{key.grad}".encode())
            self._received[at] = torch.randn(self.shape, generator=torch.Generator().manual_seed(seed))
        return Arrived(self._received[at])


@dataclass
class StageRun:
    module: Any  # the stage (meshjob_trainer.model.PipelineStage) with the measured step's gradients
    activations: int  # peak bytes, as measure_rank counts them
    step_s: float  # the fastest of the timed steps
    forwards: float  # block forwards per block and microbatch in the measured step (recompute: 2)
    stashed: int
    sent: dict[tuple[str, int, bool], torch.Tensor]


def run_stage(job: TrainingJob, stage: int, timed_steps: int = 2, keep_sent: bool = False) -> StageRun:
    """One stage of `job` in this process, running its own action list of the plan against a Loopback:
    a warm-up step, `timed_steps` timed steps, then the measured step (from zeroed gradients)."""
    from meshjob_trainer.data import Batch
    from meshjob_trainer.families import build_stage
    from meshjob_trainer.numerics import Numerics
    from meshjob_trainer.pipeline import PipelineExecutor

    plan, m, t = build_plan(job), job.model, job.training
    first, last = job.stages[stage].layers
    module = build_stage(m, first, last, t.seed, numerics=Numerics.of(job, stage))
    forwards = [0]
    for block in module.blocks.values():  # a pre-hook: torch's checkpoint recomputes without the post-hooks
        block.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    rows = t.microbatch_size
    loopback = Loopback((rows, m.seq_len, m.hidden), keep=keep_sent)
    executor = PipelineExecutor(stage, module, plan.schedules[stage], loopback, 1.0 / (t.global_batch * m.seq_len))
    gen = torch.Generator().manual_seed(0)
    batches = [Batch(*torch.randint(m.vocab, (2, rows, m.seq_len), generator=gen)) for _ in range(t.microbatches)]
    times = []
    for _ in range(1 + timed_steps):
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        executor.run_step(batches.__getitem__)
        times.append(time.perf_counter() - start)
    params = list(module.parameters())
    for p in params:  # as in measure_rank: what the measured step allocates is activations
        p.grad = torch.zeros_like(p)
    forwards[0] = 0
    loopback.sent.clear()
    with LiveBytes(exclude=params + [p.grad for p in params]) as live:
        _, stats = executor.run_step(batches.__getitem__)
    per_mb = forwards[0] / (len(module.blocks) * t.microbatches)
    return StageRun(module, live.peak, min(times[1:] or times), per_mb, stats.peak_stashed, dict(loopback.sent))


def schedule_rows(quick: bool) -> list[dict[str, Any]]:
    """Per schedule, recompute off and on: every stage of pipeline_job run alone in this process (real
    compute, one thread); the peak activations of the busiest stage and the compute of a step summed
    over the stages."""
    rows = []
    for schedule, delay in SCHEDULES:
        for recompute in ("none", "full"):
            job = pipeline_job(schedule, delay, recompute, quick)
            runs = [run_stage(job, s, timed_steps=4) for s in range(PIPELINE_STAGES)]
            rows.append(
                {
                    "schedule": schedule,
                    "weight_grad_delay": delay,
                    "delays": {str(s): d for s, d in build_plan(job).weight_delay.items()},
                    "recompute": recompute,
                    "activations": max(r.activations for r in runs),
                    "stage_activations": [r.activations for r in runs],
                    "step_s": sum(r.step_s for r in runs),
                    "forwards_per_block_microbatch": max(r.forwards for r in runs),
                    "stashed": max(r.stashed for r in runs),
                }
            )
    return rows


def schedule_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per schedule (`kind` or `kind+wdelay`): recompute's peak activations and step compute over no recompute's."""
    by = {(r["schedule"], str(r["weight_grad_delay"]), r["recompute"]): r for r in rows}
    out = {}
    for schedule, delay in SCHEDULES:
        full, none = by[(schedule, str(delay), "full")], by[(schedule, str(delay), "none")]
        name = schedule if delay == 0 else f"{schedule}+wdelay"
        out[name] = {
            "activations": full["activations"] / none["activations"],
            "step": full["step_s"] / none["step_s"],
            "forwards_per_block_microbatch": full["forwards_per_block_microbatch"],
        }
    return out


def print_schedules(rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"Recompute per schedule ({PIPELINE_STAGES} stages in one process each, busiest stage, MiB)")
    for col in ("schedule", "W delay", "recompute", "activations", "step compute (s)", "forwards / block / mb"):
        table.add_column(col, justify="left" if col in ("schedule", "recompute") else "right")
    for r in rows:
        table.add_row(
            r["schedule"],
            str(r["weight_grad_delay"]),
            r["recompute"],
            f"{r['activations'] / 2**20:.2f}",
            f"{r['step_s']:.3f}",
            f"{r['forwards_per_block_microbatch']:.2f}",
        )
    Console(width=160).print(table)


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure_rank(env: Any, job: TrainingJob) -> dict[str, float]:
    """One rank: a warm-up step (AdamW creates its state), then the measured step."""
    # the trainer (seconds to import) only where a variant runs: `meshjob bench --help` imports every benchmark
    from meshjob_trainer.dist import WorkerContext, init_distributed, shutdown_distributed
    from meshjob_trainer.parallel import tie_gradients
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.train import _batches, build_runtime, train_step

    torch.set_num_threads(1)
    plan = build_plan(job)
    init_distributed(env, timeout_s=120, expected_world_size=plan.placement.world_size)
    try:
        ctx = WorkerContext(env=env, job=job, plan=plan, stage=0, reshard=ReshardExecutor(plan, env.rank))
        rt = build_runtime(ctx)
        train_step(rt, 0)
        rt.executor.gradients = None  # no reduction starts in the measured backward: its buffers are no activations
        params = list(rt.module.parameters())
        for p in params:  # the gradients exist before the measured step: what it allocates is activations
            p.grad = torch.zeros_like(p)
        with LiveBytes(exclude=params + [p.grad for p in params]) as live:
            _, stats = rt.executor.run_step(_batches(rt, rt.data, 1))
        tie_gradients(rt.module.tied_weights(), rt.groups)
        assert rt.optimizer is not None, "a stage that trains has an optimizer"
        rt.optimizer.reduce_gradients()
        rt.optimizer.step()
        optimizer_state = [t for state in rt.optimizer.optimizer.state.values() for t in state.values()]
        return {
            "rank": env.rank,
            "parameters": _tensor_bytes(params),
            "optimizer": _tensor_bytes(optimizer_state),
            "optimizer_elements": sum(
                p.numel() for group in rt.optimizer.optimizer.param_groups for p in group["params"]
            ),
            "activations": live.peak,
            "stashed": stats.peak_stashed,
        }
    finally:
        shutdown_distributed()


def activation_parts(job: TrainingJob) -> dict[str, int]:
    """A_block and A_rest (see the module docstring) for one microbatch of one rank, and the block
    input (one (rows, seq, hidden) fp32 tensor), measured in this process."""
    # the trainer (seconds to import) only where a variant runs: `meshjob bench --help` imports every benchmark
    from meshjob_trainer.families import build_stage
    from meshjob_trainer.numerics import Numerics

    m, t = job.model, job.training
    rows = t.microbatch_size // job.stages[0].data_parallel
    numerics = Numerics(t.precision)
    stage = build_stage(m, 0, m.layers, t.seed, numerics=numerics)
    tokens = torch.randint(m.vocab, (rows, m.seq_len), generator=torch.Generator().manual_seed(0))
    x = torch.randn(rows, m.seq_len, m.hidden, requires_grad=True)
    params = list(stage.parameters())
    with numerics.autocast("cpu"):
        block = saved_bytes(lambda: stage.blocks["0"](x), params)
    whole = saved_bytes(lambda: stage({"tokens": tokens, "targets": tokens}), params)
    return {"block": block, "rest": whole - m.layers * block, "block_input": rows * m.seq_len * m.hidden * FLOAT32}


@dataclass
class Row:
    precision: str
    recompute: str
    zero: int
    measured: dict[str, float]  # the largest over ranks of each figure
    expected: dict[str, float]


def expected_figures(job: TrainingJob, parts: dict[str, int], stashed: int) -> dict[str, float]:
    m, dp = job.model, job.stages[0].data_parallel
    n = llama_parameters(m)
    zero = job.training.optimizer.zero_stage == 1
    elements = -(-n // dp) if zero else n
    tensors = 1 if zero else _parameter_tensors(m)  # AdamW keeps one step counter per tensor it updates
    per_mb = m.layers * (parts["block_input"] if job.recompute(0) == "full" else parts["block"]) + parts["rest"]
    recomputed = parts["block"] if job.recompute(0) == "full" else 0
    return {
        "parameters": n * FLOAT32,
        "optimizer": 2 * elements * FLOAT32 + tensors * FLOAT32,
        "activations_stashed": stashed * per_mb,
        "activations_recomputed": recomputed,
    }


def _parameter_tensors(m: ModelSpec) -> int:
    return m.layers * 9 + 2  # q k v o gate up down + two norms per block; the embedding and the final norm


def run_variant(precision: str, recompute: str, zero: int, dp: int, quick: bool) -> Row:
    job = bench_job(precision, recompute, zero, dp, quick)
    ranks = launch(dp, lambda ctx: measure_rank(ctx.env, job), timeout_s=600).raise_on_failure().values
    measured = {key: max(r[key] for r in ranks) for key in ("parameters", "optimizer", "activations", "stashed")}
    parts = activation_parts(job)
    expected = expected_figures(job, parts, int(measured["stashed"]))
    return Row(precision, recompute, zero, measured, {**expected, **{f"a_{k}": v for k, v in parts.items()}})


def beyond_stash(row: Row) -> float:
    """Peak activations beyond the stashed ones, in blocks' activations (A_block): the backward's
    temporaries, and with recompute the block being recomputed."""
    return (row.measured["activations"] - row.expected["activations_stashed"]) / row.expected["a_block"]


def blocks_per_stashed_microbatch(row: Row) -> float:
    """Peak activations over (stashed microbatches x A_block)."""
    return row.measured["activations"] / (row.measured["stashed"] * row.expected["a_block"])


def targets(rows: list[Row], dp: int) -> dict[str, float]:
    """ZeRO-1 optimizer bytes over ZeRO-0's / DP (target 1 +- 5%); with recompute, peak activations in
    blocks per stashed microbatch (target <= 1), and the same without recompute (for comparison); what
    recompute holds beyond its stash and the temporaries the same step has without recompute, in blocks."""
    by = {(r.precision, r.recompute, r.zero): r for r in rows}
    zero_ratios, recompute_blocks = [], []
    for (precision, recompute, zero), row in by.items():
        if zero == 1 and (precision, recompute, 0) in by:
            zero_ratios.append(row.measured["optimizer"] / (by[(precision, recompute, 0)].measured["optimizer"] / dp))
        if recompute == "full" and (precision, "none", zero) in by:
            recompute_blocks.append(beyond_stash(row) - beyond_stash(by[(precision, "none", zero)]))
    return {
        "zero1_optimizer_over_zero0_per_dp": max(zero_ratios, key=lambda x: abs(x - 1)),
        "recompute_blocks_per_stashed_microbatch": max(
            blocks_per_stashed_microbatch(r) for r in rows if r.recompute == "full"
        ),
        "no_recompute_blocks_per_stashed_microbatch": min(
            blocks_per_stashed_microbatch(r) for r in rows if r.recompute == "none"
        ),
        "recompute_live_blocks_beyond_stash": max(recompute_blocks),
    }


def print_table(rows: list[Row], goals: dict[str, float], dp: int) -> None:
    table = Table(title=f"Memory per rank (Llama, one stage, DP {dp}, GPipe, MiB; measured / expected)")
    for col in (
        "precision",
        "recompute",
        "ZeRO",
        "parameters",
        "optimizer",
        "activations",
        "stashed",
        "stash expected",
        "blocks / stashed mb",
        "beyond stash (blocks)",
    ):
        table.add_column(col, justify="left" if col in ("precision", "recompute") else "right")
    mib = 2**20
    for r in rows:
        m, e = r.measured, r.expected
        table.add_row(
            r.precision,
            r.recompute,
            str(r.zero),
            f"{m['parameters'] / mib:.2f} / {e['parameters'] / mib:.2f}",
            f"{m['optimizer'] / mib:.3f} / {e['optimizer'] / mib:.3f}",
            f"{m['activations'] / mib:.2f}",
            str(int(m["stashed"])),
            f"{e['activations_stashed'] / mib:.2f}",
            f"{blocks_per_stashed_microbatch(r):.2f}",
            f"{beyond_stash(r):.2f}",
        )
    Console(width=160).print(table)
    print(
        f"ZeRO-1 optimizer bytes / (ZeRO-0's / DP): {goals['zero1_optimizer_over_zero0_per_dp']:.3f} "
        f"(target 1 +- 0.05); peak activations per stashed microbatch with recompute: "
        f"{goals['recompute_blocks_per_stashed_microbatch']:.2f} blocks (target <= 1; without: "
        f"{goals['no_recompute_blocks_per_stashed_microbatch']:.2f}); recompute's live activations beyond its "
        f"stash and the step's temporaries: {goals['recompute_live_blocks_beyond_stash']:.2f} blocks"
    )


def plot(rows: list[Row], path: str) -> None:
    # plotting only: matplotlib is slow to import, and `meshjob bench` imports every benchmark for its --help
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.precision}\n{r.recompute}\nZeRO {r.zero}" for r in rows]
    mib = 2**20
    bottoms = [0.0] * len(rows)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for key, color in (("parameters", "#4c72b0"), ("optimizer", "#dd8452"), ("activations", "#55a868")):
        values = [r.measured[key] / mib for r in rows]
        ax.bar(labels, values, bottom=bottoms, label=key, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("MiB per rank (peak)")
    ax.set_title("meshjob bench memory: parameters + optimizer + activations per rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> int:
    variants = [v for v in VARIANTS if v[0] == "fp32"] if args.quick else VARIANTS
    rows = [run_variant(*variant, args.dp, args.quick) for variant in variants]
    goals = targets(rows, args.dp)
    print_table(rows, goals, args.dp)
    per_schedule = schedule_rows(args.quick)
    print_schedules(per_schedule)
    os.makedirs(args.out, exist_ok=True)
    doc = {
        "dp": args.dp,
        "quick": args.quick,
        "schedule": "gpipe",
        "model": vars(bench_job("fp32", "none", 0, args.dp, args.quick).model),
        "targets": goals,
        "rows": [vars(r) for r in rows],
        "pipeline": {
            "stages": PIPELINE_STAGES,
            "model": vars(pipeline_job("gpipe", 0, "none", args.quick).model),
            "ratios": schedule_ratios(per_schedule),
            "rows": per_schedule,
        },
    }
    doc["pipeline"]["model"] = {k: v for k, v in doc["pipeline"]["model"].items() if k != "config"}
    doc["model"] = {k: v for k, v in doc["model"].items() if k != "config"}
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(doc, f, indent=2)
    plot(rows, os.path.join(args.out, "memory.png"))
    return 0 if all(math.isfinite(v) for v in goals.values()) else 1
