"""The semantic rules of a TrainingJob: what ties fields together (layer ranges, mesh vs topology,
divisibility, tensor parallelism, edge layouts). They run after the structural pass
(meshjob.spec.manifest.parse_job) and skip any field that already failed it, so one mistake is named once."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

from meshjob.errors import SpecError
from meshjob.layout import sharding
from meshjob.spec.api import MASTER_PORT
from meshjob.spec.fields import FieldReader
from meshjob.spec.model import (
    BUILTIN_MODEL_KINDS,
    INIT_MODEL_KINDS,
    MAX_JOB_HOSTS,
    MAX_SCHEDULE_CELLS,
    MAX_STAGE_DEVICES,
    MAX_WORLD_SIZE,
    EdgeSpec,
    ModelSpec,
    StageSpec,
    TrainingJob,
    TrainingSpec,
    default_edges,
    kv_heads_split,
    tensor_parallel_sizes,
)
from meshjob.spec.table import ENTRYPOINT

# ---------------------------------------------------------------------------------------------
# Semantic rules


def check_job(r: FieldReader, job: TrainingJob) -> None:
    """Every semantic rule but the edges' (resolve_edges), each problem recorded in `r`."""
    _check_model(r, job.model)
    _check_data(r, job)
    _check_training(r, job.training)
    _check_stages(r, job)
    _check_size(r, job)
    _check_metrics_ports(r, job)


