"""The one network model: what a unit task costs and holds, and the chunk count it implies."""

from dataclasses import replace

import pytest

from meshjob.network.host_task import HostTask
from meshjob.network.model import NetworkModel
from meshjob.resharding.strategies import auto_chunks, task_cost
from meshjob.resharding.task_costs import MAX_AUTO_CHUNKS

RATE = 1.25e8  # 1 gbit
BW = 1000.0  # bytes per second: t = bytes / 1000
BYTES_ONLY = {"nic_bytes_per_s": BW, "message_s": 0.0, "intra_message_s": 0.0, "intra_host_bytes_per_s": 1e15}
PAPER = NetworkModel(**BYTES_ONLY)  # the paper's setting: bytes only


def seconds(task, strategy, chunks=6, network=PAPER, sender=0):
    return task_cost(network, task, sender, strategy, chunks).seconds


# ---------------------------------------------------------------- the paper's formulas (bytes only)
@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("send_recv", 2 * 4 * 3.0),  # A*B*t
        ("local_allgather", 2 * 3.0),  # A*t
        ("global_allgather", 3.0 + 7 * 3.0 / 8),  # scatter t, ring (N-1)t/N: the paper's 2t for large N
        ("broadcast", 3.0 + 1 * 3.0 / 6),  # t + (A-1)t/K
        ("signal", 2 / BW),  # 1 byte per hop of the chain
    ],
)
def test_task_seconds_follow_the_strategy_formulas(strategy, expected):
    task = HostTask((0,), (1, 2), 3000, receiver_devices=(4, 4))
    assert seconds(task, strategy) == pytest.approx(expected)


def test_a_sender_on_a_receiving_host_does_not_count_that_host():
    assert seconds(HostTask((0, 1), (1, 2), 3000), "send_recv", 1, sender=1) == pytest.approx(3.0)
    local = task_cost(PAPER, HostTask((1,), (1,), 3000, (2,)), 1, "broadcast", 4)
    assert local.links == () and local.seconds == pytest.approx(0.0, abs=1e-9)  # intra-host only


def test_global_allgather_to_one_host_costs_one_transfer():
    assert seconds(HostTask((0,), (1,), 3000, (4,)), "global_allgather", 1) == pytest.approx(3.0)


def test_each_message_adds_the_per_message_cost():
    timed = NetworkModel(nic_bytes_per_s=BW, message_s=0.1, intra_host_bytes_per_s=1e15, intra_message_s=0.0)
    task = HostTask((0,), (1, 2, 3), 4000)
    assert seconds(task, "broadcast", 4, timed) == pytest.approx((4 + 3 - 1) * (1.0 + 0.1))
    assert seconds(task, "send_recv", 1, timed) == pytest.approx(3 * (4.0 + 0.1))


def test_copies_inside_a_host_take_the_local_links_time():
    local = NetworkModel(nic_bytes_per_s=BW, message_s=0.0, intra_message_s=0.0, intra_host_bytes_per_s=2 * BW)
    task = HostTask((0,), (1,), 4000, receiver_devices=(3,))
    # K=1: 4 s to the head of host 1, then two local copies of 2 s each
    assert seconds(task, "broadcast", 1, local) == pytest.approx(4.0 + 2 * 2.0)


# ---------------------------------------------------------------- links a task holds
def test_a_chain_holds_the_senders_out_link_each_receivers_in_link_and_the_forwarders_out_links():
    cost = task_cost(PAPER, HostTask((0,), (1, 2), 3000), 0, "broadcast", 1)
    assert dict((link, (off, busy)) for link, off, busy in cost.holds()) == {
        (0, "out"): (0.0, 3.0),
        (1, "in"): (0.0, 3.0),
        (1, "out"): (3.0, 3.0),
        (2, "in"): (3.0, 3.0),
    }


def test_half_duplex_holds_every_host_of_the_task_for_its_whole_duration():
    half = NetworkModel(**BYTES_ONLY, duplex="half")
    cost = task_cost(half, HostTask((0,), (1, 2), 3000), 0, "broadcast", 1)
    assert cost.holds() == (((0, "nic"), 0.0, 6.0), ((1, "nic"), 0.0, 6.0), ((2, "nic"), 0.0, 6.0))


