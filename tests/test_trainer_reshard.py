"""The resharding executor moves real tensors between real gloo processes, for every strategy.

Boundaries are built here by the plan layer's plan_boundary (decompose, balance, lower) between two
meshes, so these tests need no whole job. Every rank makes the same random
global tensor from a seed; sources pass their natural tile, destinations compare what arrives
with the tile they should hold.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec, slice_shape, tile, to_index
from meshjob.plan.build import Boundary, plan_boundary
from meshjob.resharding.strategies import STRATEGIES
from meshjob.resharding.tasks import Step
from meshjob.schedule.boundary import BoundaryKey
from meshjob.spec.manifest import ReshardingSpec
from meshjob_trainer.dist import init_distributed, shutdown_distributed
from meshjob_trainer.reshard import ReshardExecutor
from meshjob_trainer.route import ReshardError, make_routes

NIC_BYTES_PER_S = 1e9 / 8


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    src: Mesh
    src_natural: str
    send: str
    dst: Mesh
    recv: str
    dst_natural: str

    @property
    def world_size(self) -> int:
        return self.src.size + self.dst.size


def mesh(shape: tuple[int, ...], first_rank: int, hosts: tuple[int, ...] | None = None, first_host: int = 0) -> Mesh:
    m = Mesh.grid(shape, first_rank, first_host)
    return m if hosts is None else Mesh(m.shape, m.ranks, hosts)


CASES = [
    Case("2x2 S01R -> 2x2 S0R", (8, 6), mesh((2, 2), 0), "S01R", "S01R", mesh((2, 2), 4, first_host=2), "S0R", "S0R"),
    Case("1x1 RRR -> 2x2 RRR", (4, 4, 6), mesh((1, 1), 0), "RRR", "RRR", mesh((2, 2), 1, first_host=1), "RRR", "RRR"),
    Case(
        "2x2 RS1 -> 1x4 S1R (2 hosts -> 1)",
        (8, 8),
        mesh((2, 2), 0),
        "RS1",
        "RS1",
        mesh((1, 4), 4, first_host=2),
        "S1R",
        "S1R",
    ),
    Case(
        "1x2 S1RR -> 2x1 S0RR (1 host -> 2)",
        (4, 6, 4),
        mesh((1, 2), 0),
        "S1RR",
        "S1RR",
        mesh((2, 1), 2, first_host=1),
        "S0RR",
        "S0RR",
    ),
    Case(
        "2x1 RRR -> 3x2 RRR (chain over 3 hosts)",
        (2, 4, 6),
        mesh((2, 1), 0),
        "RRR",
        "RRR",
        mesh((3, 2), 2, first_host=2),
        "RRR",
        "RRR",
    ),
    Case(
        "send slices natural, recv gathered: 1x2 RRR/RS1R -> 2x2 S01RR/S0RR",
        (4, 4, 6),
        mesh((1, 2), 0),
        "RRR",
        "RS1R",
        mesh((2, 2), 2, first_host=1),
        "S01RR",
        "S0RR",
    ),
    Case(
        "stages share a host: 1x2 RS1 -> 2x2 S0R",
        (4, 8),
        mesh((1, 2), 0),
        "RS1",
        "RS1",
        mesh((2, 2), 2, hosts=(0, 0, 1, 1)),
        "S0R",
        "S0R",
    ),
]


def host_of(case: Case):
    return {r: h for m in (case.src, case.dst) for r, h in zip(m.ranks, m.hosts)}.__getitem__


def make_boundary(case: Case, strategy: str, chunks: int = 3, tensor: str = "activation") -> Boundary:
    send, recv = ShardingSpec.parse(case.send), ShardingSpec.parse(case.recv)
    return plan_boundary(
        BoundaryKey(0, 1, tensor),
        case.shape,
        (case.src, send),
        (case.dst, recv),
        ReshardingSpec(strategy, chunks, "load_balance"),
        host_of(case),
        NIC_BYTES_PER_S,
    )


def executor(
    case: Case, boundaries: list[Boundary], rank: int, metrics=None, cpu_wire: str = "gloo"
) -> ReshardExecutor:
    routes = make_routes(boundaries, {0: case.src, 1: case.dst}, {0: case.src_natural, 1: case.dst_natural})
    return ReshardExecutor(None, rank, metrics, routes=routes, cpu_wire=cpu_wire)


def global_tensor(case: Case, seed: int) -> torch.Tensor:
    return torch.randn(case.shape, generator=torch.Generator().manual_seed(seed))


def natural_tile(case: Case, full: torch.Tensor, rank: int) -> torch.Tensor | None:
    for m, natural in ((case.src, case.src_natural), (case.dst, case.dst_natural)):
        if rank in m.ranks:
            t = tile(ShardingSpec.parse(natural), m.shape, case.shape, m.index_of(rank))
            return full[to_index(t)].clone()
    return None


def reshard_once(case: Case, strategy: str, seed: int = 7, cpu_wire: str = "gloo"):
    """Target run by every rank: returns (rank, outcome) where outcome says what arrived."""
    boundary = make_boundary(case, strategy)

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = executor(case, [boundary], env.rank, cpu_wire=cpu_wire)
            full = global_tensor(case, seed)
            mine = natural_tile(case, full, env.rank)
            local = mine if env.rank in case.src.ranks else None
            handle = ex.start(boundary.key, 0, local)
            got = handle.wait(timeout_s=30)
            ex.close()
            if env.rank in case.src.ranks:
                return env.rank, "sender", got is None
            return (
                env.rank,
                "receiver",
                (
                    got.shape == mine.shape,
                    handle.delivered and torch.equal(got, mine),
                    sum(handle.stats.bytes_received.values()),
                ),
            )
        finally:
            shutdown_distributed()

    return target


@pytest.mark.slow
@pytest.mark.parametrize("cpu_wire", ["gloo", "tcp"])
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "signal"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_strategy_delivers_the_exact_destination_tile(gang, case: Case, strategy: str, cpu_wire: str):
    results = gang(case.world_size, reshard_once(case, strategy, cpu_wire=cpu_wire))
    for rank, role, outcome in results:
        if role == "sender":
            assert outcome, f"rank {rank} is a source: wait() must return None"
        else:
            same_shape, equal, nbytes = outcome
            assert same_shape and equal, f"rank {rank} got a wrong tile with {strategy} on {case.name}"
            assert nbytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:5], ids=[c.name for c in CASES[:5]])
def test_signal_keeps_dependencies_delivers_no_data_and_does_not_hang(gang, case: Case):
    boundary = make_boundary(case, "signal")
    results = gang(case.world_size, reshard_once(case, "signal"))
    for rank, role, outcome in results:
        if role == "receiver":
            same_shape, equal, nbytes = outcome
            assert same_shape and not equal, "signal returns a placeholder of the natural shape, no data"
            arriving = [s for s in boundary.steps if s.dst == rank]
            assert nbytes >= len(arriving) > 0 and all(s.signal for s in arriving)


@pytest.mark.slow
def test_microbatches_in_flight_together_do_not_mix(gang):
    case = CASES[4]
    boundary = make_boundary(case, "broadcast", chunks=4)

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = executor(case, [boundary], env.rank)
            handles, expected = [], []
            for mb in range(3):
                mine = natural_tile(case, global_tensor(case, 100 + mb), env.rank)
                expected.append(mine)
                local = mine if env.rank in case.src.ranks else None
                handles.append(ex.start(boundary.key, mb, local))
            got = [h.wait(timeout_s=30) for h in reversed(handles)][::-1]
            if env.rank in case.src.ranks:
                return all(g is None for g in got)
            return all(torch.equal(g, e) for g, e in zip(got, expected))
        finally:
            shutdown_distributed()

    assert all(gang(case.world_size, target))


@pytest.mark.slow
def test_a_forwarding_rank_passes_chunks_on_before_it_calls_wait(gang, tmp_path):
    """The middle host of a broadcast chain does not call wait() until the last host has its
    data: forwarding must progress on the handle's own thread (as while the stage computes)."""
    import time

    case = CASES[4]  # destination hosts 2, 3, 4; ranks 2-3, 4-5, 6-7
    boundary = make_boundary(case, "broadcast", chunks=4)
    middle, last = (4, 5), (6, 7)
    assert {s.src for s in boundary.steps if s.dst in last and s.src not in last} <= set(middle)  # chain via it

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = executor(case, [boundary], env.rank)
            mine = natural_tile(case, global_tensor(case, 5), env.rank)
            handle = ex.start(boundary.key, 0, mine if env.rank in case.src.ranks else None)
            if env.rank in middle:
                deadline = time.monotonic() + 20
                while not all((tmp_path / f"done-{r}").exists() for r in last):
                    assert time.monotonic() < deadline, "the last host never got its data"
                    time.sleep(0.02)
            got = handle.wait(timeout_s=30)
            if env.rank in last:
                (tmp_path / f"done-{env.rank}").write_text("ok")
            return got is None or torch.equal(got, mine)
        finally:
            shutdown_distributed()

    assert all(gang(case.world_size, target))


