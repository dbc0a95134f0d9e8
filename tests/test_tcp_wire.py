"""CPU messages between hosts over one TCP connection per directed pair (meshjob_trainer.tcp_wire):
real processes, real sockets, the job's real store."""
from __future__ import annotations

import pytest
import torch

from meshjob_trainer.tcp_wire import TcpWire, local_address


def run_messages(env, sends: list[tuple[int, int, int, torch.Tensor]], posted: list[int] | None = None,
                 pairs: set[tuple[int, int]] | None = None):
    """Each (src, dst, tag, tensor) in `sends`: src sends tensor to dst with tag; dst posts its receives
    in `posted` order of tags (default: the send order). Returns {tag: received tensor} on each rank."""
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    init_distributed(env, timeout_s=20)
    try:
        wire = TcpWire(env.rank, pairs or {(s, d) for s, d, _, _ in sends})
        order = posted or [tag for _, _, tag, _ in sends]
        by_tag = {tag: (s, d, t) for s, d, tag, t in sends}
        works, received = [], {}
        for s, d, tag, tensor in sends:
            if env.rank == s:
                works.append(wire.isend(tensor, d, tag, f"m{tag}"))
        for tag in order:
            s, d, tensor = by_tag[tag]
            if env.rank == d:
                received[tag] = torch.empty_like(tensor)
                works.append(wire.irecv(received[tag], s, tag, f"m{tag}"))
        for work in works:
            wire.wait(work)
        torch.distributed.barrier()
        wire.close()
        return received
    finally:
        shutdown_distributed()


PAYLOADS = [
    (0, 1, 0, torch.arange(1000, dtype=torch.float32)),
    (0, 1, 1, torch.arange(12, dtype=torch.float32).to(torch.bfloat16).reshape(3, 4)),
    (1, 0, 2, torch.arange(5, dtype=torch.int64)),
    (0, 1, 3, torch.empty(0)),
    (0, 1, 4, torch.full((1 << 20,), 7.0)),  # 4 MiB: more than a socket buffer takes at once
]


@pytest.mark.slow
def test_messages_of_every_dtype_and_size_arrive_exactly_in_both_directions(gang):
    got0, got1 = gang(2, lambda env: run_messages(env, PAYLOADS))
    assert sorted(got1) == [0, 1, 3, 4] and sorted(got0) == [2]
    for s, d, tag, tensor in PAYLOADS:
        got = (got0 if d == 0 else got1)[tag]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


@pytest.mark.slow
def test_a_receive_posted_out_of_the_senders_order_is_an_order_error(gang):
    from meshjob_trainer.launch import launch

    sends = [(0, 1, 5, torch.ones(4)), (0, 1, 6, torch.ones(4))]
    result = launch(2, lambda ctx: run_messages(ctx.env, sends, posted=[6, 5]), timeout_s=30)
    assert not result.ok
    text = result.ranks[1].error
    assert "OrderError" in text and "the next message from rank 0 has tag 5" in text
    assert "the receive posted for m6 has tag 6" in text


def leave_after_connecting(env):
    """Rank 0 connects with a first message and exits; rank 1 then waits for a second that never comes."""
    from meshjob_trainer.dist import init_distributed

    init_distributed(env, timeout_s=20)
    wire = TcpWire(env.rank, {(0, 1)})
    if env.rank == 0:
        wire.wait(wire.isend(torch.ones(2), 1, 0, "first"))
        torch.distributed.barrier()
        wire.close()
        return "left"
    wire.wait(wire.irecv(torch.empty(2), 0, 0, "first"))
    torch.distributed.barrier()
    try:
        wire.wait(wire.irecv(torch.empty(2), 0, 1, "second"))
    except ConnectionError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_peer_that_is_gone_is_named_by_the_receive_that_waits_for_it(gang):
    left, error = gang(2, leave_after_connecting)
    assert left == "left"
    assert error == "rank 1: rank 0 closed its connection before second arrived (0 of 16 bytes)"


def test_a_message_to_a_rank_the_plan_does_not_pair_is_a_clear_error():
    wire = TcpWire(0, {(0, 1)}, store=object())  # sends only: nothing to publish, nothing touches the store
    with pytest.raises(RuntimeError, match=r"rank 0: no TCP connection for messages to rank 2"):
        wire.isend(torch.ones(1), 2, 0, "m")
    with pytest.raises(RuntimeError, match=r"rank 0: no TCP connection for messages from rank 1"):
        wire.irecv(torch.ones(1), 1, 0, "m")


def test_a_non_contiguous_payload_is_refused():
    wire = TcpWire(0, {(0, 1)}, store=object())
    with pytest.raises(ValueError, match=r"m: the TCP wire carries contiguous CPU tensors"):
        wire.isend(torch.ones(4, 4).t(), 1, 0, "m")


def test_ranks_of_this_host_that_the_outer_wire_copies_to_get_no_connection():
    wire = TcpWire(0, {(0, 1), (1, 0), (0, 2)}, store=object(), skip={1})
    assert wire.sends_to == {2} and wire.recvs_from == frozenset()


def test_the_listening_address_is_the_interface_gloo_is_told_to_use(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert local_address(store=None) == "127.0.0.1"


def test_without_an_interface_the_address_is_the_route_to_the_store(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)

    class Store:
        host = "127.0.0.1"

    class Prefixed:
        underlying_store = Store()

    assert local_address(Prefixed()) == "127.0.0.1"
