"""The engine probe's fit: the network model's per-message costs from measured transfers."""

import dataclasses

import pytest

from meshjob.network.model import NetworkModel
from meshjob_bench.engine_costs import EngineCosts, fit
from meshjob_bench.resharding import Row

RATE = 1.25e8


def _row(link: str, mib: int, chunks: int, seconds: float, cpu_seconds: float) -> Row:
    return Row(
        "engine_probe",
        f"{link} {mib} MiB",
        "broadcast",
        chunks,
        "greedy",
        "",
        seconds,
        [seconds],
        0.1,
        1.0,
        1.0,
        1.0,
        0.1,
        0.1,
        True,
        cpu_seconds=cpu_seconds,
        messages={link: chunks},
    )


def test_the_fit_recovers_each_links_message_time_and_its_cpu_per_message_and_byte():
    truth = {"cross_host": (2e-3, 1e-9, 150e-6, 1 / RATE, 300e-6), "intra_host": (1e-3, 0.4e-9, 90e-6, 1e-9, 120e-6)}
    rows = [
        _row(link, mib, k, fixed + k * link_s + mib * 2**20 * wire, fixed + k * message_cpu + mib * 2**20 * cpu)
        for link, (fixed, cpu, link_s, wire, message_cpu) in truth.items()
        for mib in (2, 8)
        for k in (1, 128)
    ]
    costs = fit(rows)
    assert costs.message_s == pytest.approx(150e-6) and costs.intra_message_s == pytest.approx(90e-6)
    assert costs.message_cpu_s == pytest.approx(300e-6) and costs.intra_message_cpu_s == pytest.approx(120e-6)
    assert costs.net_byte_cpu_s == pytest.approx(1e-9) and costs.local_byte_cpu_s == pytest.approx(0.4e-9)
    assert len(costs.samples) == 8


def test_measured_costs_replace_the_models_defaults_on_the_machines_shared_cores():
    model = EngineCosts(150e-6, 90e-6, 300e-6, 120e-6, 1e-9, 0.5e-9, ()).apply(NetworkModel(), cores=2)
    assert (model.message_s, model.intra_message_s) == (150e-6, 90e-6)
    assert (model.shared_cpu_cores, model.message_cpu_s, model.intra_message_cpu_s, model.local_byte_cpu_s) == (
        2,
        300e-6,
        120e-6,
        0.5e-9,
    )
    assert model.to_json()["shared_cpu_cores"] == 2


def test_noise_in_the_many_message_probes_leaves_the_cpu_per_byte_to_the_single_message_ones():
    """On shared cores the K = 128 probes' CPU spreads by tens of ms (the larger one even measuring
    less): that moves the per-message term, not the per-byte ones."""
    per_byte, per_message = {"cross_host": 1.4e-9, "intra_host": 0.75e-9}, 500e-6
    noise = {2: 0.02, 8: -0.02}
    rows = [
        _row(link, mib, k, 0.1, 2e-3 + k * per_message + mib * 2**20 * cpu + (noise[mib] if k > 1 else 0.0))
        for link, cpu in per_byte.items()
        for mib in (2, 8)
        for k in (1, 128)
    ]
    costs = fit(rows)
    assert costs.net_byte_cpu_s == pytest.approx(1.4e-9) and costs.local_byte_cpu_s == pytest.approx(0.75e-9)
    assert costs.message_cpu_s == pytest.approx(per_message)  # the noise averages out over the sizes


def test_the_bench_plans_on_the_nics_tcp_payload_rate_and_the_cores_contending():
    from meshjob.network.model import EMULATED_CPU_CONTENTION_P
    from meshjob_bench.pipeline import TCP_PAYLOAD_PER_FRAME_BYTE
    from meshjob_bench.resharding_cases import bench_network

    planning = EngineCosts(150e-6, 90e-6, 300e-6, 120e-6, 1e-9, 0.5e-9, ()).apply(bench_network(RATE), cores=2)
    assert planning.nic_bytes_per_s == pytest.approx(RATE * TCP_PAYLOAD_PER_FRAME_BYTE)
    assert planning.cpu_contention_p == EMULATED_CPU_CONTENTION_P > 0


