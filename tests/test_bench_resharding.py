"""`meshjob bench resharding`: the physical limit, the aggregation, and a smoke run on the
emulated cluster that writes a table, JSON and PNG figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshjob.layout.sharding import ShardingSpec
from meshjob.network.model import DEFAULT_INTRA_MESSAGE_S, DEFAULT_MESSAGE_S
from meshjob.resharding.tasks import decompose
from meshjob_bench.machine import gpu_visible
from meshjob_bench.resharding import Row, collect, summarize
from meshjob_bench.resharding_cases import ITEMSIZE, Case, Layout, Variant, physical_limit
from meshjob_trainer.emulate.netns import netns_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_NETNS, WHY_NOT = netns_available()


def test_layout_gives_ranks_in_first_use_order_and_remembers_hosts():
    layout = Layout()
    src = layout.grid((1, 1), 0)
    dst = layout.grid((2, 2), 1)
    assert src.ranks == (0,) and dst.ranks == (1, 2, 3, 4)
    assert dst.hosts == (1, 1, 2, 2)
    assert layout.grid((1, 1), 1).ranks == (1,)  # the same slot keeps its rank


def test_physical_limit_of_one_to_many_is_the_whole_tensor_over_the_nic_rate():
    layout = Layout()
    shape = (64, 256)
    tasks = decompose(
        shape,
        layout.grid((1, 1), 0),
        ShardingSpec.parse("RR"),
        layout.grid((3, 2), 1),
        ShardingSpec.parse("RR"),
        itemsize=ITEMSIZE,
    )
    assert physical_limit(tasks, layout.host_of, 1e6) == pytest.approx(64 * 256 * 4 / 1e6)


def test_physical_limit_counts_only_what_the_busiest_receiving_host_lacks():
    layout = Layout()
    shape = (64, 256)
    src, dst = layout.grid((2, 2), 0), layout.grid((2, 2), 2)
    # S0R -> S0R between meshes: each receiving host needs half the tensor
    tasks = decompose(shape, src, ShardingSpec.parse("S0R"), dst, ShardingSpec.parse("S0R"), itemsize=ITEMSIZE)
    assert physical_limit(tasks, layout.host_of, 1e6) == pytest.approx(64 * 256 * 4 / 2 / 1e6)


def _case(variants: list[Variant], limit_s: float) -> Case:
    layout = Layout()
    case = Case(
        "one_to_many",
        "1 -> 1x2",
        (4, 4),
        layout.grid((1, 1), 0),
        layout.grid((1, 2), 1),
        ShardingSpec.parse("RR"),
        ShardingSpec.parse("RR"),
        limit_s,
        variants,
    )
    case.boundaries = [type("B", (), {"makespan_s": 1.0, "lower_bound_s": 1.0})() for _ in variants]
    case.simulated_s = [0.45 for _ in variants]
    case.planned_s = [0.4 for _ in variants]
    return case


def test_collect_takes_the_span_over_ranks_the_median_over_repeats_and_speedups_over_baselines():
    variants = [
        Variant("send_recv", 1, "greedy"),
        Variant("global_allgather", 1, "greedy"),
        Variant("broadcast", 16, "greedy"),
    ]
    case = _case(variants, limit_s=0.5)
    events = []
    for vi, seconds in enumerate([2.0, 1.5, 0.5]):
        for rep, jitter in enumerate([0.0, 0.1, 0.5]):
            # two ranks: the span runs from the first start to the last end
            events.append(dict(case=0, variant=vi, rep=rep, start=10.0, end=10.0 + seconds / 2, correct=True))
            events.append(dict(case=0, variant=vi, rep=rep, start=10.1, end=10.0 + seconds + jitter, correct=True))
    rows = collect([case], events)
    bc = rows[2]
    assert bc.seconds == pytest.approx(0.6)  # median of 0.5, 0.6, 1.0
    assert bc.over_limit == pytest.approx(0.6 / 0.5)
    assert bc.speedup_vs_global_allgather == pytest.approx(1.6 / 0.6)
    assert bc.speedup_vs_send_recv == pytest.approx(2.1 / 0.6)
    assert all(r.correct for r in rows)
    assert bc.simulator_error == pytest.approx(0.45 / 0.6 - 1)
    assert bc.measured_over_planned == pytest.approx(0.6 / 0.4)


def test_collect_sums_cpu_and_faults_over_ranks_and_takes_their_median_over_repeats():
    case = _case([Variant("broadcast", 16, "greedy")], limit_s=0.5)
    events = [
        dict(case=0, variant=0, rep=rep, start=0.0, end=1.0, cpu=cpu, faults=faults)
        for rep, per_rank in enumerate([[(0.1, 10), (0.2, 5)], [(0.5, 100), (0.4, 50)], [(0.3, 1), (0.0, 0)]])
        for cpu, faults in per_rank
    ]
    row = collect([case], events)[0]
    assert row.cpu_seconds == pytest.approx(0.3)  # sums 0.3, 0.9, 0.3
    assert row.minor_faults == 15  # sums 15, 150, 1


def test_cpu_pricing_is_measured_over_priced_cpu_per_section_and_variant_balancers_together():
    from meshjob_bench.cpu_pricing import cpu_pricing

    variants = [
        Variant("broadcast", 16, "greedy"),
        Variant("broadcast", 16, "naive"),
        Variant("send_recv", 1, "greedy"),
        Variant("signal", 1, "greedy"),
    ]
    case = _case(variants, limit_s=0.5)
    case.simulated_cpu_s = [0.1, 0.4, 0.05, 1e-6]
    events = [dict(case=0, variant=vi, rep=0, start=0.0, end=1.0, cpu=0.2) for vi in range(len(variants))]
    rows = collect([case], events)
    assert [r.simulated_cpu_seconds for r in rows] == case.simulated_cpu_s
    pricing = cpu_pricing(rows)
    assert set(pricing) == {"one_to_many"} and set(pricing["one_to_many"]) == {"broadcast K=16", "send_recv"}
    broadcast = pricing["one_to_many"]["broadcast K=16"]
    assert broadcast["rows"] == 2 and (broadcast["least"], broadcast["most"]) == pytest.approx((0.5, 2.0))
    assert broadcast["median"] == pytest.approx(1.25)
    assert pricing["one_to_many"]["send_recv"]["median"] == pytest.approx(4.0)  # priced 4x too cheap


def test_rows_the_model_prices_no_cpu_for_are_left_out_of_the_cpu_pricing():
    from meshjob_bench.cpu_pricing import cpu_pricing

    case = _case([Variant("broadcast", 4, "greedy")], limit_s=0.5)
    case.simulated_cpu_s = [0.0]  # planned without shared cores (--message-costs default)
    rows = collect([case], [dict(case=0, variant=0, rep=0, start=0.0, end=1.0, cpu=0.2)])
    assert cpu_pricing(rows) == {}


def test_the_simulator_predicts_every_planned_variant_from_its_steps():
    from meshjob_bench.resharding_cases import Layout, bench_network, build_cases, plan_cases

    layout = Layout()
    cases = build_cases(quick=True, size_bytes=2**20, chunks=[4], nic_bytes_per_s=1.25e8, layout=layout)
    plan_cases(cases, layout, bench_network(1.25e8))
    for case in cases:
        assert len(case.simulated_s) == len(case.variants)
        for variant, boundary, simulated_s in zip(case.variants, case.boundaries, case.simulated_s):
            if variant.strategy == "signal":  # one byte per message: only the messages' own cost
                most = max(DEFAULT_MESSAGE_S, DEFAULT_INTRA_MESSAGE_S) + 1e-6
                assert simulated_s <= len(boundary.steps) * most < case.limit_s / 10
            else:  # no schedule moves the busiest receiving host's bytes faster than its NIC
                assert simulated_s >= case.limit_s * (1 - 1e-9)


def test_collect_marks_a_variant_whose_receiver_got_wrong_data():
    case = _case([Variant("broadcast", 4, "greedy")], limit_s=1.0)
    events = [
        dict(case=0, variant=0, rep=-1, start=0.0, end=1.0, correct=False),
        dict(case=0, variant=0, rep=0, start=0.0, end=1.0, correct=True),
    ]
    assert collect([case], events)[0].correct is False


def row(case: str, strategy: str, over_limit: float, vs_ga: float) -> Row:
    return Row(
        "one_to_many",
        case,
        strategy,
        1,
        "greedy",
        strategy,
        over_limit,
        [over_limit],
        1.0,
        over_limit,
        vs_ga,
        1.0,
        1.0,
        1.0,
        True,
    )


def test_summary_is_the_geometric_mean_over_cases_per_variant():
    rows = [row("a", "broadcast", 1.0, 2.0), row("b", "broadcast", 4.0, 8.0), row("a", "send_recv", 3.0, 0.5)]
    summary = summarize(rows)["one_to_many"]
    assert summary["broadcast"]["over_limit"] == pytest.approx(2.0)
    assert summary["broadcast"]["speedup_vs_global_allgather"] == pytest.approx(4.0)
    assert summary["send_recv"]["over_limit"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "option,value,allowed",
    [
        ("--chunks", "4,zero", "comma-separated positive integers or auto"),
        pytest.param(
            "--transport",
            "nccl",
            "gloo or tcp here: nccl needs a CUDA GPU, and torch sees none",
            marks=pytest.mark.skipif(gpu_visible(), reason="a GPU is visible: nccl is allowed"),
        ),
    ],
)
def test_a_bad_option_is_rejected_naming_it_its_value_and_what_is_allowed(option, value, allowed):
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "resharding", "--quick", option, value, "--out", "/nonexistent"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"{option}: '{value}' is invalid: {allowed}" in proc.stderr


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
def test_quick_run_writes_a_table_json_and_pngs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshjob.cli",
            "bench",
            "resharding",
            "--quick",
            "--nic-rate",
            "500mbit",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "NIC 500mbit" in proc.stdout and "K in {16}" in proc.stdout
    doc = json.loads((tmp_path / "resharding.json").read_text())
    assert doc["emulated"] is True and doc["nic_rate"] == "500mbit"
    assert doc["transport"] == "gloo" and doc["machine"]["torch"]
    rows = doc["rows"]
    assert set(doc["summary"]) == {"one_to_many", "many_to_many", "paper_scale"}
    assert {r["strategy"] for r in rows} == {"send_recv", "local_allgather", "global_allgather", "broadcast", "signal"}
    assert {r["balancer"] for r in rows if r["section"] == "many_to_many"} == {"naive", "load_balance", "dfs", "greedy"}
    assert all(r["correct"] for r in rows)
    assert all(r["seconds"] > 0 and r["limit_s"] > 0 and r["cpu_seconds"] > 0 for r in rows)
    assert all(r["minor_faults"] >= 0 for r in rows)
    assert all(sum(r["messages"].values()) >= 1 for r in rows)
    # the CPU the model priced each row at, and how the measured CPU compares, per section and variant
    assert all(r["simulated_cpu_seconds"] > 0 for r in rows)
    assert set(doc["cpu_pricing"]) == set(doc["summary"])
    assert all(m["median"] > 0 and m["rows"] >= 1 for kinds in doc["cpu_pricing"].values() for m in kinds.values())
    assert "CPU measured over the CPU the model priced" in proc.stdout
    # planned with per-message costs measured through the engine first, on this machine's shared cores
    costs, model = doc["message_costs"], doc["network_model"]
    assert costs["message_cpu_s"] > 0 and len(costs["samples"]) == 8 * costs["rounds"] and costs["rounds"] > 1
    assert all(lo <= costs[term] <= hi for term, (lo, hi) in costs["spread"].items())
    assert model["shared_cpu_cores"] == os.cpu_count() and model["message_s"] == costs["message_s"]
    assert "planning model: measured through the engine" in proc.stdout
    # the probe's guard: --quick probes once, its verdict recorded (probe_guard.guarded_probe)
    (attempt,) = costs["attempts"]
    assert costs["used_attempt"] == 0 and costs["disturbed"] == attempt["verdict"]["disturbed"]
    assert attempt["machine"]["wall_s"] > 0 and attempt["machine"]["own_cpu_s"] > 0
    assert "engine probe: attempt 1 of 1 used" in proc.stdout or "engine probe DISTURBED" in proc.stdout
    assert {t["name"] for t in doc["targets"]} >= {"paper scale: broadcast, every balancer"}
    for png in ("fig5_one_to_many.png", "fig6_many_to_many.png", "fig6_paper_scale.png", "fig8_balancers.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_meshjob_bench_finds_the_bench_folder_from_any_working_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "bench", "resharding", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--nic-rate" in proc.stdout and "--quick" in proc.stdout


def test_alpa_default_shards_the_destination_over_each_hosts_devices_too():
    from meshjob_bench.resharding_cases import host_sharded

    mesh = Layout().grid((2, 2), 2)
    assert str(host_sharded(ShardingSpec.parse("RR"), mesh, (64, 256))) == str(ShardingSpec.parse("S1R"))
    assert str(host_sharded(ShardingSpec.parse("S0R"), mesh, (64, 256))) == str(ShardingSpec.parse("S01R"))
    assert str(host_sharded(ShardingSpec.parse("RS1"), mesh, (64, 256))) == "RS1"  # already uses mesh dim 1


def test_alpa_default_is_planned_as_its_send_recv_then_the_all_gather_inside_each_host():
    from meshjob_bench.resharding_cases import ALPA_DEFAULT, bench_network, build_cases, plan_cases

    layout = Layout()
    (case,) = build_cases(
        quick=True, size_bytes=2**20, chunks=[4], nic_bytes_per_s=1.25e8, layout=layout, sections=["one_to_many"]
    )[-1:]
    plan_cases([case], layout, bench_network(1.25e8))
    labels = [v.label for v in case.variants]
    alpa, send_recv = labels.index(ALPA_DEFAULT), labels.index("send_recv")
    # each device takes a quarter over the NIC, then the rest from its host's neighbours
    assert case.planned_s[alpa] > case.boundaries[alpa].makespan_s
    assert case.planned_s[alpa] < case.planned_s[send_recv]


def _rows_of_one_case(planned_and_measured: list[tuple[str, float, float]]) -> list[Row]:
    return [
        Row(
            "many_to_many",
            "S0R -> RR",
            "broadcast",
            16,
            balancer,
            f"broadcast K=16 {balancer}",
            measured,
            [measured],
            1.0,
            measured,
            1.0,
            1.0,
            planned,
            1.0,
            True,
            measured_over_planned=measured / planned,
        )
        for balancer, planned, measured in planned_and_measured
    ]


def test_targets_hold_when_every_run_follows_its_plan():
    from meshjob_bench.resharding_targets import check_targets

    targets = {t.name: t for t in check_targets(_rows_of_one_case([("greedy", 1.0, 1.05), ("naive", 1.5, 1.6)]))}
    assert targets["many-to-many measured / planned, every balancer"].met is True
    assert targets["a plan >= 1.2x better measures better"].met is True
    assert targets["one-to-many broadcast, chunks auto"].met is None  # no one-to-many row in this run


def test_targets_name_a_run_slower_than_planned_and_a_better_plan_that_measures_worse():
    from meshjob_bench.resharding_targets import check_targets

    targets = {t.name: t for t in check_targets(_rows_of_one_case([("greedy", 1.0, 1.7), ("naive", 1.5, 1.6)]))}
    over = targets["many-to-many measured / planned, every balancer"]
    assert over.met is False and over.worst == pytest.approx(1.7) and "greedy: 1.70" in over.failures[0]
    order = targets["a plan >= 1.2x better measures better"]
    assert order.met is False and "greedy planned 1.50x better than broadcast K=16 naive" in order.failures[0]


def test_paper_scale_cases_run_between_2x4_and_4x2_meshes_with_2d_and_3d_tensors():
    from meshjob_bench.resharding_cases import build_cases
    from meshjob_bench.resharding_targets import replicated_hosts

    layout = Layout()
    cases = build_cases(
        quick=False, size_bytes=2**20, chunks=["auto"], nic_bytes_per_s=1.25e8, layout=layout, sections=["paper_scale"]
    )
    assert {(c.src_mesh.shape, c.dst_mesh.shape) for c in cases} == {((2, 4), (2, 4)), ((4, 2), (4, 2))}
    assert {len(c.shape) for c in cases} == {2, 3}
    for c in cases:  # the two meshes hold their own hosts
        assert not {layout.host_of(r) for r in c.src_mesh.ranks} & {layout.host_of(r) for r in c.dst_mesh.ranks}
    by_name = {c.name: c for c in cases}
    assert replicated_hosts(by_name["2x4 RR -> RR"]) == 2 and replicated_hosts(by_name["4x2 S0RR -> RRR"]) == 4
    assert replicated_hosts(by_name["4x2 RS1 -> S1R"]) == 4 and replicated_hosts(by_name["2x4 S0S1 -> RS1"]) == 2


def _paper_row(case: str, label: str, strategy: str, balancer: str, seconds: float) -> Row:
    return Row(
        "paper_scale",
        case,
        strategy,
        "auto" if strategy == "broadcast" else 1,
        balancer,
        label,
        seconds,
        [seconds],
        1.0,
        seconds,
        1.0,
        1.0,
        1.0,
        1.0,
        True,
    )


def test_paper_targets_take_broadcasts_speed_up_over_alpas_default_by_replicating_hosts():
    from meshjob_bench.resharding_cases import ALPA_DEFAULT, build_cases
    from meshjob_bench.resharding_targets import check_paper_targets

    cases = build_cases(
        quick=True, size_bytes=2**20, chunks=["auto"], nic_bytes_per_s=1.25e8, layout=Layout(), sections=["paper_scale"]
    )  # 2x4 RR -> RR (2 hosts) and 4x2 RR -> RR (4 hosts)
    rows = []
    for case, alpa_s in (("2x4 RR -> RR", 2.0), ("4x2 RR -> RR", 2.5)):
        rows += [
            _paper_row(case, ALPA_DEFAULT, "send_recv", "greedy", alpa_s),
            _paper_row(case, "broadcast K=auto greedy", "broadcast", "greedy", 1.0),
            _paper_row(case, "broadcast K=auto naive", "broadcast", "naive", 1.2),
        ]
    within_l, two_hosts, four_hosts = check_paper_targets(rows, cases)
    assert within_l.met is False and within_l.worst == pytest.approx(1.2) and within_l.checked == 4
    assert two_hosts.met is True and two_hosts.worst == pytest.approx(2.0)
    assert four_hosts.met is False and four_hosts.failures == ["4x2 RR -> RR: 2.50x"]


def _one_to_many_row(case: str, planned_over_l: float, measured_over_l: float) -> Row:
    return Row(
        "one_to_many",
        case,
        "broadcast",
        "auto",
        "greedy",
        "broadcast K=auto greedy",
        measured_over_l,
        [measured_over_l],
        1.0,
        measured_over_l,
        1.0,
        1.0,
        planned_over_l,
        1.0,
        True,
    )


def test_a_one_to_many_miss_whose_own_plan_is_beyond_the_limit_is_bounded():
    from meshjob_bench.resharding_targets import check_targets

    rows = [_one_to_many_row("1 -> 2x1", 1.05, 1.08), _one_to_many_row("1 -> 4x1", 1.14, 1.15)]
    one_device = {t.name: t for t in check_targets(rows)}["one-to-many broadcast, chunks auto, one device per host"]
    assert one_device.met is False and one_device.failures == ["1 -> 4x1: 1.15"]
    assert one_device.bounded == ["1 -> 4x1: 1.15 (plan 1.14)"]
    assert one_device.met_where_allowed is True  # 2x1, the one row its plan lets meet it, does


def test_a_miss_whose_plan_is_within_the_limit_is_not_bounded():
    from meshjob_bench.resharding_targets import check_targets

    rows = [_one_to_many_row("1 -> 2x1", 1.05, 1.12), _one_to_many_row("1 -> 4x1", 1.14, 1.15)]
    one_device = {t.name: t for t in check_targets(rows)}["one-to-many broadcast, chunks auto, one device per host"]
    assert one_device.bounded == ["1 -> 4x1: 1.15 (plan 1.14)"]
    assert one_device.met_where_allowed is False
    assert one_device.to_json()["met_where_allowed"] is False and one_device.to_json()["met"] is False


def test_every_row_bounded_leaves_nothing_to_meet_where_allowed():
    from meshjob_bench.resharding_targets import check_targets

    one_device = {t.name: t for t in check_targets([_one_to_many_row("1 -> 4x1", 1.14, 1.15)])}[
        "one-to-many broadcast, chunks auto, one device per host"
    ]
    assert one_device.met is False and one_device.met_where_allowed is None


def test_a_speed_up_over_alpas_default_beyond_the_tcp_floor_is_bounded():
    from meshjob_bench.resharding_cases import ALPA_DEFAULT, build_cases
    from meshjob_bench.resharding_targets import TCP_FLOOR, check_paper_targets

    cases = build_cases(
        quick=True, size_bytes=2**20, chunks=["auto"], nic_bytes_per_s=1.25e8, layout=Layout(), sections=["paper_scale"]
    )  # 2x4 RR -> RR (2 hosts) and 4x2 RR -> RR (4 hosts)
    rows = []
    for case, alpa_s in (("2x4 RR -> RR", 1.6), ("4x2 RR -> RR", 3.5)):  # L = 1 s: Alpa's default 1.6 / 3.5 L
        rows += [
            _paper_row(case, ALPA_DEFAULT, "send_recv", "greedy", alpa_s),
            _paper_row(case, "broadcast K=auto greedy", "broadcast", "greedy", 1.2),
        ]
    _, two_hosts, four_hosts = check_paper_targets(rows, cases)
    assert two_hosts.met is False and two_hosts.met_where_allowed is None  # 1.6 / 1.8 is below the TCP floor
    bound = f"at most {1.6 / TCP_FLOOR:.2f}x: Alpa's default 1.60 L, the TCP floor {TCP_FLOOR:.3f} L"
    assert two_hosts.bounded == [f"2x4 RR -> RR: 1.33x ({bound})"]
    assert four_hosts.met is False and four_hosts.bounded == [] and four_hosts.met_where_allowed is False


def test_a_case_runs_its_variants_in_a_planned_order_interleaved_one_microbatch_a_repetition():
    """Planned, so the ranks of a host take their turns on its NIC links (meshjob_trainer.board);
    repetition by repetition, so a burst of load moves one repetition of every variant."""
    from meshjob_bench.resharding_cases import Layout, bench_network, build_cases, case_order, plan_cases

    layout = Layout()
    cases = build_cases(
        quick=True, size_bytes=2**20, chunks=[4], nic_bytes_per_s=1.25e8, layout=layout, sections=["many_to_many"]
    )
    plan_cases(cases[:1], layout, bench_network(1.25e8))
    order = case_order(cases[0], 3)
    keys = [b.key for b in cases[0].boundaries]
    assert order.transfers == tuple((k, rep) for rep in range(3) for k in keys)
    assert len(set(keys)) == len(keys)  # every variant its own transfer


def test_case_text_that_names_no_case_is_refused_with_the_option_and_value():
    import argparse

    from meshjob.errors import SpecError
    from meshjob_bench.resharding import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--section", "one_to_many", "--case", "no such case"])
    with pytest.raises(SpecError, match="--case"):
        main(args)


def test_only_the_ranks_a_transfer_uses_sleep_until_its_common_start(tmp_path, monkeypatch):
    """A rank the transfer does not use goes on at once (to the next barrier), so it does not wake at the
    start instant and take the shared cores from the transfer's ranks; a rank it uses sleeps until it."""
    import time
    import types

    import torch.distributed as dist

    from meshjob_bench import resharding

    sleeps: list[float] = []
    monkeypatch.setattr(resharding, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        before = time.monotonic()
        start = resharding._common_start(lead_s=2.0, wait=False)
        assert sleeps == [] and before + 2.0 <= start <= time.monotonic() + 2.0  # the instant, named lead_s ahead
        before = time.monotonic()
        start = resharding._common_start(lead_s=2.0, wait=True)
        after = time.monotonic()
        (slept,) = sleeps
        assert 0.0 <= slept <= 2.0 and before <= start - slept <= after  # from when it asked, until the instant
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
def test_quick_run_over_the_tcp_wire_is_exact_and_judges_its_probe_by_cpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshjob.cli",
            "bench",
            "resharding",
            "--quick",
            "--transport",
            "tcp",
            "--section",
            "many_to_many",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU wire tcp" in proc.stdout
    doc = json.loads((tmp_path / "resharding.json").read_text())
    assert doc["transport"] == "tcp" and doc["rows"] and all(r["correct"] for r in doc["rows"])
    (attempt,) = doc["message_costs"]["attempts"]
    assert set(attempt["verdict"]["checks"]) == {"foreign_cpu", "spread_message_cpu_s"}
