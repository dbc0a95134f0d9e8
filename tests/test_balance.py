"""Host-level load balancing and ordering: cost formulas, bound, and the four balancers."""
import itertools
import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from meshjob.balance import BALANCERS, HostTask, Schedule, balance, lower_bound, task_seconds
from meshjob.mesh import Mesh
from meshjob.resharding import decompose
from meshjob.sharding import ShardingSpec

BW = 1000.0  # bytes per second: t = bytes / 1000


# ---------------------------------------------------------------- cost model
@pytest.mark.parametrize("strategy, seconds", [
    ("send_recv", 2 * 4 * 3.0),          # A*B*t
    ("local_allgather", 2 * 3.0),        # A*t
    ("global_allgather", 2 * 3.0),       # 2t
    ("broadcast", 3.0 + 1 * 3.0 / 6),    # t + (A-1)t/K
    ("signal", 2 / BW),                  # 1 byte per hop of the chain
])
def test_task_seconds_follows_the_strategy_formula(strategy, seconds):
    task = HostTask((0,), (1, 2), 3000)
    assert task_seconds(task, 0, strategy, 6, 4, BW) == pytest.approx(seconds)


def test_a_sender_on_a_receiving_host_does_not_count_that_host():
    task = HostTask((0, 1), (1, 2), 3000)
    assert task_seconds(task, 1, "send_recv", 1, 1, BW) == pytest.approx(3.0)
    assert task_seconds(HostTask((1,), (1,), 3000), 1, "broadcast", 4, 2, BW) == 0.0


def test_global_allgather_to_one_host_costs_one_transfer():
    assert task_seconds(HostTask((0,), (1,), 3000), 0, "global_allgather", 1, 4, BW) == pytest.approx(3.0)


def test_lower_bound_counts_what_each_receiving_host_must_take_in():
    tasks = [HostTask((0, 1), (2,), 1000), HostTask((0, 1), (2, 3), 3000)]
    # Host 2 takes in 4000 bytes; the pooled senders share 4000 over 2 hosts.
    assert lower_bound(tasks, BW) == pytest.approx(4.0)


def test_lower_bound_counts_what_only_one_host_holds():
    tasks = [HostTask((0,), (1,), 1000), HostTask((0,), (2,), 1000), HostTask((0,), (3,), 1000)]
    assert lower_bound(tasks, BW) == pytest.approx(3.0)


def test_lower_bound_shares_replicated_sends_among_the_holders():
    tasks = [HostTask((0, 1), (h,), 1000) for h in (2, 3, 4, 5)]
    assert lower_bound(tasks, BW) == pytest.approx(2.0)


# ---------------------------------------------------------------- invariants of every schedule
def hosts_of(task, sender):
    return {sender, *task.receiver_hosts}


def assert_valid(tasks, sched: Schedule):
    """Senders hold the slice, shared hosts never overlap, each start is the earliest allowed."""
    assert len(sched.sender_host) == len(tasks)
    for i, task in enumerate(tasks):
        assert sched.sender_host[i] in task.sender_hosts
    end = [s + d for s, d in zip(sched.start_s, sched.seconds)]
    order = sched.order
    for x, i in enumerate(order):
        mine = hosts_of(tasks[i], sched.sender_host[i])
        earlier = [j for j in order[:x] if mine & hosts_of(tasks[j], sched.sender_host[j])]
        for j in earlier:
            assert sched.start_s[i] >= end[j] - 1e-9, f"tasks {j} and {i} overlap on a shared host"
        assert sched.start_s[i] == pytest.approx(max((end[j] for j in earlier), default=0.0))
    assert sched.makespan_s == pytest.approx(max(end, default=0.0))
    assert sched.makespan_s >= sched.lower_bound_s - 1e-9


@st.composite
def host_task_lists(draw, max_tasks=8, hosts=4):
    n = draw(st.integers(1, max_tasks))
    tasks = []
    for _ in range(n):
        senders = draw(st.lists(st.integers(0, hosts - 1), min_size=1, max_size=2, unique=True))
        receivers = draw(st.lists(st.integers(hosts, 2 * hosts - 1), min_size=1, max_size=3, unique=True))
        tasks.append(HostTask(tuple(senders), tuple(receivers), draw(st.sampled_from([1000, 2000, 4000]))))
    return tasks


