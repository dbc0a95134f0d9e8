"""spec.metrics.port as a range: local rank r serves on port + r, so the whole range must be a valid, free port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshjob.errors import FieldError, SpecError
from meshjob.spec.api import MASTER_PORT
from meshjob.spec.manifest import parse_job

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"  # devicesPerHost: 2


def tiny(port: int, devices_per_host: int = 2) -> dict[str, Any]:
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["metrics"]["port"] = port
    doc["spec"]["topology"]["devicesPerHost"] = devices_per_host
    return doc


def port_errors(doc: dict[str, Any]) -> list[FieldError]:
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    return [e for e in info.value.errors if e.path == "spec.metrics.port"]


@pytest.mark.parametrize("port", [1, 9400, 65534, MASTER_PORT + 1, MASTER_PORT - 2])
def test_ranges_inside_1_to_65535_and_off_the_rendezvous_port_are_accepted(port: int) -> None:
    assert parse_job(tiny(port)).metrics.port == port


def test_one_device_per_host_may_take_the_last_port() -> None:
    doc = tiny(65535, devices_per_host=1)
    doc["spec"]["stages"] = [{"layers": [0, 2], "mesh": [1, 1]}]
    assert parse_job(doc).metrics.port == 65535


def test_last_rank_past_65535_names_the_field_value_and_the_allowed_ports() -> None:
    (err,) = port_errors(tiny(65535))
    assert err.value == 65535
    text = str(err)
    assert text.startswith("spec.metrics.port: 65535 is invalid: a port in 1..65534")
    assert "spec.topology.devicesPerHost is 2" in text


@pytest.mark.parametrize("port", [MASTER_PORT, MASTER_PORT - 1])
def test_range_containing_the_rendezvous_port_is_refused(port: int) -> None:
    (err,) = port_errors(tiny(port))
    text = str(err)
    assert text.startswith(f"spec.metrics.port: {port} is invalid:")
    assert f"leaves out {MASTER_PORT}, the trainer pod's rendezvous port (MASTER_PORT)" in text
    assert f"at most {MASTER_PORT - 2} or at least {MASTER_PORT + 1}" in text


def test_meshjob_plan_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny(65535)))
    result = subprocess.run(
        [sys.executable, "-m", "meshjob.cli", "plan", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == ""
    assert "spec.metrics.port: 65535 is invalid: a port in 1..65534" in result.stderr
