"""Host-level load balancing and ordering on the network model: bound, validity, the four balancers."""

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjob.layout.mesh import Mesh
from meshjob.layout.sharding import ShardingSpec
from meshjob.network.host_task import HostTask
from meshjob.network.model import NetworkModel
from meshjob.resharding.balance import BALANCERS, Schedule, balance, list_schedule
from meshjob.resharding.strategies import task_cost
from meshjob.resharding.tasks import decompose

BW = 1000.0  # bytes per second: t = bytes / 1000
# The paper's setting: bytes only (no per-message cost, free intra-host copies)
BYTES_ONLY = {"nic_bytes_per_s": BW, "message_s": 0.0, "intra_message_s": 0.0, "intra_host_bytes_per_s": 1e15}
FULL = NetworkModel(**BYTES_ONLY)
HALF = NetworkModel(**BYTES_ONLY, duplex="half")


# ---------------------------------------------------------------- invariants of every schedule
def spans(task, sender, strategy, chunks, network):
    """(link, from, to) of the task relative to its start."""
    return [(link, off, off + busy) for link, off, busy in task_cost(network, task, sender, strategy, chunks).holds()]


def assert_valid(tasks, sched: Schedule, strategy="broadcast", chunks=4, network=FULL):
    """Senders hold the slice, no link is held by two tasks at once, each start is the earliest
    its links allow given the tasks before it (list scheduling), makespan >= lower bound."""
    assert len(sched.sender_host) == len(tasks)
    for i, task in enumerate(tasks):
        assert sched.sender_host[i] in task.sender_hosts
    held = {i: spans(tasks[i], sched.sender_host[i], strategy, chunks, network) for i in range(len(tasks))}
    end = [s + d for s, d in zip(sched.start_s, sched.seconds)]
    free: dict = {}
    for i in sched.order:
        assert sched.start_s[i] == pytest.approx(max([0.0] + [free.get(link, 0.0) - a for link, a, _ in held[i]]))
        for link, a, b in held[i]:
            assert sched.start_s[i] + a >= free.get(link, 0.0) - 1e-9, f"task {i} overlaps on {link}"
            free[link] = sched.start_s[i] + b
    assert sched.makespan_s == pytest.approx(max(end, default=0.0))
    assert sched.makespan_s >= sched.lower_bound_s - 1e-9


# ---------------------------------------------------------------- lower bound
def test_lower_bound_counts_what_each_receiving_host_must_take_in():
    tasks = [HostTask((0, 1), (2,), 1000), HostTask((0, 1), (2, 3), 3000)]
    # Host 2 takes in 4000 bytes; the pooled senders share 4000 over 2 hosts.
    assert FULL.lower_bound(tasks) == pytest.approx(4.0)


def test_lower_bound_counts_what_only_one_host_holds():
    tasks = [HostTask((0,), (1,), 1000), HostTask((0,), (2,), 1000), HostTask((0,), (3,), 1000)]
    assert FULL.lower_bound(tasks) == pytest.approx(3.0)


def test_lower_bound_shares_replicated_sends_among_the_holders():
    tasks = [HostTask((0, 1), (h,), 1000) for h in (2, 3, 4, 5)]
    assert FULL.lower_bound(tasks) == pytest.approx(2.0)


def test_full_duplex_bound_keeps_a_hosts_sending_and_receiving_apart_half_duplex_adds_them():
    tasks = [HostTask((0,), (1,), 1000), HostTask((1,), (0,), 1000)]
    assert FULL.lower_bound(tasks) == pytest.approx(1.0)
    assert HALF.lower_bound(tasks) == pytest.approx(2.0)


def test_lower_bound_counts_one_message_per_task_on_each_link():
    timed = NetworkModel(nic_bytes_per_s=BW, message_s=0.5)
    assert timed.lower_bound([HostTask((0,), (1,), 1000)] * 3) == pytest.approx(3 * 1.5)


@st.composite
def host_task_lists(draw, max_tasks=8, hosts=4):
    n = draw(st.integers(1, max_tasks))
    tasks = []
    for _ in range(n):
        senders = draw(st.lists(st.integers(0, hosts - 1), min_size=1, max_size=2, unique=True))
        receivers = draw(st.lists(st.integers(hosts, 2 * hosts - 1), min_size=1, max_size=3, unique=True))
        tasks.append(HostTask(tuple(senders), tuple(receivers), draw(st.sampled_from([1000, 2000, 4000]))))
    return tasks


NETWORKS = {
    "full": FULL,
    "half": HALF,
    "timed": NetworkModel(nic_bytes_per_s=BW, message_s=0.01, intra_host_bytes_per_s=8 * BW),
}


