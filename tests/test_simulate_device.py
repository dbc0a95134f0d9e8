"""`meshjob simulate --device --tbf-burst --json`: the device's modelled costs on the emulated cluster's NICs,
and the per-stage timeline a benchmark's measured one can be diffed with."""

from __future__ import annotations

import json

import pytest

from meshjob.cli import main
from meshjob.costs.device_costs import emulated_costs
from meshjob.costs.devices import parse_device
from meshjob.spec.manifest import load_job


def test_simulate_json_prints_each_stages_timeline_with_the_devices_costs(capsys):
    assert (
        main(["simulate", "examples/utransformer-demo.yaml", "--device", "h100", "--tbf-burst", "128kb", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    costs = emulated_costs(load_job("examples/utransformer-demo.yaml"), parse_device("h100"))
    assert out["cost_model"]["stages"] == [c.to_json() for c in costs]
    assert out["cost_model"]["network"]["burst_bytes"] == 128 * 1024
    for stage, doc in out["stages"].items():
        first = doc["timeline"][0]
        assert first[0] == "F0" and first[2] - first[1] == pytest.approx(costs[int(stage)].forward_s)


def test_simulate_prints_the_steady_period_of_steps_run_one_after_another(capsys):
    assert main(["simulate", "examples/gpt-demo.yaml", "--device", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    compute = max(sum(t[2] - t[1] for t in doc["timeline"]) for doc in out["stages"].values())
    assert compute <= out["period_s"] <= out["step_s"] * (1 + 1e-9)  # no stage computes faster; steps overlap
    assert main(["simulate", "examples/gpt-demo.yaml", "--device", "h100"]) == 0
    assert "per step run after step (steady period)" in " ".join(capsys.readouterr().out.split())  # wrapped at 80


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "fast"], "--device: 'fast' is invalid: one of a100, h100"),
        (["--tbf-burst", "lots"], "--tbf-burst: 'lots' is invalid"),
        (["--device", "h100", "--calibrate"], "choose one source of compute costs"),
    ],
)
def test_bad_cost_options_exit_2_naming_the_flag(argv, message, capsys):
    assert main(["simulate", "examples/utransformer-demo.yaml", *argv]) == 2
    assert message in capsys.readouterr().err


def test_simulate_emulated_prices_the_messages_cpu_on_this_machines_cores(capsys):
    import os

    from meshjob.network.model import emulated_network

    assert main(["simulate", "examples/utransformer-demo.yaml", "--device", "h100", "--emulated", "--json"]) == 0
    emulated = json.loads(capsys.readouterr().out)
    assert main(["simulate", "examples/utransformer-demo.yaml", "--device", "h100", "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    assert emulated["cost_model"]["network"] == emulated_network(1e9 / 8, os.cpu_count() or 1).to_json()
    assert emulated["step_s"] > real["step_s"]  # the same job, its messages now costing CPU and 120 µs each
