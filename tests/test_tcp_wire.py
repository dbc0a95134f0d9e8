"""CPU messages between hosts over one TCP connection per directed pair (meshjob_trainer.tcp_wire):
real processes, real sockets, the job's real store."""

from __future__ import annotations

import pytest
import torch

from meshjob_trainer.tcp_wire import TcpWire, local_address


class LocalStore(dict):
    """A job's key-value store in one process, for a wire whose peer is the test itself."""

    host = "127.0.0.1"  # where the receiver listens (no GLOO_SOCKET_IFNAME here)

    def set(self, key, value):
        self[key] = value.encode()

    def get(self, key):
        return self[key]


def run_messages(
    env,
    sends: list[tuple[int, int, int, torch.Tensor]],
    posted: list[int] | None = None,
    pairs: set[tuple[int, int]] | None = None,
    ungranted: bool = False,
):
    """Each (src, dst, tag, tensor) in `sends`: src sends tensor to dst with tag; dst posts its receives
    in `posted` order of tags (default: the send order); `ungranted`: no pair waits for grants. Returns
    {tag: received tensor} on each rank."""
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    init_distributed(env, timeout_s=20)
    try:
        pairs = pairs or {(s, d) for s, d, _, _ in sends}
        wire = TcpWire(env.rank, pairs, ungranted=pairs if ungranted else ())
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
@pytest.mark.parametrize("ungranted", [False, True], ids=["granted", "ungranted"])
def test_messages_of_every_dtype_and_size_arrive_exactly_in_both_directions(gang, ungranted):
    got0, got1 = gang(2, lambda env: run_messages(env, PAYLOADS, ungranted=ungranted))
    assert sorted(got1) == [0, 1, 3, 4] and sorted(got0) == [2]
    for _src, d, tag, tensor in PAYLOADS:
        got = (got0 if d == 0 else got1)[tag]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


@pytest.mark.slow
def test_a_receive_posted_out_of_the_senders_order_is_an_order_error(gang):
    from meshjob_trainer.launch import launch

    sends = [(0, 1, 5, torch.ones(4)), (0, 1, 6, torch.ones(4))]
    result = launch(2, lambda ctx: run_messages(ctx.env, sends, posted=[6, 5]), timeout_s=30)
    assert not result.ok
    text = result.ranks[0].error  # the sender reads the receiver's grants in the order it posted them
    assert "OrderError" in text
    assert "rank 1 posted its next receive from this rank for tag 6; this rank's next send to it, m5, has tag 5" in text


def receive_from_a_raw_sender(monkeypatch, tag: int, name: str):
    """Rank 1's wire with a receive posted (tag, name), and a plain socket connected to it as rank 0 that has
    sent nothing beyond naming itself: (wire, work, socket)."""
    import socket as socket_module

    from meshjob_trainer import tcp_wire

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    store = LocalStore()
    wire = TcpWire(1, {(0, 1)}, store=store)
    work = wire.irecv(torch.empty(2), 0, tag, name)
    host, port = store[f"{wire.namespace}/1"].decode().rsplit(":", 1)
    sender = socket_module.create_connection((host, int(port)))
    sender.sendall(tcp_wire.HELLO.pack(0))
    return wire, work, sender


def test_a_payload_the_receiver_did_not_expect_is_an_order_error(monkeypatch):
    """Behind the grants, the header is checked too: a sender that writes a message without reading a
    grant (a bug of the wire, not of the plan) cannot put bytes into the wrong buffer."""
    import threading

    from meshjob_trainer import tcp_wire
    from meshjob_trainer.wire import OrderError

    receiver, work, sender = receive_from_a_raw_sender(monkeypatch, 7, "m7")
    sender.sendall(tcp_wire.HEADER.pack(8, 8) + bytes(8))
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(OrderError, receiver.wait, work)))
    thread.start()
    thread.join(10)
    assert errors and "the next message from rank 0 has tag 8 and 8 bytes; the receive posted for m7 has tag 7" in str(
        errors[0].value
    )
    sender.close()
    receiver.close()


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
    # the receive's grant may meet the closed connection first, or the receive its end
    assert error.startswith("rank 1: ") and "second" in error and "rank 0" in error
    assert "closed its connection" in error or "the connection broke" in error


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