@pytest.mark.slow
def test_receiver_records_bytes_per_scope_in_trainer_metrics(gang):
    case = CASES[6]  # one destination host shared with the source, one not
    boundary = make_boundary(case, "send_recv")

    def target(env):
        from meshjob_trainer.metrics import TrainerMetrics

        init_distributed(env, timeout_s=20)
        try:
            metrics = TrainerMetrics(job="t", rank=env.rank, host=str(env.rank), stage=0)
            ex = executor(case, [boundary], env.rank, metrics)
            local = natural_tile(case, global_tensor(case, 1), env.rank) if env.rank in case.src.ranks else None
            ex.start(boundary.key, 0, local).wait(timeout_s=30)
            return {
                scope: metrics.registry.get_sample_value(
                    "meshjob_resharding_bytes_total",
                    {
                        "trainingjob": "t",
                        "namespace": "default",
                        "strategy": "send_recv",
                        "scope": scope,
                        "boundary": "0->1:activation",
                    },
                )
                or 0.0
                for scope in ("intra_host", "cross_host")
            }
        finally:
            shutdown_distributed()

    recorded = gang(case.world_size, target)
    for scope in ("intra_host", "cross_host"):
        expected = sum(s.nbytes() for s in boundary.steps if s.scope == scope)
        assert sum(r[scope] for r in recorded) == expected > 0