def test_every_held_link_is_released_by_the_end_of_the_task():
    task = HostTask((0,), (1, 2, 3), 3000, receiver_devices=(2, 1, 3))
    timed = NetworkModel(nic_bytes_per_s=BW, message_s=0.05, intra_host_bytes_per_s=4 * BW)
    for strategy in ("send_recv", "local_allgather", "global_allgather", "broadcast", "signal"):
        cost = task_cost(timed, task, 0, strategy, 5)
        assert cost.links and all(off + busy <= cost.seconds + 1e-12 for _, off, busy in cost.holds())


# ---------------------------------------------------------------- chunks: auto
def chain_seconds(nbytes: int, hops: int, k: int, message_s: float) -> float:
    return (k + hops - 1) * (nbytes / RATE / k + message_s)


@pytest.mark.parametrize("nbytes", [4096, 2**20, 16 * 2**20, 64 * 2**20])
@pytest.mark.parametrize("hops", [2, 3, 4, 8])
def test_auto_chunks_minimises_the_chain_time_over_every_allowed_k(nbytes, hops):
    k = auto_chunks(nbytes, hops, RATE, 50e-6)
    best = min(chain_seconds(nbytes, hops, j, 50e-6) for j in range(1, MAX_AUTO_CHUNKS + 1))
    assert chain_seconds(nbytes, hops, k, 50e-6) == pytest.approx(best)


def test_one_receiving_host_gains_nothing_from_chunks():
    assert auto_chunks(64 * 2**20, 1, RATE, 50e-6) == 1


def test_auto_chunks_grow_with_bytes_and_hosts_and_shrink_with_the_message_cost():
    assert auto_chunks(2**20, 4, RATE) < auto_chunks(16 * 2**20, 4, RATE)
    assert auto_chunks(16 * 2**20, 2, RATE) < auto_chunks(16 * 2**20, 4, RATE)
    assert auto_chunks(16 * 2**20, 4, RATE, 1e-3) < auto_chunks(16 * 2**20, 4, RATE, 1e-5)
    assert auto_chunks(16 * 2**20, 4, RATE, 0.0) == MAX_AUTO_CHUNKS


def test_chunks_never_exceed_what_the_slice_can_be_cut_into():
    task = HostTask((0,), (1, 2, 3), 64 * 2**20, max_chunks=8)
    assert task_cost(NetworkModel(), task, 0, "broadcast", "auto").chunks == 8
    assert task_cost(NetworkModel(), task, 0, "broadcast", 64).chunks == 8


# ---------------------------------------------------------------- bad models
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nic_bytes_per_s": 0}, "nic_bytes_per_s 0 is invalid: a positive number of bytes per second"),
        ({"message_s": -1e-6}, "message_s -1e-06 is invalid: a number >= 0"),
        ({"duplex": "simplex"}, "duplex 'simplex' is invalid: one of full, half"),
        ({"in_flight_per_link": 0}, "in_flight_per_link 0 is invalid: an integer >= 1"),
        (
            {"in_flight_per_link": 4, "small_in_flight_per_link": 3},
            r"small_in_flight_per_link 3 is invalid: an integer >= in_flight_per_link \(4\)",
        ),
    ],
)
def test_a_bad_network_model_is_rejected_naming_field_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NetworkModel(**kwargs)


# ---------------------------------------------------------------- the shared cores of an emulated cluster
SHARED = NetworkModel(
    nic_bytes_per_s=RATE,
    shared_cpu_cores=2,
    message_cpu_s=300e-6,
    intra_message_cpu_s=120e-6,
    net_byte_cpu_s=1e-9,
    local_byte_cpu_s=0.5e-9,
)
FOUR_BY_FOUR = HostTask((0,), (1, 2, 3, 4), 16 * 2**20, receiver_devices=(4, 4, 4, 4))


def test_without_shared_cores_messages_cost_no_cpu_and_tasks_cost_what_they_did():
    plain = NetworkModel(nic_bytes_per_s=RATE, message_cpu_s=300e-6, net_byte_cpu_s=1e-9)
    assert plain.cpu_s((100, 1e6), (100, 1e6)) == 0.0
    assert task_cost(plain, FOUR_BY_FOUR, 0, "broadcast", 64) == task_cost(
        NetworkModel(nic_bytes_per_s=RATE), FOUR_BY_FOUR, 0, "broadcast", 64
    )