def _check_model(r: FieldReader, m: ModelSpec) -> None:
    if not r.clean("spec.model.kind"):
        return
    if r.clean("spec.model.init") and m.init is not None and m.kind not in INIT_MODEL_KINDS:
        r.fail(
            "spec.model.init",
            {"kind": m.init.kind, "path": m.init.path},
            f"unset: spec.model.init loads the weights of spec.model.kind {' or '.join(INIT_MODEL_KINDS)} only",
        )
    if m.kind == "custom":
        _check_custom_model(r, m)
        return
    for key, value in (("entrypoint", m.entrypoint), ("config", m.config)):
        if r.clean(f"spec.model.{key}") and value:
            r.fail(f"spec.model.{key}", value, "only with spec.model.kind custom")
    if r.clean("spec.model.heads", "spec.model.hidden") and m.hidden % m.heads:
        r.fail("spec.model.heads", m.heads, f"a divisor of spec.model.hidden ({m.hidden})")
    if m.kind != "llama":
        if r.clean("spec.model.kvHeads") and m.kv_heads is not None and m.kv_heads != m.heads:
            r.fail(
                "spec.model.kvHeads",
                m.kv_heads,
                f"unset or equal to spec.model.heads ({m.heads}): "
                f"grouped-query attention is a spec.model.kind llama feature",
            )
        return
    if r.clean("spec.model.kvHeads", "spec.model.heads") and m.heads % m.key_value_heads:
        r.fail("spec.model.kvHeads", m.kv_heads, f"a divisor of spec.model.heads ({m.heads})")
    if r.clean("spec.model.heads", "spec.model.hidden") and m.hidden % m.heads == 0 and (m.hidden // m.heads) % 2:
        r.fail(
            "spec.model.heads",
            m.heads,
            f"a divisor of spec.model.hidden ({m.hidden}) leaving an even "
            f"head size: rotary embeddings turn pairs of channels",
        )


def _check_custom_model(r: FieldReader, m: ModelSpec) -> None:
    if r.clean("spec.model.entrypoint") and not re.match(ENTRYPOINT, m.entrypoint):
        r.fail(
            "spec.model.entrypoint",
            m.entrypoint,
            "package.module:function, the function returning the model's parts (meshjob_trainer.custom.CustomModel)",
        )
    if r.clean("spec.model.kvHeads") and m.kv_heads is not None:
        r.fail("spec.model.kvHeads", m.kv_heads, "unset: a custom model's attention is its own")


def _check_data(r: FieldReader, job: TrainingJob) -> None:
    d, t = job.data, job.training
    if not r.clean("spec.data.kind"):
        return
    if d.kind == "tokens":
        if r.clean("spec.data.path") and not d.path:
            r.fail("spec.data.path", d.path, "a token file when spec.data.kind is tokens")
        if r.clean("spec.data.valPath", "spec.training.evalEvery") and t.eval_every > 0 and not d.val_path:
            r.fail("spec.data.valPath", d.val_path, "a validation token file when spec.training.evalEvery > 0")
        return
    for key, value in (("path", d.path), ("valPath", d.val_path)):
        if r.clean(f"spec.data.{key}") and value:
            r.fail(f"spec.data.{key}", value, "only with spec.data.kind tokens (synthetic data needs no file)")


def _check_training(r: FieldReader, t: TrainingSpec) -> None:
    if r.clean("spec.training.microbatches", "spec.training.globalBatch") and t.global_batch % t.microbatches:
        r.fail(
            "spec.training.microbatches", t.microbatches, f"a divisor of spec.training.globalBatch ({t.global_batch})"
        )
    if r.clean("spec.training.checkpoint") and t.checkpoint.every > 0 and not t.checkpoint.path:
        r.fail(
            "spec.training.checkpoint.path",
            t.checkpoint.path,
            "a non-empty path when spec.training.checkpoint.every > 0",
        )
    s = t.lr_schedule
    if s is None or not r.clean("spec.training.lrSchedule"):
        return
    if r.clean("spec.training.steps") and s.warmup_steps > t.steps:
        r.fail("spec.training.lrSchedule.warmupSteps", s.warmup_steps, f"at most spec.training.steps ({t.steps})")
    if r.clean("spec.training.learningRate") and s.min_lr > t.learning_rate:
        r.fail("spec.training.lrSchedule.minLr", s.min_lr, f"at most spec.training.learningRate ({t.learning_rate})")


def _check_stages(r: FieldReader, job: TrainingJob) -> None:
    """Layer ranges, meshes vs topology, parallel dims vs model and batch."""
    m, t = job.model, job.training
    expect = 0  # where the next stage's layer range must begin
    ranges_ok = r.clean("spec.model.layers")
    for i, st in enumerate(job.stages):
        p = f"spec.stages[{i}]"
        if not r.clean(f"{p}.layers"):
            ranges_ok = False
        elif ranges_ok:
            first, last = st.layers
            if first != expect or last <= first:
                r.fail(
                    f"{p}.layers",
                    list(st.layers),
                    f"a non-empty range [{expect}, n) with {expect} < n <= {m.layers}: "
                    f"stages cover [0, spec.model.layers) contiguously, in order",
                )
                ranges_ok = False
            elif last > m.layers:
                r.fail(f"{p}.layers", list(st.layers), f"a range ending at most at spec.model.layers ({m.layers})")
                ranges_ok = False
            else:
                expect = last
        if not r.clean(f"{p}.mesh"):
            continue
        if st.size > MAX_STAGE_DEVICES:
            r.fail(f"{p}.mesh", list(st.mesh), f"a mesh of at most {MAX_STAGE_DEVICES} devices")
            continue
        per_host = math.prod(st.mesh[1:])
        if r.clean("spec.topology.devicesPerHost") and per_host > job.topology.devices_per_host:
            r.fail(
                f"{p}.mesh",
                list(st.mesh),
                f"mesh dims after dim 0 (dim 0 runs across hosts) multiply to at most "
                f"spec.topology.devicesPerHost ({job.topology.devices_per_host}), got {per_host}",
            )
        dims = len(st.mesh)
        for key, dim in (("dataParallelDim", st.data_parallel_dim), ("tensorParallelDim", st.tensor_parallel_dim)):
            if r.clean(f"{p}.{key}") and dim is not None and dim >= dims:
                r.fail(f"{p}.{key}", dim, f"a mesh dim in 0..{dims - 1} (spec.stages[{i}].mesh has {dims} dims)")
        _check_data_parallel_dims(r, st, p)
        dp_key = "dataParallelDims" if st.data_parallel_dims is not None else "dataParallelDim"
        dp_ok = r.clean(f"{p}.dataParallelDim", f"{p}.dataParallelDims")
        dp, tp = st.dp_dims, st.tensor_parallel_dim
        if dp_ok and r.clean(f"{p}.tensorParallelDim") and tp is not None and tp in dp:
            written = list(dp) if st.data_parallel_dims is not None else dp[0]
            r.fail(f"{p}.tensorParallelDim", tp, f"a mesh dim other than {dp_key} ({written})")
        if r.clean(f"{p}.tensorParallelDim", "spec.model.kind") and tp is not None and tp < dims:
            _check_tensor_parallel(r, m, f"{p}.mesh[{tp}]", st.mesh[tp])
        if (
            dp_ok
            and r.clean("spec.training")
            and dp
            and t.global_batch % t.microbatches == 0
            and t.microbatch_size % st.data_parallel
        ):
            path, value = (f"{p}.mesh[{dp[0]}]", st.mesh[dp[0]]) if len(dp) == 1 else (f"{p}.mesh", list(st.mesh))
            sizes = "" if len(dp) == 1 else f" (mesh dims {list(dp)} multiply to {st.data_parallel})"
            r.fail(
                path,
                value,
                f"a data-parallel degree{sizes} dividing the microbatch "
                f"size {t.microbatch_size} (spec.training.globalBatch / microbatches)",
            )
    if ranges_ok and job.stages and expect != m.layers:
        i = len(job.stages) - 1
        r.fail(
            f"spec.stages[{i}].layers",
            list(job.stages[i].layers),
            f"a range ending at spec.model.layers ({m.layers}): stages cover every layer",
        )


def _check_data_parallel_dims(r: FieldReader, st: StageSpec, p: str) -> None:
    """dataParallelDims: mesh dims of this mesh, each once, in increasing order (the order of the trainer's
    data-parallel ranks and of the batch's tiles is then the mesh's row-major one); not with dataParallelDim."""
    dims, key = st.data_parallel_dims, f"{p}.dataParallelDims"
    if dims is None or not r.clean(key):
        return
    if st.data_parallel_dim is not None:
        r.fail(
            key,
            list(dims),
            f"unset when dataParallelDim is set ({st.data_parallel_dim}): write one of them, dataParallelDim d "
            f"(one mesh dim, the same as dataParallelDims [d]) or dataParallelDims (several, e.g. [0, 1])",
        )
    elif any(d >= len(st.mesh) for d in dims):
        r.fail(key, list(dims), f"mesh dims in 0..{len(st.mesh) - 1} ({p}.mesh has {len(st.mesh)} dims)")
    elif any(a >= b for a, b in zip(dims, dims[1:])):
        r.fail(
            key,
            list(dims),
            "distinct mesh dims in increasing order, e.g. [0, 1]: the batch splits over the first (major), "
            "then within each part over the next",
        )


def _check_size(r: FieldReader, job: TrainingJob) -> None:
    """Bounds on the whole job: devices, hosts and schedule size grow with several fields at once."""
    if not r.clean("spec.stages"):
        return
    world = sum(st.size for st in job.stages)
    if world > MAX_WORLD_SIZE:
        r.fail("spec.stages", f"{world} devices", f"at most {MAX_WORLD_SIZE} devices in all stages' meshes")
    hosts = sum(st.mesh[0] for st in job.stages)
    if hosts > MAX_JOB_HOSTS:
        r.fail("spec.stages", f"{hosts} hosts", f"at most {MAX_JOB_HOSTS} hosts (mesh dim 0) in all stages")
    cells = len(job.stages) * job.training.microbatches
    if r.clean("spec.training.microbatches") and cells > MAX_SCHEDULE_CELLS:
        r.fail(
            "spec.training.microbatches",
            job.training.microbatches,
            f"at most {MAX_SCHEDULE_CELLS // len(job.stages)} with {len(job.stages)} stages (stages x "
            f"microbatches at most {MAX_SCHEDULE_CELLS})",
        )


# Fixed ports of a trainer pod besides the metrics ports: the API refuses a pod whose container ports clash or
# pass 65535, and the operator would retry creating it forever (meshjob_operator/render.py names them all).
POD_FIXED_PORTS = {MASTER_PORT: "the trainer pod's rendezvous port (MASTER_PORT)"}
MAX_PORT = 65535


def _check_metrics_ports(r: FieldReader, job: TrainingJob) -> None:
    """Local rank r serves on spec.metrics.port + r: the whole range, one port per device of a host, must be valid."""
    if not r.clean("spec.metrics.port", "spec.topology.devicesPerHost"):
        return
    first, n = job.metrics.port, job.topology.devices_per_host
    ranks = f"local rank r serves on spec.metrics.port + r for r in 0..{n - 1} (spec.topology.devicesPerHost is {n})"
    if first + n - 1 > MAX_PORT:
        r.fail("spec.metrics.port", first, f"a port in 1..{MAX_PORT - n + 1}: {ranks}, and ports end at {MAX_PORT}")
        return
    for port, what in POD_FIXED_PORTS.items():
        if first <= port <= first + n - 1:
            r.fail(
                "spec.metrics.port",
                first,
                (f"a port p whose range p..p+{n - 1} leaves out " if n > 1 else "a port other than ")
                + f"{port}, {what}: at most {port - n} or at least {port + 1}; {ranks}",
            )


def _check_tensor_parallel(r: FieldReader, m: ModelSpec, path: str, degree: int) -> None:
    if m.kind not in BUILTIN_MODEL_KINDS:
        if degree > 1:
            r.fail(
                path,
                degree,
                f"a tensor-parallel degree of 1: tensor parallelism is for the built-in families "
                f"({', '.join(BUILTIN_MODEL_KINDS)}); a custom model runs pipeline and data parallel",
            )
        return
    for key, size in tensor_parallel_sizes(m).items():
        if r.clean(f"spec.model.{key}") and size % degree:
            r.fail(path, degree, f"a tensor-parallel degree dividing spec.model.{key} ({size})")
    if m.kind == "llama" and r.clean("spec.model.kvHeads", "spec.model.heads") and not kv_heads_split(m, degree):
        kv = m.key_value_heads
        r.fail(
            path,
            degree,
            f"a tensor-parallel degree dividing spec.model.kvHeads ({kv}) or a multiple of it (each key/value "
            f"head then replicated on degree / {kv} ranks)",
        )


def resolve_edges(r: FieldReader, job: TrainingJob, raw: Sequence[EdgeSpec] | None) -> tuple[EdgeSpec, ...]:
    """The model's edges (defaults) with the user's layout overrides applied and checked."""
    defaults = default_edges(job.model, job.stages)
    if raw is None:
        return defaults
    index = {(e.src, e.dst, e.tensor): k for k, e in enumerate(defaults)}
    edges = list(defaults)
    seen: set[tuple[int, int, str]] = set()
    shape = job.activation_shape()
    for n, e in enumerate(raw):
        p = f"spec.edges[{n}]"
        if not r.clean(p):
            continue
        n_stages = len(job.stages)
        bad = False
        for key, stage in (("from", e.src), ("to", e.dst)):
            if stage >= n_stages:
                r.fail(f"{p}.{key}", stage, f"a stage index in 0..{n_stages - 1}")
                bad = True
        if bad:
            continue
        if e.src >= e.dst:
            r.fail(f"{p}.to", e.dst, f"a stage after from ({e.src}): edges run forward in layer order")
            continue
        edge = (e.src, e.dst, e.tensor)
        if edge not in index:
            known = ", ".join(f"{a}->{b} {t}" for a, b, t in index)
            r.fail(p, {"from": e.src, "to": e.dst, "tensor": e.tensor}, f"an edge of the model: {known}")
            continue
        if edge in seen:
            r.fail(p, {"from": e.src, "to": e.dst, "tensor": e.tensor}, "each edge listed once")
            continue
        seen.add(edge)
        default = defaults[index[edge]]
        send = _check_layout(r, f"{p}.send", e.send, default.send, job.stages[e.src], e.src, shape, "source")
        recv = _check_layout(r, f"{p}.recv", e.recv, default.recv, job.stages[e.dst], e.dst, shape, "destination")
        edges[index[edge]] = EdgeSpec(e.src, e.dst, send, recv, e.tensor)
    return tuple(edges)


def _check_layout(
    r: FieldReader,
    path: str,
    text: str | None,
    natural: str,
    stage: StageSpec,
    index: int,
    shape: tuple[int, int, int],
    role: str,
) -> str:
    """Canonical form of a user layout, checked against the stage's mesh and natural layout."""
    if text is None:
        return natural
    try:
        spec = sharding.ShardingSpec.parse(text, ndim=len(shape), path=path)
    except SpecError as err:
        for problem in err.errors:
            r.fail(
                problem.path,
                problem.value,
                f"{problem.allowed}; e.g. {natural} (the activation is (batch, seq, hidden))",
            )
        return natural
    except ValueError as err:
        r.fail(
            path,
            text,
            f"a sharding spec with one token per activation dim (batch, seq, hidden), e.g. {natural}: {_reason(err)}",
        )
        return natural
    problems = sharding.check_spec(spec, stage.mesh, shape, path)
    if problems:
        for problem in problems:
            r.errors.append(problem)
            r.bad.add(problem.path)
        return natural
    if not _nests(str(spec), natural, stage.mesh, shape):
        r.fail(
            path,
            text,
            f"a layout at least as sharded as the {role} stage {index}'s natural "
            f"layout {natural} (its tiles must nest in those tiles)",
        )
        return natural
    return str(spec)


@functools.lru_cache(maxsize=4096)
def _nests(finer: str, coarser: str, mesh: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether layout `finer`'s tiles nest in `coarser`'s. It walks every device of the mesh and
    up to 640 edges may ask it about the same few layouts: remembered."""
    return sharding.at_least_as_sharded(
        sharding.ShardingSpec.parse(finer, len(shape)), sharding.ShardingSpec.parse(coarser, len(shape)), mesh, shape
    )


def _reason(err: Exception) -> str:
    if isinstance(err, SpecError) and err.errors:
        return "; ".join(e.allowed for e in err.errors)
    return str(err)