@pytest.mark.slow
def test_bytes_sent_per_host_pair_add_up_to_the_plans_nic_bytes(gang):
    from meshjob.resharding.tasks import nic_bytes

    case = CASES[4]  # 2 source hosts, a chain over 3 destination hosts
    boundary = make_boundary(case, "broadcast", chunks=4)

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = executor(case, [boundary], env.rank)
            local = natural_tile(case, global_tensor(case, 3), env.rank) if env.rank in case.src.ranks else None
            handle = ex.start(boundary.key, 0, local)
            handle.wait(timeout_s=30)
            return handle.stats.host_pair_bytes
        finally:
            shutdown_distributed()

    seen: dict[int, list[int]] = {}
    for pairs in gang(case.world_size, target):
        for (src_host, dst_host), nbytes in pairs.items():
            if src_host != dst_host:
                seen.setdefault(src_host, [0, 0])[0] += nbytes
                seen.setdefault(dst_host, [0, 0])[1] += nbytes
    assert {h: tuple(v) for h, v in seen.items()} == nic_bytes(boundary.steps, host_of(case))


def test_a_forward_before_its_data_arrived_is_rejected():
    case = CASES[4]
    good = make_boundary(case, "broadcast", chunks=1)
    forwards = [s for s in good.steps if s.src in case.dst.ranks]
    broken = tuple(
        s if s is not forwards[0] else Step(s.id, s.task, s.src, s.dst, s.region, (), s.scope) for s in good.steps
    )
    with pytest.raises(ReshardError, match=rf"step {forwards[0].id} has rank {forwards[0].src} forward region"):
        executor(case, [dataclasses.replace(good, steps=broken)], 0)


def test_a_receiver_left_without_part_of_its_tile_is_rejected():
    case = CASES[0]
    good = make_boundary(case, "send_recv")
    dropped = good.steps[0]
    partial = dataclasses.replace(good, steps=good.steps[1:])
    with pytest.raises(ReshardError, match=rf"rank {dropped.dst} would never receive"):
        executor(case, [partial], dropped.dst)


