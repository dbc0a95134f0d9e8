"""The engine probe's fit: the network model's per-message costs from measured transfers."""
import pytest

from meshjob.network import NetworkModel
from meshjob_bench.engine_costs import EngineCosts, fit
from meshjob_bench.resharding import Row

RATE = 1.25e8


def _row(link: str, mib: int, chunks: int, seconds: float, cpu_seconds: float) -> Row:
    return Row("engine_probe", f"{link} {mib} MiB", "broadcast", chunks, "greedy", "", seconds, [seconds], 0.1, 1.0,
               1.0, 1.0, 0.1, 0.1, True, cpu_seconds=cpu_seconds, messages={link: chunks})


def test_the_fit_recovers_each_links_message_time_and_the_cpu_per_message_and_byte():
    truth = {"cross_host": (2e-3, 1e-9, 150e-6, 1 / RATE), "intra_host": (1e-3, 0.4e-9, 90e-6, 1e-9)}
    per_message_cpu = 300e-6
    rows = [_row(link, mib, k, fixed + k * link_s + mib * 2**20 * wire, fixed + k * per_message_cpu + mib * 2**20 * cpu)
            for link, (fixed, cpu, link_s, wire) in truth.items() for mib in (2, 8) for k in (1, 128)]
    costs = fit(rows)
    assert costs.message_s == pytest.approx(150e-6) and costs.intra_message_s == pytest.approx(90e-6)
    assert costs.message_cpu_s == pytest.approx(per_message_cpu)
    assert costs.net_byte_cpu_s == pytest.approx(1e-9) and costs.local_byte_cpu_s == pytest.approx(0.4e-9)
    assert len(costs.samples) == 8


def test_measured_costs_replace_the_models_defaults_on_the_machines_shared_cores():
    model = EngineCosts(150e-6, 90e-6, 300e-6, 1e-9, 0.5e-9, ()).apply(NetworkModel(), cores=2)
    assert (model.message_s, model.intra_message_s) == (150e-6, 90e-6)
    assert (model.shared_cpu_cores, model.message_cpu_s, model.local_byte_cpu_s) == (2, 300e-6, 0.5e-9)
    assert model.to_json()["shared_cpu_cores"] == 2


def test_noise_in_the_many_message_probes_leaves_the_cpu_per_byte_to_the_single_message_ones():
    """On shared cores the K = 128 probes' CPU spreads by tens of ms (the larger one even measuring
    less): that moves the per-message term, not the per-byte ones."""
    per_byte, per_message = {"cross_host": 1.4e-9, "intra_host": 0.75e-9}, 500e-6
    noise = {2: 0.02, 8: -0.02}
    rows = [_row(link, mib, k, 0.1, 2e-3 + k * per_message + mib * 2**20 * cpu + (noise[mib] if k > 1 else 0.0))
            for link, cpu in per_byte.items() for mib in (2, 8) for k in (1, 128)]
    costs = fit(rows)
    assert costs.net_byte_cpu_s == pytest.approx(1.4e-9) and costs.local_byte_cpu_s == pytest.approx(0.75e-9)
    assert costs.message_cpu_s == pytest.approx(per_message)  # the noise averages out over the sizes


def test_the_bench_plans_on_the_nics_tcp_payload_rate_and_the_cores_contending():
    from meshjob.network import EMULATED_CPU_CONTENTION_P
    from meshjob_bench.pipeline import TCP_PAYLOAD_PER_FRAME_BYTE
    from meshjob_bench.resharding import bench_network

    planning = EngineCosts(150e-6, 90e-6, 300e-6, 1e-9, 0.5e-9, ()).apply(bench_network(RATE), cores=2)
    assert planning.nic_bytes_per_s == pytest.approx(RATE * TCP_PAYLOAD_PER_FRAME_BYTE)
    assert planning.cpu_contention_p == EMULATED_CPU_CONTENTION_P > 0
