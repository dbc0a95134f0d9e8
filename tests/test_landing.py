"""A receive's landing markers: how far its bytes have come, read from its own buffer (meshjob_trainer.landing)."""

from __future__ import annotations

import time

import pytest
import torch

from meshjob_trainer.emulate.netns import EmulatedCluster, netns_available
from meshjob_trainer.landing import LandingProbe
from meshjob_trainer.launch import launch

HAVE_NETNS, WHY_NOT = netns_available()
RATE = 1e8  # bytes per second


def test_before_any_byte_lands_the_whole_message_but_the_first_markers_span_is_due():
    buffer = torch.zeros(1 << 20)  # 4 MiB
    probe = LandingProbe.place(buffer, lead_bytes=1_000_000)
    first = int(probe.index[0]) * 8
    assert probe.due_in_s(RATE) == pytest.approx(((4 << 20) - first) / RATE)
    assert first < 1_000_000  # the markers reach well below the lead


def test_bytes_landing_front_to_back_bring_the_due_down_to_the_lead():
    buffer = torch.zeros(1 << 20)
    probe = LandingProbe.place(buffer, lead_bytes=1_000_000)
    flat = buffer.view(torch.uint8)
    flat[: 2 << 20] = 1  # half is in
    assert ((2 << 20) - 500_000) / RATE <= probe.due_in_s(RATE) <= (2 << 20) / RATE  # at most half a lead sooner
    flat[: (4 << 20) - 1_000_008] = 1  # a word short of the lead point
    assert probe.due_in_s(RATE) > 1_000_000 / RATE
    flat[: (4 << 20) - 1_000_000] = 1  # the lead point is in: what is left is the lead
    assert probe.due_in_s(RATE) <= 1_000_000 / RATE
    flat[:] = 1
    assert probe.due_in_s(RATE) <= 1_000_000 / RATE


@pytest.mark.parametrize(
    "buffer, why",
    [
        (torch.zeros(10, 4)[:, :2], "not contiguous"),
        (torch.zeros(3, dtype=torch.uint8), "not whole 8-byte words"),
        (torch.zeros(8, dtype=torch.uint8)[1:].contiguous()[:0], "empty"),
        (torch.zeros(16), "no longer than the lead"),
    ],
)
def test_a_buffer_that_cannot_be_read_as_it_lands_gets_no_markers(buffer, why):
    assert LandingProbe.place(buffer, lead_bytes=1024) is None, why


def _receive_and_watch(nbytes: int) -> list[float]:
    """Rank 0 receives nbytes from rank 1 over gloo, reading its markers every 20 ms until it has landed."""
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    def target(ctx):
        init_distributed(ctx.env, timeout_s=30)
        try:
            if ctx.rank == 1:
                torch.distributed.send(torch.ones(nbytes // 4), 0)
                return []
            buffer = torch.zeros(nbytes // 4)
            probe = LandingProbe.place(buffer, lead_bytes=nbytes // 10)
            work = torch.distributed.irecv(buffer, 1)
            seen, t0 = [], time.monotonic()
            while bool((buffer[-16:] == 0).all()) and time.monotonic() - t0 < 20:
                seen.append(probe.due_in_s(RATE))
                time.sleep(0.02)
            work.wait()
            assert bool((buffer == 1).all())
            return seen
        finally:
            shutdown_distributed()

    with EmulatedCluster(2, "100mbit", prefix="mjtl_") as cluster:
        result = launch(2, target, **cluster.gang([0, 1]).launch_args())
    assert result.ok, result
    return result.values[0]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs network namespaces: {WHY_NOT}")
def test_gloo_lands_a_message_in_the_receive_buffer_front_to_back_as_its_bytes_arrive():
    """The premise of the markers: 4 MiB at 100 mbit take ~0.34 s, and meanwhile the buffer shows part of it."""
    nbytes = 4 << 20
    seen = _receive_and_watch(nbytes)
    full = (nbytes - LandingProbe.place(torch.zeros(nbytes // 4), nbytes // 10).index[0].item() * 8) / RATE
    between = [due for due in seen if 0.2 * full < due < 0.8 * full]
    assert between, seen  # part landed, part still to come
    assert all(a >= b for a, b in zip(seen, seen[1:])), seen  # it only comes closer
