"""Cross-mesh decomposition (App. B of "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022))
and lowering of unit tasks by strategy.

Lowered steps are checked by simulating them on numpy arrays: every device starts with its source
tile, steps run in a random order that respects their dependencies, and each receiver must end
with exactly its destination tile."""

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjob.errors import SpecError
from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec, contains, tile, to_index
from meshjob.resharding.strategies import STRATEGIES, lower
from meshjob.resharding.tasks import CROSS_HOST, INTRA_HOST, UnitTask, decompose, nic_bytes, split


# ---------------------------------------------------------------- random meshes and specs
@st.composite
def mesh_shapes(draw):
    return tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))


@st.composite
def specs(draw, mesh_shape, ndim):
    """A random valid spec: each mesh dim is unused or sharding one tensor dim, in random order."""
    owner = [draw(st.integers(-1, ndim - 1)) for _ in mesh_shape]
    order = draw(st.permutations(range(len(mesh_shape))))
    return ShardingSpec(tuple(tuple(m for m in order if owner[m] == d) for d in range(ndim)))


@st.composite
def resharding_cases(draw):
    shape_a, shape_b = draw(mesh_shapes()), draw(mesh_shapes())
    ndim = draw(st.integers(1, 3))
    spec_a, spec_b = draw(specs(shape_a, ndim)), draw(specs(shape_b, ndim))
    tensor = tuple(
        math.lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(spec_a.shards(shape_a), spec_b.shards(shape_b))
    )
    mesh_a = Mesh.grid(shape_a)
    # The destination may share hosts with the source (first_host inside A's hosts) or not.
    mesh_b = Mesh.grid(shape_b, first_rank=mesh_a.size, first_host=draw(st.integers(0, shape_a[0])))
    return tensor, mesh_a, spec_a, mesh_b, spec_b


def host_map(*meshes):
    hosts = {r: m.host_of(r) for m in meshes for r in m.ranks}
    return hosts.__getitem__


def coverage(tensor, slices):
    count = np.zeros(tensor, dtype=int)
    for s in slices:
        count[to_index(s)] += 1
    return count


# ---------------------------------------------------------------- decomposition
@settings(max_examples=150, deadline=None)
@given(resharding_cases())
def test_slices_are_disjoint_and_cover_the_tensor(case):
    tensor, mesh_a, spec_a, mesh_b, spec_b = case
    tasks = decompose(tensor, mesh_a, spec_a, mesh_b, spec_b)
    assert (coverage(tensor, [t.slice for t in tasks]) == 1).all()


@settings(max_examples=150, deadline=None)
@given(resharding_cases())
def test_each_receiver_gets_exactly_its_tile(case):
    tensor, mesh_a, spec_a, mesh_b, spec_b = case
    tasks = decompose(tensor, mesh_a, spec_a, mesh_b, spec_b)
    for rank in mesh_b.ranks:
        expected = np.zeros(tensor, dtype=int)
        expected[to_index(tile(spec_b, mesh_b.shape, tensor, mesh_b.index_of(rank)))] = 1
        got = coverage(tensor, [t.slice for t in tasks if rank in t.receivers])
        assert (got == expected).all()


@settings(max_examples=150, deadline=None)
@given(resharding_cases())
def test_senders_are_exactly_the_source_devices_holding_the_slice(case):
    tensor, mesh_a, spec_a, mesh_b, spec_b = case
    for task in decompose(tensor, mesh_a, spec_a, mesh_b, spec_b):
        holders = tuple(
            r for r in mesh_a.ranks if contains(tile(spec_a, mesh_a.shape, tensor, mesh_a.index_of(r)), task.slice)
        )
        assert task.senders == holders and holders


def test_bytes_are_numel_times_itemsize():
    [task] = decompose(
        (4, 6),
        Mesh.grid((1,)),
        ShardingSpec.parse("RR"),
        Mesh.grid((2,), first_rank=1, first_host=1),
        ShardingSpec.parse("RR"),
        itemsize=2,
    )
    assert task.bytes == 4 * 6 * 2 and task.receivers == (1, 2) and task.senders == (0,)


def test_paper_case_1_s01r_to_s0r_gives_one_task_per_row():
    # Zhuang et al., 2022, Fig. 10: 4x4 tensor, S01R on 2x2 mesh A -> S0R on 2x2 mesh B.
    a, b = Mesh.grid((2, 2)), Mesh.grid((2, 2), first_rank=4, first_host=2)
    tasks = decompose((4, 4), a, ShardingSpec.parse("S01R"), b, ShardingSpec.parse("S0R"))
    assert [(t.slice, t.senders, t.receivers) for t in tasks] == [
        (((0, 1), (0, 4)), (0,), (4, 5)),
        (((1, 2), (0, 4)), (1,), (4, 5)),
        (((2, 3), (0, 4)), (2,), (6, 7)),
        (((3, 4), (0, 4)), (3,), (6, 7)),
    ]