def test_shared_cores_share_every_messages_cpu_work_each_link_at_its_own_cost():
    # 10 messages between hosts (1 MB), 20 inside hosts (2 MB), on 2 cores
    expected = (10 * 300e-6 + 20 * 120e-6 + 1e6 * 1e-9 + 2e6 * 0.5e-9) / 2
    assert SHARED.cpu_s((10, 1e6), (20, 2e6)) == pytest.approx(expected)


def test_a_chain_in_many_chunks_ends_no_sooner_than_the_shared_cores_do_its_messages():
    k = 128  # 4 hops and 12 copies per chunk
    work = (4 * k * 300e-6 + 12 * k * 120e-6 + 4 * FOUR_BY_FOUR.bytes * 1e-9 + 12 * FOUR_BY_FOUR.bytes * 0.5e-9) / 2
    cost = task_cost(SHARED, FOUR_BY_FOUR, 0, "broadcast", k)
    assert cost.seconds == pytest.approx(work)
    assert cost.seconds > task_cost(NetworkModel(nic_bytes_per_s=RATE), FOUR_BY_FOUR, 0, "broadcast", k).seconds


def test_chunks_auto_stops_where_the_shared_cores_would_outlast_the_nics():
    plain = task_cost(NetworkModel(nic_bytes_per_s=RATE), FOUR_BY_FOUR, 0, "broadcast", "auto")
    shared = task_cost(SHARED, FOUR_BY_FOUR, 0, "broadcast", "auto")
    assert shared.chunks < plain.chunks / 2
    best = min(task_cost(SHARED, FOUR_BY_FOUR, 0, "broadcast", k).seconds for k in range(1, MAX_AUTO_CHUNKS + 1))
    assert shared.seconds == pytest.approx(best)


def test_tasks_sharing_the_cores_in_a_window_take_fewer_chunks_each():
    alone = task_cost(SHARED, FOUR_BY_FOUR, 0, "broadcast", "auto").chunks
    crowded = task_cost(SHARED, replace(FOUR_BY_FOUR, cpu_share=4), 0, "broadcast", "auto").chunks
    assert crowded < alone


@pytest.mark.parametrize("strategy", ["send_recv", "local_allgather", "global_allgather"])
def test_every_strategy_pays_its_messages_cpu_on_shared_cores(strategy):
    slow_cpu = replace(SHARED, message_cpu_s=1.0)  # a second per message: the CPU decides
    cost = task_cost(slow_cpu, FOUR_BY_FOUR, 0, strategy, 1).seconds
    assert cost >= 16 / 2  # at least one message per receiving device, on 2 cores


def test_a_negative_number_of_shared_cores_is_rejected():
    with pytest.raises(ValueError, match="shared_cpu_cores -1 is invalid: an integer >= 0"):
        NetworkModel(shared_cpu_cores=-1)


def test_an_emulated_cluster_is_planned_with_engine_costs_on_its_machines_shared_cores():
    from meshjob.network.model import EMULATED_MESSAGE_CPU_S, EMULATED_MESSAGE_S, emulated_network

    model = emulated_network(RATE, cores=2)
    assert (model.shared_cpu_cores, model.message_s, model.message_cpu_s) == (
        2,
        EMULATED_MESSAGE_S,
        EMULATED_MESSAGE_CPU_S,
    )
    assert (
        task_cost(model, FOUR_BY_FOUR, 0, "broadcast", "auto").chunks
        < task_cost(NetworkModel(nic_bytes_per_s=RATE), FOUR_BY_FOUR, 0, "broadcast", "auto").chunks
    )


# ---------------------------------------------------------------- NIC and cores contending (emulated cluster)
def test_nic_and_cpu_time_add_up_partly_where_neither_dominates():
    contended = replace(SHARED, cpu_contention_p=4.0)
    assert SHARED.with_cpu(1.0, 1.0) == 1.0  # p 0: max, no interference
    assert contended.with_cpu(1.0, 1.0) == pytest.approx(2**0.25)
    assert contended.with_cpu(1.0, 0.0) == 1.0 and contended.with_cpu(0.0, 1.0) == 1.0
    assert 1.0 < contended.with_cpu(1.0, 0.5) < replace(SHARED, cpu_contention_p=2.0).with_cpu(1.0, 0.5) < 1.5
    with pytest.raises(ValueError, match="cpu_contention_p -1 is invalid: a number >= 0"):
        NetworkModel(cpu_contention_p=-1)