def cross_host_pairs(case) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """A broadcast boundary of `case`: (its pairs between hosts, those route.one_feeder_pairs frees of grants)."""
    from test_trainer_reshard import make_boundary  # tests dir is on sys.path

    from meshjob_trainer.route import make_routes, one_feeder_pairs

    routes = make_routes(
        [make_boundary(case, "broadcast")], {0: case.src, 1: case.dst}, {0: case.src_natural, 1: case.dst_natural}
    )
    cross = {(a, b) for r in routes for a, b in r.pairs() if r.host_of(a) != r.host_of(b)}
    return cross, one_feeder_pairs(routes)


def test_a_host_fed_by_one_other_host_needs_no_grants_and_one_fed_by_two_hosts_does():
    from test_trainer_reshard import Case, mesh

    chain = Case(
        "1x1 RRR -> 2x2 RRR", (4, 4, 6), mesh((1, 1), 0), "RRR", "RRR", mesh((2, 2), 1, first_host=1), "RRR", "RRR"
    )
    cross, ungranted = cross_host_pairs(chain)  # host 1 takes from host 0, host 2 from host 1
    assert cross and ungranted == cross
    many = Case("2x2 S0R -> 2x2 RR", (8, 6), mesh((2, 2), 0), "S0R", "S0R", mesh((2, 2), 4, first_host=2), "RR", "RR")
    cross, ungranted = cross_host_pairs(many)  # rank 4's host takes both source hosts' halves, then forwards
    assert cross == {(0, 4), (2, 4), (4, 6)} and ungranted == {(4, 6)}


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


def train_over(job, cpu_wire: str):
    """Train `job` on real ranks with the given CPU wire in the plan's transfer order; each rank returns
    (its stage, its losses, its final parameters, the TCP connections its wire made or accepted)."""
    from meshjob.plan.build import build_plan
    from meshjob_trainer.dist import WorkerContext, init_distributed, shutdown_distributed
    from meshjob_trainer.launch import launch
    from meshjob_trainer.reshard import ReshardExecutor
    from meshjob_trainer.train import train

    plan = build_plan(job)

    def target(ctx):
        init_distributed(ctx.env, timeout_s=30)
        try:
            reshard = ReshardExecutor(plan, ctx.env.rank, cpu_wire=cpu_wire)
            result = train(
                WorkerContext(
                    env=ctx.env, job=job, plan=plan, stage=plan.placement.stage_of(ctx.env.rank), reshard=reshard
                )
            )
            torch.distributed.barrier()
            tcp = getattr(reshard.wire, "inner", reshard.wire)  # inside a host the memory copy wraps it
            connections = tcp.connections if isinstance(tcp, TcpWire) else 0
            reshard.close()
            return result.stage, result.losses, {k: v for k, (v, _) in result.params.items()}, connections
        finally:
            shutdown_distributed()

    return launch(plan.placement.world_size, target, timeout_s=120).raise_on_failure().values


@pytest.mark.slow
def test_a_training_run_over_the_tcp_wire_computes_what_it_computes_over_gloo():
    """A U-Transformer (skip edges across stages, tensor and data parallel meshes) under eager-1F1B:
    every message of two steps crosses the TCP wire in the plan's order, and the losses and every
    rank's final parameters are bit for bit those of the same run over gloo."""
    from test_pipeline_equivalence import make_job  # tests dir is on sys.path

    job = make_job("utransformer", "eager-1f1b", 1, steps=2)
    over_tcp, over_gloo = train_over(job, "tcp"), train_over(job, "gloo")
    assert any(losses for _, losses, _, _ in over_tcp)
    assert sum(n for *_, n in over_tcp) > 0 and sum(n for *_, n in over_gloo) == 0
    for (stage, losses, params, _), (stage_g, losses_g, params_g, _) in zip(over_tcp, over_gloo):
        assert stage == stage_g and losses == losses_g
        assert params.keys() == params_g.keys() and all(torch.equal(params[k], params_g[k]) for k in params)


def test_close_wakes_a_receive_blocked_on_a_connection_that_stays_silent(monkeypatch):
    import threading
    import time

    wire, work, sender = receive_from_a_raw_sender(monkeypatch, 0, "m0")  # connected, then silent
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(ConnectionError, wire.wait, work)))
    thread.start()
    time.sleep(0.3)  # the receive is blocked reading the header
    wire.close()
    thread.join(10)
    sender.close()
    assert not thread.is_alive() and str(errors[0].value).startswith("rank 1: ")