def test_paper_case_2_s0r_to_rs1_cuts_both_dims():
    a, b = Mesh.grid((2, 2)), Mesh.grid((2, 2), first_rank=4, first_host=2)
    tasks = decompose((4, 4), a, ShardingSpec.parse("S0R"), b, ShardingSpec.parse("RS1"))
    assert len(tasks) == 4
    assert tasks[0] == UnitTask(((0, 2), (0, 2)), (0, 1), (4, 6), 16)


def test_invalid_specs_are_rejected_naming_the_side():
    with pytest.raises(SpecError, match="dst_spec"):
        decompose(
            (6, 4), Mesh.grid((2,)), ShardingSpec.parse("S0R"), Mesh.grid((4,), first_rank=2), ShardingSpec.parse("S0R")
        )


# ---------------------------------------------------------------- lowering, simulated on arrays
def simulate(tensor, holdings, steps, rng):
    """Run steps in a random dependency-respecting order. holdings: rank -> initial tile.
    Returns rank -> (values, mask). Fails if a step's source lacks its region when it runs."""
    data = np.arange(math.prod(tensor), dtype=float).reshape(tensor)
    state = {}
    for rank, t in holdings.items():
        mask = np.zeros(tensor, dtype=bool)
        if t is not None:
            mask[to_index(t)] = True
        state[rank] = (np.where(mask, data, np.nan), mask)
    done, pending = set(), list(steps)
    while pending:
        ready = [s for s in pending if all(a in done for a in s.after)]
        assert ready, "dependency cycle or dangling dependency"
        step = rng.choice(ready)
        pending.remove(step)
        values, mask = state[step.src]
        idx = to_index(step.region)
        assert mask[idx].all(), f"step {step} sends data its source does not hold"
        dvalues, dmask = state[step.dst]
        dvalues[idx], dmask[idx] = values[idx], True
        done.add(step.id)
    return data, state


def direct_dependencies_cover(step, by_id, initial):
    """A step's region is in its source's initial tile or delivered to it by its `after` steps."""
    if initial.get(step.src) is not None and contains(initial[step.src], step.region):
        return True
    got = [by_id[a] for a in step.after]
    return all(g.dst == step.src for g in got) and any(contains(g.region, step.region) for g in got)