def test_a_source_tile_of_the_wrong_shape_is_a_clear_error():
    case = CASES[0]
    boundary = make_boundary(case, "send_recv")
    ex = executor(case, [boundary], 0)
    with pytest.raises(ReshardError, match=r"rank 0 must pass its natural-layout \(S01R\) tile of shape \(2, 6\)"):
        ex.start(boundary.key, 0, torch.zeros(8, 6))


def test_two_boundaries_with_the_same_endpoints_and_tensor_are_rejected():
    case = CASES[1]
    with pytest.raises(ReshardError, match=r"two boundaries share the key 0->1:activation"):
        executor(case, [make_boundary(case, "broadcast"), make_boundary(case, "send_recv")], 0)


def test_tag_ranges_of_boundaries_and_microbatches_do_not_overlap():
    case = CASES[1]
    a, b = make_boundary(case, "broadcast"), make_boundary(case, "send_recv", tensor="skip0")
    ex = executor(case, [a, b], 0)
    spans = [
        (ex.tag_base(x.key, mb), ex.tag_base(x.key, mb) + ex.route(x.key).tag_span) for x in (a, b) for mb in range(4)
    ]
    spans.sort()
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "signal"])
def test_every_boundary_of_a_planned_utransformer_is_resharded_exactly(gang, strategy):
    """Routes from a real Plan: natural layouts from the spec, skip and gradient edges included."""
    import dataclasses
    from pathlib import Path

    from meshjob.plan.build import build_plan
    from meshjob.spec.manifest import load_job, natural_layout

    job = load_job(str(Path(__file__).resolve().parents[1] / "examples" / "utransformer-demo.yaml"))
    job = dataclasses.replace(job, resharding=dataclasses.replace(job.resharding, strategy=strategy, chunks=3))
    plan = build_plan(job)
    assert any(b.key.tensor.startswith("skip") for b in plan.boundaries)

    def natural(stage: int, full: torch.Tensor, rank: int) -> torch.Tensor:
        m = plan.mesh(stage)
        spec = ShardingSpec.parse(natural_layout(job.stages[stage]), full.dim())
        return full[to_index(tile(spec, m.shape, tuple(full.shape), m.index_of(rank)))].clone()

    def target(env):
        init_distributed(env, timeout_s=20)
        try:
            ex = ReshardExecutor(plan, env.rank, order=None)  # one transfer at a time, not the step's order
            wrong = []
            for i, b in enumerate(plan.boundaries):
                full = torch.randn(b.shape, generator=torch.Generator().manual_seed(i))
                src, dst = plan.mesh(b.src).ranks, plan.mesh(b.dst).ranks
                local = natural(b.src, full, env.rank) if env.rank in src else None
                got = ex.start(b.key, 0, local).wait(timeout_s=30)
                if env.rank in dst and not torch.equal(got, natural(b.dst, full, env.rank)):
                    wrong.append(str(b.key))
            return wrong
        finally:
            shutdown_distributed()

    assert gang(plan.placement.world_size, target) == [[]] * plan.placement.world_size


# --- device-native: payloads never leave the context's device ---------------------------------


class FakeWire:
    """Stands in for a wire in one process (a test double of meshjob_trainer.wire.Wire): every message
    completes at once, receives are filled with ones; it records what crosses it, and the calls that
    order the engine's device work around the compute stream, with the thread that made them."""

    def __init__(self, device: str = "cpu") -> None:
        import threading

        self.device = torch.device(device)
        self.sent: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []
        self.calls: list[tuple[str, Any, str]] = []  # (call, its mark, thread name)
        self._thread = threading.current_thread
        self._marks = 0

    def _call(self, name: str, mark: Any = None) -> Any:
        self.calls.append((name, mark, self._thread().name))
        return mark

    def isend(self, tensor, peer, tag, message):
        self._call("send")
        self.sent.append(tensor)

    def irecv(self, tensor, peer, tag, message):
        self._call("recv")
        self.received.append(tensor)
        tensor.fill_(1)

    def wait(self, work) -> None:
        pass

    def engine_stream(self):
        import contextlib

        return contextlib.nullcontext()

    def mark(self):
        self._marks += 1
        return self._call("mark", f"mark{self._marks}")

    def after(self, mark) -> None:
        self._call("after", mark)

    def hand_over(self):
        self._marks += 1
        return self._call("hand_over", f"mark{self._marks}")

    def accept(self, tensor, mark) -> None:
        self._call("accept", mark)