@pytest.mark.parametrize("balancer", BALANCERS)
@pytest.mark.parametrize("network", NETWORKS, ids=list(NETWORKS))
@settings(max_examples=25, deadline=None)
@given(
    tasks=host_task_lists(), strategy=st.sampled_from(["send_recv", "broadcast", "global_allgather", "local_allgather"])
)
def test_every_balancer_gives_a_valid_schedule_at_or_above_the_lower_bound(balancer, network, tasks, strategy):
    sched = balance(tasks, balancer, strategy, NETWORKS[network], 4, budget_s=0.2)
    assert sched.balancer == balancer
    assert_valid(tasks, sched, strategy, 4, NETWORKS[network])


@pytest.mark.parametrize("network", NETWORKS, ids=list(NETWORKS))
def test_tasks_sharing_a_sender_host_with_receivers_are_valid_too(network):
    tasks = [HostTask((0, 1), (1, 2), 1000), HostTask((1,), (0, 2), 2000), HostTask((2,), (0,), 500)]
    for balancer in BALANCERS:
        sched = balance(tasks, balancer, "broadcast", NETWORKS[network], 4, budget_s=0.2)
        assert_valid(tasks, sched, "broadcast", 4, NETWORKS[network])


def test_full_duplex_runs_opposite_transfers_at_once_half_duplex_one_after_the_other():
    tasks = [HostTask((0,), (1,), 1000), HostTask((1,), (0,), 1000)]
    assert balance(tasks, "greedy", "broadcast", FULL).makespan_s == pytest.approx(1.0)
    assert balance(tasks, "greedy", "broadcast", HALF).makespan_s == pytest.approx(2.0)


def test_a_chain_frees_the_senders_out_link_for_the_next_task_while_it_forwards():
    # 0 -> 1 -> 2 (K=1): host 0's out-link is needed only for the first hop, so a second task
    # from host 0 to host 3 starts after it, not after the whole chain.
    tasks = [HostTask((0,), (1, 2), 1000), HostTask((0,), (3,), 1000)]
    sched = list_schedule(tasks, [0, 0], [0, 1], "broadcast", FULL, 1)
    assert sched.start_s == (0.0, 1.0) and sched.makespan_s == pytest.approx(2.0)
    assert list_schedule(tasks, [0, 0], [0, 1], "broadcast", HALF, 1).start_s == (0.0, 2.0)


def test_list_schedule_rejects_a_sender_that_does_not_hold_the_slice():
    with pytest.raises(ValueError, match="host 5 is invalid: one of its sender hosts"):
        list_schedule([HostTask((0,), (1,), 8)], [5], [0], "broadcast", FULL)


# ---------------------------------------------------------------- the balancers
def test_naive_takes_the_lowest_index_sender_host_in_the_given_order():
    tasks = [HostTask((3, 1), (5,), 1000), HostTask((2, 1), (6,), 1000), HostTask((1,), (7,), 1000)]
    sched = balance(tasks, "naive", "send_recv", FULL, 1)
    assert sched.sender_host == (1, 1, 1)
    assert sched.start_s == (0.0, 1.0, 2.0)


def test_load_balance_puts_the_longest_task_first_on_the_least_loaded_host():
    tasks = [HostTask((0, 1), (2,), 1000), HostTask((0, 1), (3,), 3000), HostTask((0, 1), (4,), 2000)]
    sched = balance(tasks, "load_balance", "send_recv", FULL, 1)
    assert sched.sender_host == (1, 0, 1)  # 3000 -> host 0; 2000 -> host 1; 1000 -> host 1 (2 < 3)
    assert sched.makespan_s == pytest.approx(3.0)


def exhaustive_optimum(tasks, strategy, chunks, network):
    """Min makespan over every order and every sender choice (list scheduling)."""
    best = float("inf")
    for order in itertools.permutations(range(len(tasks))):
        for senders in itertools.product(*(tasks[i].sender_hosts for i in order)):
            free, makespan = {}, 0.0
            for i, s in zip(order, senders):
                held = spans(tasks[i], s, strategy, chunks, network)
                begin = max([0.0] + [free.get(link, 0.0) - a for link, a, _ in held])
                free.update({link: begin + b for link, _, b in held})
                makespan = max(makespan, begin + task_cost(network, tasks[i], s, strategy, chunks).seconds)
            best = min(best, makespan)
    return best


