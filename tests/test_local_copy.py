"""Messages between ranks of one host move by one memory copy (meshjob_trainer.local_copy), messages to
other hosts over gloo; real processes, real system calls."""

from __future__ import annotations

import pytest
import torch

from meshjob_trainer.local_copy import LocalCopyWire, copy_from, local_copy_available


class RecordingWire:
    """A gloo wire that records which peers it carried messages for."""

    def __init__(self) -> None:
        from meshjob_trainer.wire import GlooWire

        self.inner, self.device, self.peers = GlooWire(), torch.device("cpu"), []

    def isend(self, tensor, peer, tag, message):
        self.peers.append(peer)
        return self.inner.isend(tensor, peer, tag, message)

    def irecv(self, tensor, peer, tag, message):
        self.peers.append(peer)
        return self.inner.irecv(tensor, peer, tag, message)

    def wait(self, work):
        self.inner.wait(work)


def exchange(
    env,
    local: dict[int, set[int]],
    sends: list[tuple[int, int, int]],
    numel: dict[int, int] | None = None,
    refused: bool = False,
):
    """Each (src, dst, tag) in `sends`: src sends arange * (tag + 1) to dst. Returns (received, inner peers).
    refused: the kernel refuses every read of another process (Yama ptrace_scope 2, say)."""
    from meshjob_trainer import local_copy
    from meshjob_trainer.dist import init_distributed, shutdown_distributed

    if refused:

        def refuse(pid, address, into):
            raise PermissionError(1, f"process_vm_readv from pid {pid}: Operation not permitted")

        local_copy.copy_from = refuse

    init_distributed(env, timeout_s=20)
    try:
        inner = RecordingWire()
        wire = LocalCopyWire(inner, local.get(env.rank, set()))
        works, received = [], {}
        for src, dst, tag in sends:
            if env.rank == src:
                works.append((None, wire.isend(torch.arange(8.0) * (tag + 1), dst, tag, f"m{tag}")))
            elif env.rank == dst:
                into = torch.empty((numel or {}).get(tag, 8))
                works.append((tag, wire.irecv(into, src, tag, f"m{tag}")))
                received[tag] = into
        for _tag, work in works:
            wire.wait(work)
        torch.distributed.barrier()
        return {t: v.tolist() for t, v in received.items()}, inner.peers
    finally:
        shutdown_distributed()


def test_the_system_call_is_allowed_here():
    assert local_copy_available()


def test_copy_from_reads_another_buffer_of_this_process_exactly():
    src, into = torch.arange(100_000, dtype=torch.float32), torch.zeros(100_000)
    import os

    copy_from(os.getpid(), src.data_ptr(), into)
    assert torch.equal(src, into)


@pytest.mark.slow
def test_a_message_between_ranks_of_one_host_arrives_without_the_inner_wire(gang):
    results = gang(2, lambda env: exchange(env, {0: {1}, 1: {0}}, [(0, 1, 0), (1, 0, 1), (0, 1, 2)]))
    (got0, peers0), (got1, peers1) = results
    assert got1 == {0: list(torch.arange(8.0)), 2: list(torch.arange(8.0) * 3)}
    assert got0 == {1: list(torch.arange(8.0) * 2)}
    assert peers0 == peers1 == []


@pytest.mark.slow
def test_a_receiver_refused_the_read_gets_the_payload_from_the_sender_instead(gang):
    results = gang(2, lambda env: exchange(env, {0: {1}, 1: {0}}, [(0, 1, 0), (1, 0, 1)], refused=True))
    assert results[1][0] == {0: list(torch.arange(8.0))} and results[0][0] == {1: list(torch.arange(8.0) * 2)}


@pytest.mark.slow
def test_messages_to_another_host_go_over_the_inner_wire(gang):
    local = {0: {1}, 1: {0}}  # rank 2 is on another host
    results = gang(3, lambda env: exchange(env, local, [(0, 1, 0), (0, 2, 1), (2, 1, 2)]))
    assert results[1][0] == {0: list(torch.arange(8.0)), 2: list(torch.arange(8.0) * 3)}
    assert results[2][0] == {1: list(torch.arange(8.0) * 2)}
    assert results[0][1] == [2] and results[1][1] == [2] and results[2][1] == [0, 1]