@pytest.mark.parametrize("balancer", BALANCERS)
@settings(max_examples=25, deadline=None)
@given(tasks=host_task_lists(), strategy=st.sampled_from(["send_recv", "broadcast", "global_allgather"]))
def test_every_balancer_gives_a_valid_schedule_at_or_above_the_lower_bound(balancer, tasks, strategy):
    sched = balance(tasks, balancer, strategy, 4, BW, budget_s=0.2, receiver_devices_per_host=2)
    assert sched.balancer == balancer
    assert_valid(tasks, sched)


def test_tasks_sharing_a_sender_host_with_receivers_are_valid_too():
    tasks = [HostTask((0, 1), (1, 2), 1000), HostTask((1,), (0, 2), 2000), HostTask((2,), (0,), 500)]
    for balancer in BALANCERS:
        assert_valid(tasks, balance(tasks, balancer, "broadcast", 4, BW, budget_s=0.2))


# ---------------------------------------------------------------- the balancers
def test_naive_takes_the_lowest_index_sender_host_in_the_given_order():
    tasks = [HostTask((3, 1), (5,), 1000), HostTask((2, 1), (6,), 1000), HostTask((1,), (7,), 1000)]
    sched = balance(tasks, "naive", "send_recv", 1, BW)
    assert sched.sender_host == (1, 1, 1)
    assert sched.start_s == (0.0, 1.0, 2.0)


def test_load_balance_puts_the_longest_task_first_on_the_least_loaded_host():
    tasks = [HostTask((0, 1), (2,), 1000), HostTask((0, 1), (3,), 3000), HostTask((0, 1), (4,), 2000)]
    sched = balance(tasks, "load_balance", "send_recv", 1, BW)
    assert sched.sender_host == (1, 0, 1)  # 3000 -> host 0; 2000 -> host 1; 1000 -> host 1 (2 < 3)
    assert sched.makespan_s == pytest.approx(3.0)


def exhaustive_optimum(tasks, strategy, chunks):
    """Min makespan over every order and every sender choice (list scheduling)."""
    best = float("inf")
    for order in itertools.permutations(range(len(tasks))):
        for senders in itertools.product(*(tasks[i].sender_hosts for i in order)):
            free, makespan = {}, 0.0
            for i, s in zip(order, senders):
                hosts = hosts_of(tasks[i], s)
                begin = max(free.get(h, 0.0) for h in hosts)
                end = begin + task_seconds(tasks[i], s, strategy, chunks, 1, BW)
                free.update({h: end for h in hosts})
                makespan = max(makespan, end)
            best = min(best, makespan)
    return best


@settings(max_examples=40, deadline=None)
@given(tasks=host_task_lists(max_tasks=5, hosts=3), strategy=st.sampled_from(["send_recv", "broadcast"]))
def test_dfs_is_optimal_on_small_cases(tasks, strategy):
    sched = balance(tasks, "dfs", strategy, 4, BW, budget_s=5.0)
    assert sched.finished
    assert sched.makespan_s == pytest.approx(exhaustive_optimum(tasks, strategy, 4))


def test_dfs_beats_naive_when_order_matters():
    # In the given order host 1's short task waits for host 2, and its long task waits for that;
    # dfs runs both long tasks at once and the short one after.
    tasks = [HostTask((0,), (2,), 3000), HostTask((1,), (2,), 1000), HostTask((1,), (3,), 3000)]
    naive = balance(tasks, "naive", "send_recv", 1, BW)
    dfs = balance(tasks, "dfs", "send_recv", 1, BW)
    assert naive.makespan_s == pytest.approx(7.0) and dfs.makespan_s == pytest.approx(4.0)


def random_tasks(seed, n, hosts=4):
    rng = random.Random(seed)
    return [HostTask(tuple(rng.sample(range(hosts), rng.randint(1, 2))),
                     tuple(rng.sample(range(hosts, 2 * hosts), rng.randint(1, 3))),
                     rng.choice([1000, 2000, 4000])) for _ in range(n)]


def paper_like_tasks(send, recv, src_shape=(2, 4), dst_shape=(2, 4), tensor=(96, 96)):
    """Mesh -> mesh on disjoint hosts, one host per mesh row."""
    a = Mesh.grid(src_shape)
    b = Mesh.grid(dst_shape, first_rank=a.size, first_host=src_shape[0])
    host_of = {**{r: a.host_of(r) for r in a.ranks}, **{r: b.host_of(r) for r in b.ranks}}
    units = decompose(tensor, a, ShardingSpec.parse(send), b, ShardingSpec.parse(recv))
    return [HostTask(tuple(dict.fromkeys(host_of[r] for r in u.senders)),
                     tuple(dict.fromkeys(host_of[r] for r in u.receivers)), u.bytes) for u in units]