def test_dfs_branches_on_tasks_that_start_after_another_could_finish():
    """Hypothesis's counterexample to active-schedule pruning: tasks hold several links at once."""
    tasks = [
        HostTask((1, 2), (5, 3, 4), 1000),
        HostTask((1,), (4, 3), 1000),
        HostTask((0,), (3,), 1000),
        HostTask((1, 2), (4,), 1000),
    ]
    sched = balance(tasks, "dfs", "send_recv", FULL, 4, budget_s=5.0)
    assert sched.finished and sched.makespan_s == pytest.approx(4.0)
    assert exhaustive_optimum(tasks, "send_recv", 4, FULL) == pytest.approx(4.0)


@pytest.mark.parametrize("network", ["full", "half"])
@settings(max_examples=40, deadline=None)
@given(tasks=host_task_lists(max_tasks=5, hosts=3), strategy=st.sampled_from(["send_recv", "broadcast"]))
def test_dfs_is_optimal_on_small_cases(network, tasks, strategy):
    sched = balance(tasks, "dfs", strategy, NETWORKS[network], 4, budget_s=5.0)
    assert sched.finished
    assert sched.makespan_s == pytest.approx(exhaustive_optimum(tasks, strategy, 4, NETWORKS[network]))


def test_dfs_beats_naive_when_order_matters():
    # In the given order host 1's short task waits for host 2, and its long task waits for that;
    # dfs runs both long tasks at once and the short one after.
    tasks = [HostTask((0,), (2,), 3000), HostTask((1,), (2,), 1000), HostTask((1,), (3,), 3000)]
    naive = balance(tasks, "naive", "send_recv", FULL, 1)
    dfs = balance(tasks, "dfs", "send_recv", FULL, 1)
    assert naive.makespan_s == pytest.approx(7.0) and dfs.makespan_s == pytest.approx(4.0)


def random_tasks(seed, n, hosts=4):
    rng = random.Random(seed)
    return [
        HostTask(
            tuple(rng.sample(range(hosts), rng.randint(1, 2))),
            tuple(rng.sample(range(hosts, 2 * hosts), rng.randint(1, 3))),
            rng.choice([1000, 2000, 4000]),
        )
        for _ in range(n)
    ]


def paper_like_tasks(send, recv, src_shape=(2, 4), dst_shape=(2, 4), tensor=(96, 96)):
    """Mesh -> mesh on disjoint hosts, one host per mesh row."""
    a = Mesh.grid(src_shape)
    b = Mesh.grid(dst_shape, first_rank=a.size, first_host=src_shape[0])
    host_of = {**{r: a.host_of(r) for r in a.ranks}, **{r: b.host_of(r) for r in b.ranks}}
    units = decompose(tensor, a, ShardingSpec.parse(send), b, ShardingSpec.parse(recv))
    return [
        HostTask(
            tuple(dict.fromkeys(host_of[r] for r in u.senders)),
            tuple(dict.fromkeys(host_of[r] for r in u.receivers)),
            u.bytes,
        )
        for u in units
    ]


@pytest.mark.parametrize("seed", range(8))
def test_greedy_is_within_10_percent_of_dfs_on_random_cases_up_to_20_tasks(seed):
    tasks = random_tasks(seed, 6 + 2 * seed)
    dfs = balance(tasks, "dfs", "broadcast", FULL, 16, budget_s=0.5)
    greedy = balance(tasks, "greedy", "broadcast", FULL, 16, budget_s=0.5, seed=seed)
    assert greedy.makespan_s <= 1.1 * dfs.makespan_s


@pytest.mark.parametrize(
    "send, recv, src_shape, dst_shape",
    [
        ("S01R", "S0R", (2, 4), (2, 4)),
        ("RS1", "S0R", (2, 4), (2, 4)),
        ("S0R", "S1R", (2, 4), (2, 4)),
        ("S0S1", "S1S0", (2, 4), (2, 4)),
        ("S0S1", "S1S0", (4, 2), (3, 4)),  # unequal slices: cuts of 4 and 3 shards
        ("S01R", "S0R", (2, 4), (3, 2)),
    ],
)
def test_greedy_is_within_10_percent_of_dfs_on_paper_cases(send, recv, src_shape, dst_shape):
    tasks = paper_like_tasks(send, recv, src_shape, dst_shape)
    assert len(tasks) <= 20
    dfs = balance(tasks, "dfs", "broadcast", FULL, 16, budget_s=0.5)
    greedy = balance(tasks, "greedy", "broadcast", FULL, 16, budget_s=0.5)
    assert greedy.makespan_s <= 1.1 * dfs.makespan_s


@pytest.mark.parametrize("balancer", ["dfs", "greedy"])
def test_search_stops_at_its_budget(balancer):
    tasks = random_tasks(1, 60, hosts=6)
    began = time.process_time()  # this process's CPU time: other processes on the machine do not count
    sched = balance(tasks, balancer, "broadcast", FULL, 16, budget_s=0.2)
    # Budgets are work units calibrated to about a CPU second per budget second: a generous margin.
    assert time.process_time() - began < 0.2 + 1.0
    assert_valid(tasks, sched, "broadcast", 16)


