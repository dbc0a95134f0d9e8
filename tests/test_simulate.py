"""The simulator against analytic cases: broadcast chains, send/recv fan-out, 1F1B bubbles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshjob.network.model import NetworkModel
from meshjob.resharding.strategies import task_cost
from meshjob.resharding.tasks import Step
from meshjob.schedule.actions import Action, generate
from meshjob.schedule.boundary import BoundaryKey
from meshjob.simulate.simulator import (
    CostModel,
    broadcast_time,
    bubble_1f1b,
    simulate_pipeline,
    simulate_transfer,
)

MiB = 2**20
BYTES_ONLY = {"message_s": 0.0, "intra_message_s": 0.0}
COST = NetworkModel(nic_bytes_per_s=100 * MiB, intra_host_bytes_per_s=1e15, **BYTES_ONLY)


def host_of_rank(rank: int) -> int:
    return rank  # one device per host in the hand-built cases


def chain_steps(hosts: int, chunks: int, nbytes: int) -> list[Step]:
    """Broadcast from rank 0 to ranks 1..hosts as a chain of `chunks` pieces (1-D regions of float32)."""
    elems = nbytes // 4
    per = elems // chunks
    steps, sid = [], 0
    last_hop: dict[int, int] = {}
    for k in range(chunks):
        region = ((k * per, (k + 1) * per),)
        for h in range(1, hosts + 1):
            after = (last_hop[k],) if h > 1 else ()
            steps.append(
                Step(id=sid, task=0, src=h - 1, dst=h, region=region, after=after, scope="cross_host", signal=False)
            )
            last_hop[k] = sid
            sid += 1
    return steps


@pytest.mark.parametrize("hosts,chunks", [(1, 1), (2, 4), (4, 16), (3, 64)])
def test_broadcast_chain_matches_t_plus_a_minus_1_t_over_k(hosts, chunks):
    nbytes = 64 * MiB
    t = nbytes / COST.nic_bytes_per_s
    result = simulate_transfer(chain_steps(hosts, chunks, nbytes), host_of_rank, COST)
    assert result.makespan_s == pytest.approx(broadcast_time(t, hosts, chunks), rel=1e-9)


def test_send_recv_fan_out_serializes_on_the_sender_nic():
    nbytes, receivers = 8 * MiB, 5
    steps = [
        Step(id=i, task=0, src=0, dst=i + 1, region=((0, nbytes // 4),), after=(), scope="cross_host", signal=False)
        for i in range(receivers)
    ]
    result = simulate_transfer(steps, host_of_rank, COST)
    assert result.makespan_s == pytest.approx(receivers * nbytes / COST.nic_bytes_per_s)
    assert result.nic_busy_s[(0, "out")] == pytest.approx(result.makespan_s)


def test_transfers_on_disjoint_links_run_in_parallel():
    nbytes = 8 * MiB
    steps = [
        Step(id=0, task=0, src=0, dst=1, region=((0, nbytes // 4),), after=(), scope="cross_host", signal=False),
        Step(id=1, task=1, src=2, dst=3, region=((0, nbytes // 4),), after=(), scope="cross_host", signal=False),
    ]
    result = simulate_transfer(steps, host_of_rank, COST)
    assert result.makespan_s == pytest.approx(nbytes / COST.nic_bytes_per_s)


def test_signal_steps_cost_one_byte():
    steps = chain_steps(3, 1, 64 * MiB)
    signal = [
        Step(id=s.id, task=s.task, src=s.src, dst=s.dst, region=s.region, after=s.after, scope=s.scope, signal=True)
        for s in steps
    ]
    assert simulate_transfer(signal, host_of_rank, COST).makespan_s == pytest.approx(3 / COST.nic_bytes_per_s)


def test_every_message_pays_the_per_message_cost_on_its_links():
    timed = NetworkModel(nic_bytes_per_s=100 * MiB, intra_host_bytes_per_s=1e15, message_s=1e-3)
    nbytes, hosts, chunks = 64 * MiB, 3, 16
    result = simulate_transfer(chain_steps(hosts, chunks, nbytes), host_of_rank, timed)
    per_chunk = nbytes / chunks / timed.nic_bytes_per_s + 1e-3
    assert result.makespan_s == pytest.approx((chunks + hosts - 1) * per_chunk)


def test_a_message_that_runs_alone_on_its_nic_link_pays_the_alone_cost_and_a_small_one_does_not():
    """Chunks above alone_bytes are held by the executor until they have left, so the next one's cost no
    longer overlaps them: the simulator charges alone_message_s on each, as the chain formula does."""
    held = NetworkModel(
        nic_bytes_per_s=100 * MiB, intra_host_bytes_per_s=1e15, message_s=1e-4, alone_bytes=MiB, alone_message_s=1e-3
    )
    nbytes, hosts = 64 * MiB, 3
    for chunks, alone in ((16, 1e-3), (64, 0.0)):  # 4 MiB chunks run alone, 1 MiB ones do not
        result = simulate_transfer(chain_steps(hosts, chunks, nbytes), host_of_rank, held)
        per_chunk = nbytes / chunks / held.nic_bytes_per_s + 1e-4 + alone
        assert result.makespan_s == pytest.approx((chunks + hosts - 1) * per_chunk)


def test_half_duplex_makes_a_host_send_and_receive_one_after_the_other():
    half = NetworkModel(nic_bytes_per_s=100 * MiB, duplex="half", **BYTES_ONLY)
    nbytes = 8 * MiB
    steps = [
        Step(id=0, task=0, src=0, dst=1, region=((0, nbytes // 4),), after=(), scope="cross_host", signal=False),
        Step(id=1, task=1, src=1, dst=0, region=((0, nbytes // 4),), after=(), scope="cross_host", signal=False),
    ]
    t = nbytes / half.nic_bytes_per_s
    assert simulate_transfer(steps, host_of_rank, half).makespan_s == pytest.approx(2 * t)
    assert simulate_transfer(steps, host_of_rank, COST).makespan_s == pytest.approx(t)


def test_a_step_waiting_on_a_missing_step_is_reported():
    steps = [Step(id=0, task=0, src=0, dst=1, region=((0, 4),), after=(7,), scope="cross_host", signal=False)]
    with pytest.raises(ValueError, match="never run"):
        simulate_transfer(steps, host_of_rank, COST)


def chain_edges(stages: int) -> list[tuple[int, int, str]]:
    return [(i, i + 1, "activation") for i in range(stages - 1)]


def free_transfers(stages: int) -> dict:
    out = {}
    for i in range(stages - 1):
        out[BoundaryKey(i, i + 1, "activation")] = (0.0, {})
        out[BoundaryKey(i + 1, i, "activation", grad=True)] = (0.0, {})
    return out


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 4), (3, 12)])
def test_bubble_fraction_without_communication_is_s_minus_1_over_m_plus_s_minus_1(kind, stages, microbatches):
    schedules = generate(kind, stages, microbatches, chain_edges(stages))
    f = 1.0
    compute = {(s, k): v for s in range(stages) for k, v in (("F", f), ("B", 2 * f), ("I", f), ("W", f))}
    result = simulate_pipeline(schedules, compute, free_transfers(stages))
    assert result.step_s == pytest.approx((microbatches + stages - 1) * 3 * f)
    for stats in result.stages.values():
        assert stats.bubble_fraction(result.step_s) == pytest.approx(bubble_1f1b(stages, microbatches))


def test_eager_1f1b_hides_communication_that_1f1b_exposes():
    stages, microbatches = 4, 8
    compute = {(s, k): v for s in range(stages) for k, v in (("F", 1.0), ("B", 2.0), ("I", 1.0), ("W", 1.0))}
    transfers = {k: (1.0, {(i, "out"): 0.0}) for i, k in enumerate(free_transfers(stages))}
    one = simulate_pipeline(generate("1f1b", stages, microbatches, chain_edges(stages)), compute, transfers)
    eager = simulate_pipeline(generate("eager-1f1b", stages, microbatches, chain_edges(stages)), compute, transfers)
    assert eager.step_s < one.step_s
    exposed = lambda r: sum(s.exposed_comm_s for s in r.stages.values())  # noqa: E731
    assert exposed(eager) < exposed(one)


def test_a_schedule_whose_recv_never_gets_a_send_is_reported_as_deadlock():
    schedules = {0: [Action("F", 0, None)], 1: [Action("RECV_F", 0, 0), Action("F", 0, None)]}
    compute = {(s, "F"): 1.0 for s in range(2)}
    with pytest.raises(ValueError, match="deadlock"):
        simulate_pipeline(schedules, compute, {BoundaryKey(0, 1, "activation"): (0.0, {})})


@pytest.mark.slow
def test_calibration_measures_positive_costs_and_the_cli_uses_them():
    import json
    import subprocess
    import sys

    from meshjob.spec.manifest import load_job
    from meshjob_trainer.calibrate import measure_costs

    costs = measure_costs(load_job("examples/tiny.yaml"), repeats=1)
    assert costs["layer_forward_s"] > 0 and costs["backward_factor"] > 0
    out = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "simulate", "examples/tiny.yaml", "--calibrate", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["cost_model"]["layer_forward_s"] != CostModel().layer_forward_s
    assert report["cost_model"]["measured"] is True
    assert report["step_s"] > 0


def test_a_job_spread_over_more_hosts_keeps_its_stages_and_grows_data_parallel():
    from meshjob.plan.build import build_plan
    from meshjob.simulate.simulator import scale_job
    from meshjob.spec.manifest import load_job

    job = scale_job(load_job("examples/gpt-demo.yaml"), 64)
    assert len(job.stages) == 4 and all(s.mesh[0] == 16 and s.data_parallel == 16 for s in job.stages)
    assert job.training.microbatch_size % 16 == 0
    assert build_plan(job).placement.world_size == 16 * (2 + 1 + 2 + 1)


def test_cli_rejects_a_bad_nic_rate_with_exit_2():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "simulate", "examples/tiny.yaml", "--nic-rate", "fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--nic-rate" in out.stderr and "gbit" in out.stderr


def test_a_token_bucket_lets_a_burst_leave_at_line_rate_then_refills_at_the_nic_rate():
    cost = NetworkModel(nic_bytes_per_s=1e6, burst_bytes=100e3, line_bytes_per_s=1e9, **BYTES_ONLY)
    steps = [
        Step(id=i, task=i, src=0, dst=1, region=((0, 20_000),), after=(), scope="cross_host", signal=False)
        for i in range(2)
    ]  # 80 kB each
    result = simulate_transfer(steps, host_of_rank, cost)
    assert result.finish_s[0] == pytest.approx(80e3 / 1e9)  # within the bucket: line rate
    # the second finds 20 kB of tokens (+ a little refill) and waits for the other 60 kB at the NIC rate
    refill = 80e3 / 1e9 * 1e6  # tokens regained while the first left
    assert result.finish_s[1] == pytest.approx(80e3 / 1e9 + (80e3 - 20e3 - refill) / 1e6, rel=1e-6)


def test_without_a_bucket_the_nic_rate_applies_from_the_first_byte():
    steps = [Step(id=0, task=0, src=0, dst=1, region=((0, 20_000),), after=(), scope="cross_host", signal=False)]
    plain = NetworkModel(nic_bytes_per_s=1e6, **BYTES_ONLY)
    assert simulate_transfer(steps, host_of_rank, plain).makespan_s == pytest.approx(0.08)


def test_on_shared_cores_a_transfer_ends_no_sooner_than_its_messages_cpu_work():
    steps = chain_steps(hosts=4, chunks=64, nbytes=4 * MiB)
    links_only = simulate_transfer(steps, host_of_rank, COST).makespan_s
    shared = NetworkModel(
        nic_bytes_per_s=100 * MiB, intra_host_bytes_per_s=1e15, shared_cpu_cores=2, message_cpu_s=2e-3, **BYTES_ONLY
    )
    assert simulate_transfer(steps, host_of_rank, shared).makespan_s == pytest.approx(len(steps) * 2e-3 / 2)
    assert len(steps) * 2e-3 / 2 > links_only
    cheap = NetworkModel(
        nic_bytes_per_s=100 * MiB, intra_host_bytes_per_s=1e15, shared_cpu_cores=2, message_cpu_s=1e-6, **BYTES_ONLY
    )
    assert simulate_transfer(steps, host_of_rank, cheap).makespan_s == pytest.approx(links_only)


def test_a_transfer_reports_its_time_on_the_links_and_the_cpu_its_messages_are_priced_at():
    steps = chain_steps(hosts=2, chunks=8, nbytes=MiB)
    shared = NetworkModel(
        nic_bytes_per_s=100 * MiB,
        intra_host_bytes_per_s=1e15,
        shared_cpu_cores=2,
        message_cpu_s=1e-3,
        net_byte_cpu_s=2e-9,
        **BYTES_ONLY,
    )
    result = simulate_transfer(steps, host_of_rank, shared)
    assert result.cpu_work_s == pytest.approx(16 * 1e-3 + 2 * MiB * 2e-9)  # 16 messages of 1/8 MiB, all cores
    assert result.link_s == pytest.approx(simulate_transfer(steps, host_of_rank, COST).makespan_s)
    assert result.makespan_s == pytest.approx(shared.with_cpu(result.link_s, result.cpu_work_s / 2))
    unmodelled = simulate_transfer(steps, host_of_rank, COST)
    assert unmodelled.cpu_work_s == 0 and unmodelled.makespan_s == unmodelled.link_s


def two_senders_into_one_host() -> tuple[dict, dict, dict]:
    """Stages 0 and 1 each send one activation to stage 2 (one host each); stage 1 is ready first."""
    to_2 = {0: BoundaryKey(0, 2, "activation"), 1: BoundaryKey(1, 2, "activation")}
    schedules = {
        0: [Action("F", 0, None), Action("SEND_F", 0, 2)],
        1: [Action("F", 0, None), Action("SEND_F", 0, 2)],
        2: [Action("RECV_F", 0, 0), Action("RECV_F", 0, 1), Action("F", 0, None)],
    }
    compute = {(0, "F"): 2.0, (1, "F"): 1.0, (2, "F"): 1.0}
    nbytes = CostModel().nic_bytes_per_s  # one second on the default NIC
    transfers = {key: (1.0, {(src, "out"): nbytes, (2, "in"): nbytes}) for src, key in to_2.items()}
    return schedules, compute, transfers


def test_without_a_planned_order_a_link_takes_transfers_as_they_are_sent():
    schedules, compute, transfers = two_senders_into_one_host()
    result = simulate_pipeline(schedules, compute, transfers)
    # stage 1's transfer holds host 2's in-link over [1, 2], stage 0's over [2, 3]; then F
    assert result.step_s == pytest.approx(4.0)


def test_a_link_carries_transfers_in_the_planned_order_even_when_a_later_one_is_sent_first():
    schedules, compute, transfers = two_senders_into_one_host()
    first_0 = [(BoundaryKey(0, 2, "activation"), 0), (BoundaryKey(1, 2, "activation"), 0)]
    result = simulate_pipeline(schedules, compute, transfers, order=first_0)
    # stage 1's transfer waits on host 2's in-link until stage 0's, sent at 2, is through at 3
    assert result.step_s == pytest.approx(5.0)
    assert result.stages[1].comm_s == pytest.approx(3.0)  # sent at 1, arrived at 4


def test_a_plan_on_its_own_costs_runs_the_order_it_defines_and_on_others_keeps_it():
    from pathlib import Path

    from meshjob.plan.build import build_plan
    from meshjob.plan.comm_order import TransferOrder, fastest_order, transfer_order
    from meshjob.simulate.simulator import compute_costs, plan_cost, simulate_plan, transfer_costs
    from meshjob.spec.manifest import load_job

    plan = build_plan(load_job(str(Path(__file__).resolve().parents[1] / "examples" / "utransformer-demo.yaml")))
    own = simulate_plan(plan)
    cost = plan_cost(plan)
    assert own.step_s == fastest_order(plan.schedules, compute_costs(plan, cost), transfer_costs(plan, cost), cost)[1]
    assert own.step_s <= simulate_plan(plan, cost, follow_plan_order=False).step_s
    slow_nic = CostModel(
        network=NetworkModel(nic_bytes_per_s=plan.network.nic_bytes_per_s / 20), stages=plan_cost(plan).stages
    )
    free = simulate_plan(plan, slow_nic, follow_plan_order=False)
    planned = transfer_order(plan).transfers
    assert TransferOrder.of_run(free.order).transfers != planned  # the slow NIC alone would reorder
    kept = simulate_plan(plan, slow_nic)
    assert kept.step_s != free.step_s


def test_on_shared_cores_the_simulated_chain_is_fastest_near_the_chunks_auto_plans():
    """chunks: auto and the simulator read one model: the K it plans is at the bottom of the simulated
    U (too few chunks: the chain's fill; too many: the shared cores' messages)."""
    from meshjob.network.host_task import HostTask
    from meshjob.resharding.strategies import lower
    from meshjob.resharding.tasks import UnitTask

    model = NetworkModel(
        nic_bytes_per_s=1.25e8,
        shared_cpu_cores=2,
        message_cpu_s=530e-6,
        net_byte_cpu_s=1.4e-9,
        local_byte_cpu_s=0.75e-9,
        cpu_contention_p=4.0,
    )
    task = UnitTask(((0, 4096), (0, 1024)), (0,), tuple(range(1, 9)), 16 * MiB)  # rank 0 -> 2 hosts x 4 devices

    def host_of(rank: int) -> int:
        return 0 if rank == 0 else 1 + (rank - 1) // 4

    def simulated(k: int) -> float:
        return simulate_transfer(lower(task, 0, 0, "broadcast", k, host_of), host_of, model).makespan_s

    auto = task_cost(model, HostTask((0,), (1, 2), 16 * MiB, (4, 4), 4096), 0, "broadcast", "auto").chunks
    sweep = {k: simulated(k) for k in (1, 4, 16, 64, 256)}
    assert sweep[1] > sweep[16] < sweep[256]
    assert simulated(auto) <= 1.03 * min(sweep.values())


def paced_pair(burst_bytes: float) -> tuple[dict, dict, NetworkModel, int]:
    """Stage 0 sends two activations to stage 1 (another host), each one step of 4 MiB above alone_bytes."""
    network = NetworkModel(
        nic_bytes_per_s=4 * 2**20, message_s=0.0, burst_bytes=burst_bytes, alone_bytes=2**20, alone_message_s=0.25
    )
    key = BoundaryKey(0, 1, "activation")
    schedules = {
        0: [Action("F", 0, None), Action("SEND_F", 0, 1), Action("F", 1, None), Action("SEND_F", 1, 1)],
        1: [Action("RECV_F", 0, 0), Action("RECV_F", 1, 0), Action("F", 0, None)],
    }
    compute = {(0, "F"): 0.0, (1, "F"): 1.0}
    return schedules, compute, network, key


def test_a_transfer_whose_messages_run_alone_holds_its_link_for_bytes_and_message_costs_the_bucket_unused():
    from meshjob.simulate.simulator import TransferCost, paced_early_s

    for burst in (0.0, 2**20):
        schedules, compute, network, key = paced_pair(burst)
        step = Step(id=0, task=0, src=0, dst=1, region=((0, 2**20),), after=(), scope="cross_host")  # 4 MiB
        res = simulate_transfer([step], lambda r: r, replace(network, burst_bytes=0.0))
        assert res.makespan_s == pytest.approx(1.25)  # 4 MiB at 4 MiB/s plus the alone message's cost
        early = paced_early_s([step], lambda r: r, res, network)
        assert early == pytest.approx(burst / network.nic_bytes_per_s)  # its last MiB left from the bucket
        transfers = {key: TransferCost(res.makespan_s, dict(res.nic_bytes), early)}
        result = simulate_pipeline(schedules, compute, transfers, CostModel(network=network))
        # back to back on one link: the second starts when the first's link time (1.25) is over
        assert result.step_s == pytest.approx(2 * 1.25 - early + 1.0)


def test_a_transfer_of_small_messages_is_not_paced():
    from meshjob.simulate.simulator import paced_early_s

    _, _, network, _ = paced_pair(2**20)
    small = Step(id=0, task=0, src=0, dst=1, region=((0, 2**10),), after=(), scope="cross_host")
    res = simulate_transfer([small], lambda r: r, network)
    assert paced_early_s([small], lambda r: r, res, network) is None
    assert paced_early_s([small], lambda r: r, res, replace(network, alone_bytes=0.0)) is None


@pytest.mark.parametrize("strategy", ["local_allgather", "global_allgather"])
@pytest.mark.parametrize(
    "devices, sender_receives", [((4,), False), ((2, 3), False), ((2, 2, 1), True), ((3, 3, 3), False)]
)
def test_a_scatter_then_ring_task_costs_what_the_simulator_times_for_its_lowered_steps(
    strategy, devices, sender_receives
):
    """The balancers' cost of an all-gather task and the simulator agree: each part's ring hops start as
    soon as it lands, overlapping the scatter (rounds one after the other over-charged it up to 1.4x)."""
    from meshjob.network.host_task import HostTask
    from meshjob.resharding.strategies import lower
    from meshjob.resharding.tasks import UnitTask

    model = NetworkModel(nic_bytes_per_s=1.25e8, message_s=100e-6, intra_host_bytes_per_s=1e9, intra_message_s=50e-6)
    first = 0 if sender_receives else 1
    hosts = [0] + [first + h for h, b in enumerate(devices) for _ in range(b)][1 if sender_receives else 0 :]
    receivers = tuple(range(0 if sender_receives else 1, len(hosts)))  # the sender, rank 0, among them or not
    task = UnitTask(((0, 720), (0, 1024)), (0,), receivers, 720 * 1024 * 4)
    simulated = simulate_transfer(lower(task, 0, 0, strategy, 1, hosts.__getitem__), hosts.__getitem__, model)
    host_task = HostTask((0,), tuple(range(first, first + len(devices))), task.bytes, devices)
    assert task_cost(model, host_task, 0, strategy, 1).seconds == pytest.approx(simulated.makespan_s, rel=1e-9)