def run_alone(case: Case, boundary: Boundary, rank: int, wire: FakeWire, local=None, device: str = "cpu"):
    routes = make_routes([boundary], {0: case.src, 1: case.dst}, {0: case.src_natural, 1: case.dst_natural})
    ex = ReshardExecutor(None, rank, routes=routes, device=device, wire=wire)
    try:
        return ex.start(boundary.key, 0, local).wait(timeout_s=10)
    finally:
        ex.close()


FAKE_CASES = [(CASES[4], "broadcast"), (CASES[5], "broadcast"), (CASES[0], "global_allgather")]


@pytest.mark.parametrize("case,strategy", FAKE_CASES, ids=[f"{c.name} {s}" for c, s in FAKE_CASES])
def test_every_payload_stays_on_the_context_device(case: Case, strategy: str):
    """Sources, forwarding receivers and intra-mesh gathers alike hand the wire tensors of the
    context's device: no staging through the CPU ("meta" stands in for CUDA on this machine)."""
    boundary = make_boundary(case, strategy)
    wire = FakeWire("meta")
    for rank in (*case.src.ranks, *case.dst.ranks):
        local = None
        if rank in case.src.ranks:
            m = case.src
            local = torch.empty(
                slice_shape(tile(ShardingSpec.parse(case.src_natural), m.shape, case.shape, m.index_of(rank))),
                device="meta",
            )
        got = run_alone(case, boundary, rank, wire, local, device="meta")
        if rank in case.dst.ranks:
            want = natural_tile(case, global_tensor(case, 0), rank)
            assert got.device.type == "meta" and got.shape == want.shape and got.dtype == torch.float32
    assert wire.sent and wire.received
    assert {t.device.type for t in wire.sent + wire.received} == {"meta"}


def test_a_source_sends_views_of_its_tile_not_copies():
    case = CASES[0]
    boundary = make_boundary(case, "send_recv")
    wire = FakeWire()
    full = global_tensor(case, 4)
    mine = natural_tile(case, full, 0)
    run_alone(case, boundary, 0, wire, mine)
    mine_steps = [s for s in boundary.steps if s.src == 0]
    assert len(wire.sent) == len(mine_steps) > 0
    assert {t.untyped_storage().data_ptr() for t in wire.sent} == {mine.untyped_storage().data_ptr()}
    program = boundary_program(case, boundary, 0)
    for step, payload in zip(program, wire.sent):
        assert torch.equal(payload, full[to_index(step.region)])


def boundary_program(case: Case, boundary: Boundary, rank: int):
    from meshjob.network.model import NetworkModel
    from meshjob.plan.program import rank_programs

    return rank_programs(boundary.steps, host_of(case), NetworkModel())[rank].sends


def test_the_engine_reads_a_source_only_after_the_compute_stream_produced_it():
    """mark on the compute thread when the tile is handed over, the engine's stream waits for that
    mark before its first send (on CUDA: an event the engine's stream waits on)."""
    case = CASES[0]
    boundary = make_boundary(case, "send_recv")
    wire = FakeWire()
    run_alone(case, boundary, 0, wire, natural_tile(case, global_tensor(case, 4), 0))
    names = [c[0] for c in wire.calls]
    assert names[:3] == ["mark", "after", "send"] and wire.calls[0][1] == wire.calls[1][1]
    assert wire.calls[0][2] != wire.calls[1][2]  # marked by the caller, waited for by the engine's thread


def test_the_compute_stream_uses_a_result_only_after_the_engine_assembled_it():
    case = CASES[5]  # the destination gathers inside its mesh: the result is assembled by the engine
    boundary = make_boundary(case, "broadcast")
    wire = FakeWire()
    rank = case.dst.ranks[0]
    run_alone(case, boundary, rank, wire)
    handed = [c for c in wire.calls if c[0] == "hand_over"]
    accepted = [c for c in wire.calls if c[0] == "accept"]
    assert len(handed) == len(accepted) == 1 and handed[0][1] == accepted[0][1]
    assert accepted[0][2] != handed[0][2]  # accepted by the caller's thread, handed over by the engine's
    assert [c[0] for c in wire.calls].index("hand_over") > max(i for i, c in enumerate(wire.calls) if c[0] == "recv")