@pytest.mark.slow
def test_a_receive_of_another_size_than_the_message_is_named():
    from meshjob_trainer.launch import launch

    result = launch(
        2, lambda ctx: exchange(ctx.env, {0: {1}, 1: {0}}, [(0, 1, 0)], numel={0: 4}), timeout_s=30, kill_grace_s=0.5
    )
    assert not result.ok
    assert "local copy from rank 0: 32 bytes sent, 16 expected" in result.ranks[1].error


def _mailbox_files(pid: int) -> list[str]:
    import os

    from meshjob_trainer.board import shm_dir
    from meshjob_trainer.local_copy import PREFIX

    return [f for f in os.listdir(shm_dir()) if f.startswith(f"{PREFIX}{pid}-")]


@pytest.mark.slow
def test_more_messages_than_the_mailbox_ring_holds_arrive_in_order_and_leave_no_file(gang):
    import os

    from meshjob_trainer.local_copy import SLOTS

    sends = [(0, 1, tag) for tag in range(2 * SLOTS + 5)]  # all issued before any is waited: the ring fills
    results = gang(2, lambda env: (exchange(env, {0: {1}, 1: {0}}, sends), _mailbox_files(os.getpid())))
    (_, files0), ((got1, peers1), files1) = results
    assert got1 == {tag: list(torch.arange(8.0) * (tag + 1)) for tag in range(2 * SLOTS + 5)}
    assert peers1 == [] and files0 == files1 == []


def _posts_out_of_order(env):
    from meshjob_trainer.dist import init_distributed

    init_distributed(env, timeout_s=20)
    wire = LocalCopyWire(RecordingWire(), {1 - env.rank})
    if env.rank == 0:
        works = [wire.isend(torch.arange(8.0), 1, tag, f"m{tag}") for tag in (0, 1, 2)]
    else:
        works = [wire.irecv(torch.empty(8), 0, tag, f"m{tag}") for tag in (0, 2, 1)]
    for work in works:
        wire.wait(work)


@pytest.mark.slow
def test_a_receiver_that_posts_in_another_order_than_its_sender_issued_is_named():
    from meshjob_trainer.launch import launch

    result = launch(2, lambda ctx: _posts_out_of_order(ctx.env), timeout_s=30, kill_grace_s=0.5)
    assert not result.ok
    assert (
        "local copy from rank 0: message 1 carries tag 1, the receiver posted tag 2; the two ranks issue their "
        "messages in different orders"
    ) in result.ranks[1].error


def _sender_leaves_early(env):
    from meshjob_trainer.dist import init_distributed

    init_distributed(env, timeout_s=20)
    wire = LocalCopyWire(RecordingWire(), {1 - env.rank})
    if env.rank == 0:
        wire.wait(wire.isend(torch.arange(8.0), 1, 0, "m0"))  # then leaves without sending the second
        return "left"
    first, second = (wire.irecv(torch.empty(8), 0, tag, f"m{tag}") for tag in (0, 1))
    wire.wait(first)
    wire.wait(second)


@pytest.mark.slow
def test_a_receiver_whose_sender_is_gone_fails_instead_of_waiting_forever():
    from meshjob_trainer.launch import launch

    result = launch(2, lambda ctx: _sender_leaves_early(ctx.env), timeout_s=30, kill_grace_s=0.5)
    assert not result.ok and result.ranks[0].exit_code == 0
    assert "local copy: receive 1 from rank 0 waits for its message, but process" in result.ranks[1].error
    assert "is gone" in result.ranks[1].error


def test_a_ranks_local_peers_are_the_ranks_of_its_host_it_exchanges_messages_with():
    from meshjob.plan.build import build_plan
    from meshjob.spec.manifest import load_job
    from meshjob_trainer.route import local_peers, routes_from_plan

    plan = build_plan(load_job("examples/gpt-demo.yaml"))
    routes = routes_from_plan(plan)
    host_of = plan.placement.host_of
    for rank in range(plan.placement.world_size):
        partners = {p for r in routes for pair in r.pairs() if rank in pair for p in pair} - {rank}
        assert local_peers(routes, rank) == {p for p in partners if host_of(p) == host_of(rank)}
    assert any(local_peers(routes, r) for r in range(plan.placement.world_size))
    assert any(
        host_of(p) != host_of(r)
        for r in range(plan.placement.world_size)
        for p in {p for route in routes for pair in route.pairs() if r in pair for p in pair}
    )