@pytest.mark.parametrize("seed", range(8))
def test_greedy_is_within_10_percent_of_dfs_on_random_cases_up_to_20_tasks(seed):
    tasks = random_tasks(seed, 6 + 2 * seed)
    dfs = balance(tasks, "dfs", "broadcast", 16, BW, budget_s=0.5)
    greedy = balance(tasks, "greedy", "broadcast", 16, BW, budget_s=0.5, seed=seed)
    assert greedy.makespan_s <= 1.1 * dfs.makespan_s


@pytest.mark.parametrize("send, recv, src_shape, dst_shape", [
    ("S01R", "S0R", (2, 4), (2, 4)), ("RS1", "S0R", (2, 4), (2, 4)), ("S0R", "S1R", (2, 4), (2, 4)),
    ("S0S1", "S1S0", (2, 4), (2, 4)),
    ("S0S1", "S1S0", (4, 2), (3, 4)),  # unequal slices: cuts of 4 and 3 shards
    ("S01R", "S0R", (2, 4), (3, 2)),
])
def test_greedy_is_within_10_percent_of_dfs_on_paper_cases(send, recv, src_shape, dst_shape):
    tasks = paper_like_tasks(send, recv, src_shape, dst_shape)
    assert len(tasks) <= 20
    dfs = balance(tasks, "dfs", "broadcast", 16, BW, budget_s=0.5)
    greedy = balance(tasks, "greedy", "broadcast", 16, BW, budget_s=0.5)
    assert greedy.makespan_s <= 1.1 * dfs.makespan_s


@pytest.mark.parametrize("balancer", ["dfs", "greedy"])
def test_search_stops_at_its_budget(balancer):
    tasks = random_tasks(1, 60, hosts=6)
    began = time.monotonic()
    sched = balance(tasks, balancer, "broadcast", 16, BW, budget_s=0.2)
    # A generous margin for a loaded 2-core machine: the check runs every 256 nodes / each try.
    assert time.monotonic() - began < 0.2 + 1.0
    assert_valid(tasks, sched)


def test_dfs_reports_an_unfinished_search():
    sched = balance(random_tasks(1, 60, hosts=6), "dfs", "broadcast", 16, BW, budget_s=0.05)
    assert not sched.finished


def test_greedy_is_reproducible_for_a_seed():
    tasks = random_tasks(3, 30)
    one = balance(tasks, "greedy", "broadcast", 16, BW, budget_s=10.0, seed=7)
    two = balance(tasks, "greedy", "broadcast", 16, BW, budget_s=10.0, seed=7)
    assert one == two


def test_no_tasks_gives_an_empty_schedule():
    sched = balance([], "dfs", "broadcast", 16, BW)
    assert sched.makespan_s == 0.0 and sched.sender_host == () and sched.lower_bound_s == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"balancer": "best"}, "balancer 'best' is invalid: one of naive, load_balance, dfs, greedy"),
    ({"strategy": "ring"}, "strategy 'ring' is invalid: one of send_recv"),
    ({"nic_bytes_per_s": 0}, "nic_bytes_per_s 0 is invalid"),
    ({"chunks": 0}, "chunks 0 is invalid: an integer >= 1"),
    ({"budget_s": -1}, "budget_s -1 is invalid"),
])
def test_bad_arguments_are_rejected_with_what_is_allowed(kwargs, message):
    args = {"tasks": [HostTask((0,), (1,), 8)], "balancer": "dfs", "strategy": "broadcast", "chunks": 4,
            "nic_bytes_per_s": BW, **kwargs}
    with pytest.raises(ValueError, match=message):
        balance(**args)


def test_a_task_without_senders_is_rejected():
    with pytest.raises(ValueError, match=r"tasks\[0\]"):
        balance([HostTask((), (1,), 8)], "naive", "broadcast", 4, BW)


def test_an_unfinished_search_stops_at_the_same_point_on_every_run():
    """Ranks plan independently: a budget that runs out must not depend on machine load."""
    from meshjob_bench.planner import random_tasks

    tasks = random_tasks(0)
    runs = [balance(tasks, "dfs", "broadcast", 16, 1.25e8, budget_s=0.05) for _ in range(3)]
    assert not runs[0].finished
    assert all(r == runs[0] for r in runs)
    greedy = [balance(tasks, "greedy", "broadcast", 16, 1.25e8, budget_s=0.05, seed=3) for _ in range(3)]
    assert all(r == greedy[0] for r in greedy)