# --- what the executor records for the dashboard --------------------------------------------


def recorded_metrics(gang, case: Case, boundary: Boundary):
    """Runs `boundary` once; each rank returns (rank, host name, its metrics' samples)."""

    def target(env):
        from meshjob_trainer.metrics import TrainerMetrics

        init_distributed(env, timeout_s=20)
        try:
            host = f"host-{host_of(case)(env.rank)}"
            metrics = TrainerMetrics(job="t", rank=env.rank, host=host, stage=0)
            ex = executor(case, [boundary], env.rank, metrics)
            local = natural_tile(case, global_tensor(case, 1), env.rank) if env.rank in case.src.ranks else None
            ex.start(boundary.key, 0, local).wait(timeout_s=30)
            get = metrics.registry.get_sample_value
            return (
                env.rank,
                host,
                get(
                    "meshjob_nic_bandwidth_bytes_per_second", {"trainingjob": "t", "namespace": "default", "host": host}
                ),
                get(
                    "meshjob_resharding_lower_bound_ratio",
                    {"trainingjob": "t", "namespace": "default", "boundary": "0->1:activation"},
                ),
                get(
                    "meshjob_unit_tasks_total", {"trainingjob": "t", "namespace": "default", "balancer": "load_balance"}
                ),
            )
        finally:
            shutdown_distributed()

    return gang(case.world_size, target)


@pytest.mark.slow
def test_receivers_across_hosts_record_their_hosts_nic_bandwidth(gang):
    case = CASES[6]  # destination ranks 2, 3 share host 0 with the sources; 4, 5 are on host 1
    boundary = make_boundary(case, "send_recv")
    cross = {s.dst for s in boundary.steps if s.scope == "cross_host"}
    assert cross == {4, 5}
    for rank, host, nic, _ratio, _tasks in recorded_metrics(gang, case, boundary):
        if rank in cross:
            assert nic is not None and nic > 0, f"rank {rank} on {host} recorded no NIC bandwidth"
        else:
            assert nic is None, f"rank {rank} moved nothing across hosts but recorded {nic} B/s"


@pytest.mark.slow
def test_receivers_record_time_over_the_lower_bound_and_senders_count_unit_tasks(gang):
    case = CASES[0]
    boundary = make_boundary(case, "broadcast")
    results = recorded_metrics(gang, case, boundary)
    ratios = {rank: ratio for rank, _host, _nic, ratio, _tasks in results}
    assert all(ratios[r] is not None and ratios[r] > 0 for r in case.dst.ranks)
    assert all(ratios[r] is None for r in case.src.ranks)
    assert sum(tasks or 0 for *_rest, tasks in results) == len({s.task for s in boundary.steps})


class ForgetfulWire(FakeWire):
    """A FakeWire that keeps none of the tensors it carries."""

    def isend(self, tensor, peer, tag, message):
        self._call("send")

    def irecv(self, tensor, peer, tag, message):
        self._call("recv")
        tensor.fill_(1)


def test_a_finished_transfer_frees_its_buffers_when_the_compute_drops_the_result():
    """Not whenever Python's cyclic collector next runs: a rank that allocates few Python objects
    kept the payloads of hundreds of transfers (the job and its handle refer to each other)."""
    import gc
    import weakref

    case = CASES[1]
    boundary = make_boundary(case, "broadcast")
    routes = make_routes([boundary], {0: case.src, 1: case.dst}, {0: case.src_natural, 1: case.dst_natural})
    ex = ReshardExecutor(None, case.dst.ranks[0], routes=routes, wire=ForgetfulWire())  # it also forwards
    gc.disable()
    try:
        handle = ex.start(boundary.key, 0, None)
        result = weakref.ref(handle.wait(timeout_s=10))
        ex.close()  # the engine's threads are gone: only the compute could hold the result now
        assert result() is not None
        del handle
        assert result() is None
    finally:
        gc.enable()