def lower_all(tasks, strategy, chunks, host_of, rng):
    steps = []
    for i, task in enumerate(tasks):
        steps += lower(task, i, rng.choice(task.senders), strategy, chunks, host_of, first_step_id=len(steps))
    return steps


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "signal"])
@settings(max_examples=60, deadline=None)
@given(case=resharding_cases(), chunks=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_lowered_steps_deliver_exactly_each_receivers_tile(strategy, case, chunks, seed):
    tensor, mesh_a, spec_a, mesh_b, spec_b = case
    rng, host_of = random.Random(seed), host_map(mesh_a, mesh_b)
    steps = lower_all(decompose(tensor, mesh_a, spec_a, mesh_b, spec_b), strategy, chunks, host_of, rng)
    initial = {r: tile(spec_a, mesh_a.shape, tensor, mesh_a.index_of(r)) for r in mesh_a.ranks}
    initial.update({r: None for r in mesh_b.ranks})
    by_id = {s.id: s for s in steps}
    assert len(by_id) == len(steps)
    assert all(direct_dependencies_cover(s, by_id, initial) for s in steps)
    data, state = simulate(tensor, initial, steps, rng)
    for r in mesh_b.ranks:
        values, mask = state[r]
        expected = np.zeros(tensor, dtype=bool)
        expected[to_index(tile(spec_b, mesh_b.shape, tensor, mesh_b.index_of(r)))] = True
        assert (mask == expected).all()
        assert (values[mask] == data[mask]).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scope_is_cross_host_exactly_when_hosts_differ(strategy):
    a, b = Mesh.grid((1, 2)), Mesh((2, 2), (2, 3, 4, 5), (0, 0, 1, 1))  # B's first row shares host 0
    host_of = host_map(a, b)
    task = decompose((8,), a, ShardingSpec.parse("R"), b, ShardingSpec.parse("R"))[0]
    for s in lower(task, 0, 0, strategy, 2, host_of):
        assert s.scope == (INTRA_HOST if host_of(s.src) == host_of(s.dst) else CROSS_HOST)


def one_to_two_by_four():
    """One device on host 0 -> a (2, 4) mesh on hosts 1 and 2, a replicated 64-element tensor."""
    a, b = Mesh.grid((1,)), Mesh.grid((2, 4), first_rank=1, first_host=1)
    [task] = decompose((64,), a, ShardingSpec.parse("R"), b, ShardingSpec.parse("R"))
    return task, host_map(a, b)


@pytest.mark.parametrize(
    "strategy, out_copies, steps_cross",
    [
        ("send_recv", 8, 8),  # A*B copies from the sender
        ("local_allgather", 2, 8),  # one copy per host, split in B parts
        ("global_allgather", 1, 8 + 14),  # A*B parts out; 8 parts x 2 ring boundaries, less 2 unused
        ("broadcast", 1, 4 + 4),  # K=4 chunks to host 1, then 4 chunks host 1 -> host 2
    ],
)
def test_nic_bytes_per_strategy(strategy, out_copies, steps_cross):
    task, host_of = one_to_two_by_four()
    steps = lower(task, 0, 0, strategy, 4, host_of)
    nic = nic_bytes(steps, host_of)
    assert nic[0] == (out_copies * task.bytes, 0)
    assert sum(1 for s in steps if s.scope == CROSS_HOST) == steps_cross


def test_global_allgather_ring_moves_almost_a_second_copy_through_each_host():
    task, host_of = one_to_two_by_four()
    nic = nic_bytes(lower(task, 0, 0, "global_allgather", 4, host_of), host_of)
    part = task.bytes // 8
    # Scatter: 4 parts into each host. Ring: 7 of the 8 parts cross each host boundary.
    assert nic[1] == (7 * part, 4 * part + 7 * part)
    assert nic[2] == (7 * part, 4 * part + 7 * part)


def test_broadcast_chain_hops_depend_only_on_receipt_of_the_same_chunk():
    task, host_of = one_to_two_by_four()
    steps = lower(task, 0, 0, "broadcast", 4, host_of)
    by_id = {s.id: s for s in steps}
    chunks = split(task.slice, 4)
    assert len({s.region for s in steps}) == 4
    for s in steps:
        if s.src == 0:
            assert s.after == () and s.dst == 1  # sender -> first device of host 1
        else:
            [dep] = s.after
            assert by_id[dep].dst == s.src and by_id[dep].region == s.region
    chain = [s for s in steps if s.scope == CROSS_HOST and s.src == 1]
    assert [s.dst for s in chain] == [5] * 4 and [s.region for s in chain] == chunks
    intra = [s for s in steps if s.scope == INTRA_HOST]
    assert len(intra) == 4 * 2 * 3  # each head forwards each chunk to its 3 neighbours


def test_broadcast_chunks_are_capped_by_the_longest_dim():
    task, host_of = one_to_two_by_four()
    steps = lower(task, 0, 0, "broadcast", 1000, host_of)
    assert len([s for s in steps if s.src == 0]) == 64


@pytest.mark.parametrize("parts, pieces", [(1, 1), (4, 4), (16, 16), (92, 80), (256, 256), (512, 512), (5000, 1024)])
def test_a_3d_slice_is_cut_into_contiguous_pieces_of_the_row_major_tensor(parts, pieces):
    """Cutting the innermost dim would make every piece thousands of short runs to pack and unpack:
    pieces cut the outer dims (every element of dim 0 apart first when it has fewer than asked)."""
    shape = (16, 256, 1024)
    region = tuple((0, n) for n in shape)
    cut = split(region, parts)
    assert len(cut) == pieces
    flat = np.arange(np.prod(shape)).reshape(shape)
    runs = [flat[to_index(p)].ravel() for p in cut]
    assert all((r[1:] - r[:-1] == 1).all() for r in runs)  # one contiguous run each
    assert (np.sort(np.concatenate(runs)) == flat.ravel()).all()  # disjoint, covering the slice


def test_signal_has_broadcast_shape_with_one_byte_steps():
    task, host_of = one_to_two_by_four()
    signal = lower(task, 0, 0, "signal", 16, host_of)
    shape = lower(task, 0, 0, "broadcast", 1, host_of)

    def shape_of(steps):
        return [(s.src, s.dst, s.after, s.scope) for s in steps]

    assert shape_of(signal) == shape_of(shape)
    assert all(s.signal and s.nbytes() == 1 for s in signal)
    assert nic_bytes(signal, host_of) == {0: (1, 0), 1: (1, 1), 2: (0, 1)}


def test_sender_on_a_receiving_host_starts_the_chain_there():
    a, b = Mesh((1,), (0,), (1,)), Mesh.grid((2, 2), first_rank=1, first_host=0)  # sender on host 1
    host_of = host_map(a, b)
    [task] = decompose((8,), a, ShardingSpec.parse("R"), b, ShardingSpec.parse("R"))
    steps = lower(task, 0, 0, "broadcast", 2, host_of)
    first = [s for s in steps if s.src == 0]
    assert {s.dst for s in first} == {3} and all(s.scope == INTRA_HOST for s in first)
    assert nic_bytes(steps, host_of) == {1: (task.bytes, 0), 0: (0, task.bytes)}


def test_lower_rejects_a_sender_that_does_not_hold_the_slice():
    task, host_of = one_to_two_by_four()
    with pytest.raises(ValueError, match="sender 3 does not hold"):
        lower(task, 0, 3, "broadcast", 4, host_of)


def test_lower_rejects_unknown_strategies():
    task, host_of = one_to_two_by_four()
    with pytest.raises(ValueError, match="strategy 'ring' is invalid: one of send_recv"):
        lower(task, 0, 0, "ring", 4, host_of)