def _round_rows(r: int, link_s: float, per_message_cpu: float = 500e-6) -> list[Row]:
    """One probe round of clean transfers whose cross-host link takes `link_s` per message."""
    rows = []
    for link, per_byte in (("cross_host", 1.0e-9), ("intra_host", 0.5e-9)):
        for mib in (2, 8):
            for k in (1, 128):
                seconds = 2e-3 + mib * 2**20 / RATE + k * (link_s if link == "cross_host" else 80e-6)
                row = _row(link, mib, k, seconds, 1e-3 + k * per_message_cpu + mib * 2**20 * per_byte)
                rows.append(dataclasses.replace(row, case=f"{link} {mib} MiB round {r}"))
    return rows


def test_a_round_slowed_by_other_load_moves_the_spread_not_the_fitted_costs():
    """Each round is fitted alone and every cost is the median over the rounds: one round whose many-message
    transfers ran 5x slower (other processes on the shared cores) shows in the spread only."""
    rows = _round_rows(0, 100e-6) + _round_rows(1, 500e-6, per_message_cpu=900e-6) + _round_rows(2, 100e-6)
    costs = fit(rows)
    assert costs.rounds == 3 and len(costs.samples) == 24
    assert costs.message_s == pytest.approx(100e-6) and costs.message_cpu_s == pytest.approx(500e-6)
    assert costs.spread["message_s"] == pytest.approx((100e-6, 500e-6))
    assert costs.spread_ratio("message_s") == pytest.approx(5.0)
    doc = costs.to_json()
    assert doc["rounds"] == 3 and doc["spread"]["message_cpu_s"] == pytest.approx([500e-6, 900e-6])


def test_the_probe_interleaves_its_rounds_link_by_link():
    from meshjob_bench.engine_costs import PROBE_CHUNKS, PROBE_MIB, probe_cases
    from meshjob_bench.resharding_cases import Layout, bench_network

    cases = probe_cases(Layout(), RATE, bench_network(RATE), rounds=2)
    names = [c.name for c in cases]
    assert names[:2] == ["cross_host 2 MiB round 0", "cross_host 8 MiB round 0"]
    assert len(names) == 2 * 2 * len(PROBE_MIB) and names[len(names) // 2].endswith("round 1")
    assert all([v.chunks for v in c.variants] == list(PROBE_CHUNKS) for c in cases)


def test_the_bench_model_holds_nic_messages_above_the_executors_overlap_threshold_for_a_message_of_cpu():
    """A send above meshjob.network.model.overlap_bytes runs alone: the model charges it the CPU of one
    message on the shared cores (its successor is issued only once it has left)."""
    from meshjob.network.model import overlap_bytes
    from meshjob_bench.resharding_cases import bench_network

    planning = EngineCosts(150e-6, 90e-6, 300e-6, 120e-6, 1e-9, 0.5e-9, ()).apply(bench_network(RATE), cores=2)
    assert planning.alone_bytes == overlap_bytes(planning) > 0
    assert planning.alone_message_s == pytest.approx(150e-6)


def test_meshjob_run_plans_an_emulated_cluster_as_the_resharding_bench_does_with_its_measured_costs():
    """One model: `meshjob run` (emulated_network, the EMULATED_* costs) and the bench (EngineCosts.apply)
    price shared cores, contention and messages run alone the same way."""
    from meshjob.network.model import (
        EMULATED_INTRA_MESSAGE_CPU_S,
        EMULATED_INTRA_MESSAGE_S,
        EMULATED_LOCAL_BYTE_CPU_S,
        EMULATED_MESSAGE_CPU_S,
        EMULATED_MESSAGE_S,
        EMULATED_NET_BYTE_CPU_S,
        NetworkModel,
        emulated_network,
        overlap_bytes,
    )

    measured = EngineCosts(
        EMULATED_MESSAGE_S,
        EMULATED_INTRA_MESSAGE_S,
        EMULATED_MESSAGE_CPU_S,
        EMULATED_INTRA_MESSAGE_CPU_S,
        EMULATED_NET_BYTE_CPU_S,
        EMULATED_LOCAL_BYTE_CPU_S,
        (),
    )
    model = emulated_network(RATE, cores=2)
    assert model == measured.apply(NetworkModel(nic_bytes_per_s=RATE), cores=2)
    assert model.alone_bytes == overlap_bytes(model) > 0 and model.alone_message_s == EMULATED_MESSAGE_CPU_S / 2