# A fully replicated pair between two (2, 4) meshes (RRR -> RRR): either source host sends the whole
# tensor down a chain through both destination hosts, 4 devices each.
REPLICATED = HostTask((0, 1), (2, 3), 16 * 2**20, receiver_devices=(4, 4), max_chunks=1024)
MESSAGES_ONLY = replace(SHARED, message_cpu_s=530e-6, net_byte_cpu_s=0.0, local_byte_cpu_s=0.0)


def test_chunks_auto_cuts_a_replicated_pair_into_fewer_chunks_when_the_cores_also_pay_per_byte():
    """The bytes' CPU work is paid at any K, so the cores run out sooner as chunks add messages."""
    per_byte = replace(MESSAGES_ONLY, net_byte_cpu_s=1.4e-9, local_byte_cpu_s=0.75e-9)
    assert (
        task_cost(per_byte, REPLICATED, 0, "broadcast", "auto").chunks
        < task_cost(MESSAGES_ONLY, REPLICATED, 0, "broadcast", "auto").chunks
    )
    contended = replace(per_byte, cpu_contention_p=4.0)
    assert (
        task_cost(contended, REPLICATED, 0, "broadcast", "auto").chunks
        < task_cost(per_byte, REPLICATED, 0, "broadcast", "auto").chunks
    )


def test_on_shared_cores_a_chains_time_falls_then_rises_with_its_chunks_and_auto_takes_the_bottom():
    model = replace(SHARED, message_cpu_s=530e-6, net_byte_cpu_s=1.4e-9, local_byte_cpu_s=0.75e-9, cpu_contention_p=4.0)
    times = {k: task_cost(model, REPLICATED, 0, "broadcast", k).seconds for k in (1, 4, 16, 64, 256)}
    assert times[1] > times[4] > times[16] and times[16] < times[64] < times[256]
    auto = task_cost(model, REPLICATED, 0, "broadcast", "auto")
    assert auto.seconds <= min(times.values()) and 4 < auto.chunks < 64


# ---------------------------------------------------------------- messages that run alone on their link
HELD = replace(
    SHARED,
    message_s=60e-6,
    message_cpu_s=530e-6,
    net_byte_cpu_s=1.4e-9,
    local_byte_cpu_s=0.75e-9,
    cpu_contention_p=4.0,
    alone_bytes=RATE * 60e-6 * 50,
    alone_message_s=530e-6 / 2,
)


def test_a_message_above_the_alone_threshold_takes_its_link_the_alone_cost_longer():
    small, large = HELD.alone_bytes, HELD.alone_bytes + 1
    assert HELD.net_s(small) == pytest.approx(small / RATE + 60e-6)
    assert HELD.net_s(large) == pytest.approx(large / RATE + 60e-6 + 265e-6)
    assert replace(HELD, alone_bytes=0.0).net_s(large) == pytest.approx(large / RATE + 60e-6)  # 0: none held
    assert HELD.to_json()["alone_bytes"] == HELD.alone_bytes and HELD.to_json()["alone_message_s"] == 265e-6
    with pytest.raises(ValueError, match="alone_message_s -1 is invalid: a number >= 0"):
        NetworkModel(alone_message_s=-1)


def test_chunks_auto_cuts_one_device_per_host_below_the_alone_threshold_where_held_chunks_cost_more():
    """One device per host: the chain's time is flat around its fastest K, so the held chunks' extra cost
    moves auto to chunks small enough to keep two in flight on each link."""
    task = HostTask((0,), (1, 2, 3, 4), 16 * 2**20)
    plain = task_cost(replace(HELD, alone_bytes=0.0), task, 0, "broadcast", "auto").chunks
    held = task_cost(HELD, task, 0, "broadcast", "auto")
    assert task.bytes / plain > HELD.alone_bytes >= task.bytes / held.chunks
    times = {k: task_cost(HELD, task, 0, "broadcast", k).seconds for k in range(1, MAX_AUTO_CHUNKS + 1)}
    assert held.seconds == pytest.approx(min(times.values()))


def test_the_lower_bound_does_not_charge_the_alone_cost_chunks_can_avoid():
    task = HostTask((0,), (1,), 16 * 2**20)
    assert HELD.lower_bound([task]) == pytest.approx(task.bytes / RATE + 60e-6)
