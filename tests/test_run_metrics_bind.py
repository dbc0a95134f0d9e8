"""`meshjob run --metrics-port`: the address the exporter binds is the one its printed URL names."""

from __future__ import annotations

import argparse
import io
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from meshjob.errors import SpecError, UsageError
from meshjob.plan.build import Plan, build_plan
from meshjob.plan.placement import default_hosts
from meshjob.spec.manifest import TrainingJob, load_job
from meshjob_trainer.commands import run as run_command

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml"
URL = re.compile(r"metrics: http://(?P<host>[^/\s]+):(?P<port>\d+)/metrics")


@pytest.fixture(scope="module")
def tiny() -> tuple[TrainingJob, Plan]:
    job = load_job(str(TINY))
    return job, build_plan(job, default_hosts(job))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    return parser.parse_args([str(TINY), *argv])


@pytest.fixture
def served(tiny: tuple[TrainingJob, Plan]) -> Iterator[tuple[run_command.MetricsFeed, str, int]]:
    """The exporter started as `meshjob run --metrics-port 0` starts it, and the host and port it printed."""
    out = io.StringIO()
    feed = run_command.serve_metrics(parse("--metrics-port", "0"), *tiny, Console(file=out, width=200))
    try:
        m = URL.search(out.getvalue())
        assert m, out.getvalue()
        yield feed, m["host"], int(m["port"])
    finally:
        feed.close()


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return True
    return False


def test_the_printed_url_answers(served: tuple[run_command.MetricsFeed, str, int]) -> None:
    feed, host, port = served
    assert (host, port) == ("127.0.0.1", feed.port)
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    assert 'trainingjob="tiny"' in text


def test_printing_loopback_it_listens_on_loopback_only(served: tuple[run_command.MetricsFeed, str, int]) -> None:
    feed, _, port = served
    server = feed.metrics._server
    assert server is not None and server.socket.getsockname()[:2] == ("127.0.0.1", port)
    # 127.0.0.2 is loopback too but not the bound address: a wildcard (0.0.0.0) bind would accept it
    assert refused("127.0.0.2", port)
    outward = _outward_address()
    if outward is not None:
        assert refused(outward, port), f"the exporter answers on {outward}, not only on the printed 127.0.0.1"


def test_an_explicit_address_is_bound_and_printed(tiny: tuple[TrainingJob, Plan]) -> None:
    out = io.StringIO()
    feed = run_command.serve_metrics(
        parse("--metrics-port", "0", "--metrics-address", "0.0.0.0"), *tiny, Console(file=out, width=200)
    )
    try:
        assert f"metrics: http://0.0.0.0:{feed.port}/metrics (every address of this machine)" in out.getvalue()
        assert feed.metrics._server is not None and feed.metrics._server.socket.getsockname()[0] == "0.0.0.0"
        assert not refused("127.0.0.2", feed.port)
    finally:
        feed.close()


def test_ipv6_urls_put_the_address_in_brackets() -> None:
    assert run_command.metrics_url("::1", 9400) == "http://[::1]:9400/metrics"


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        (("--metrics-port", "9400", "--metrics-address", "localhost"), "an IP address of this machine"),
        (("--metrics-address", "127.0.0.1"), "only with --metrics-port"),
    ],
)
def test_a_bad_metrics_address_names_the_option(argv: tuple[str, ...], allowed: str) -> None:
    with pytest.raises(SpecError) as info:
        run_command._validate_args(parse(*argv))
    (err,) = info.value.errors
    assert err.path == "--metrics-address" and allowed in err.allowed


def test_an_address_it_cannot_bind_is_one_usage_error(tiny: tuple[TrainingJob, Plan]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"cannot serve metrics on 127.0.0.1 port {port}"):
            run_command.serve_metrics(parse("--metrics-port", str(port)), *tiny, Console(file=io.StringIO()))


def _outward_address() -> str | None:
    """A non-loopback address of this machine, if it has one (no packet is sent: UDP connect only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered, only routed
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address