def test_dfs_reports_an_unfinished_search():
    sched = balance(random_tasks(1, 60, hosts=6), "dfs", "broadcast", FULL, 16, budget_s=0.05)
    assert not sched.finished


def test_greedy_is_reproducible_for_a_seed():
    tasks = random_tasks(3, 30)
    one = balance(tasks, "greedy", "broadcast", FULL, 16, budget_s=10.0, seed=7)
    two = balance(tasks, "greedy", "broadcast", FULL, 16, budget_s=10.0, seed=7)
    assert one == two


def test_no_tasks_gives_an_empty_schedule():
    sched = balance([], "dfs", "broadcast", FULL, 16)
    assert sched.makespan_s == 0.0 and sched.sender_host == () and sched.lower_bound_s == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"balancer": "best"}, "balancer 'best' is invalid: one of naive, load_balance, dfs, greedy"),
        ({"strategy": "ring"}, "strategy 'ring' is invalid: one of send_recv"),
        ({"network": 1e9}, "network 1000000000.0 is invalid: a meshjob.network.model.NetworkModel"),
        ({"chunks": 0}, "chunks 0 is invalid: auto or an integer >= 1"),
        ({"chunks": "many"}, "chunks 'many' is invalid: auto or an integer >= 1"),
        ({"budget_s": -1}, "budget_s -1 is invalid"),
    ],
)
def test_bad_arguments_are_rejected_with_what_is_allowed(kwargs, message):
    args = {
        "tasks": [HostTask((0,), (1,), 8)],
        "balancer": "dfs",
        "strategy": "broadcast",
        "chunks": 4,
        "network": FULL,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        balance(**args)


def test_a_task_without_senders_is_rejected():
    with pytest.raises(ValueError, match=r"tasks\[0\]"):
        balance([HostTask((), (1,), 8)], "naive", "broadcast", FULL, 4)


def test_an_unfinished_search_stops_at_the_same_point_on_every_run():
    """Ranks plan independently: a budget that runs out must not depend on machine load."""
    from meshjob_bench.planner import random_tasks

    tasks = random_tasks(0)
    network = NetworkModel(nic_bytes_per_s=1.25e8)
    runs = [balance(tasks, "dfs", "broadcast", network, 16, budget_s=0.05) for _ in range(3)]
    assert not runs[0].finished
    assert all(r == runs[0] for r in runs)
    greedy = [balance(tasks, "greedy", "broadcast", network, 16, budget_s=0.05, seed=3) for _ in range(3)]
    assert all(r == greedy[0] for r in greedy)


def test_on_shared_cores_no_schedule_ends_before_the_cores_did_every_tasks_messages():
    from meshjob.network.host_task import HostTask
    from meshjob.network.model import NetworkModel
    from meshjob.resharding.balance import list_schedule

    shared = NetworkModel(nic_bytes_per_s=1.25e8, shared_cpu_cores=2, message_cpu_s=1e-3)
    tasks = [HostTask((0,), (2,), 2**20), HostTask((1,), (3,), 2**20)]  # disjoint links: they run side by side
    each = [task_cost(shared, t, t.sender_hosts[0], "broadcast", 64) for t in tasks]
    plan = list_schedule(tasks, [0, 1], [0, 1], "broadcast", shared, 64)
    assert plan.makespan_s == pytest.approx(sum(c.cpu_s for c in each)) and plan.makespan_s > max(
        c.seconds for c in each
    )


def test_on_shared_cores_the_links_and_the_cores_contend_over_the_whole_schedule():
    from meshjob.network.host_task import HostTask
    from meshjob.network.model import NetworkModel

    shared = NetworkModel(nic_bytes_per_s=1.25e8, shared_cpu_cores=2, message_cpu_s=3e-4, cpu_contention_p=4.0)
    tasks = [HostTask((0,), (2,), 2**20), HostTask((1,), (3,), 2**20)]  # disjoint links: they run side by side
    each = [task_cost(shared, t, t.sender_hosts[0], "broadcast", 64) for t in tasks]
    plan = list_schedule(tasks, [0, 1], [0, 1], "broadcast", shared, 64)
    on_links, cpu = max(c.link_s for c in each), sum(c.cpu_s for c in each)
    assert plan.makespan_s == pytest.approx(shared.with_cpu(on_links, cpu))
    assert plan.makespan_s > max(max(c.seconds for c in each), cpu) * 1.01
