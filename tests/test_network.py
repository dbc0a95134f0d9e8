"""The one network model: per-message cost and the chunk count it implies."""
import pytest

from meshjob.network import MAX_AUTO_CHUNKS, auto_chunks

RATE = 1.25e8  # 1 gbit


def chain_seconds(nbytes: int, hops: int, k: int, message_s: float) -> float:
    return (k + hops - 1) * (nbytes / RATE / k + message_s)


@pytest.mark.parametrize("nbytes", [4096, 2**20, 16 * 2**20, 64 * 2**20])
@pytest.mark.parametrize("hops", [2, 3, 4, 8])
def test_auto_chunks_minimises_the_chain_time_over_every_allowed_k(nbytes, hops):
    k = auto_chunks(nbytes, hops, RATE, 50e-6)
    best = min(chain_seconds(nbytes, hops, j, 50e-6) for j in range(1, MAX_AUTO_CHUNKS + 1))
    assert chain_seconds(nbytes, hops, k, 50e-6) == pytest.approx(best)


def test_one_receiving_host_gains_nothing_from_chunks():
    assert auto_chunks(64 * 2**20, 1, RATE, 50e-6) == 1


def test_auto_chunks_grow_with_bytes_and_hosts_and_shrink_with_the_message_cost():
    assert auto_chunks(2**20, 4, RATE) < auto_chunks(16 * 2**20, 4, RATE)
    assert auto_chunks(16 * 2**20, 2, RATE) < auto_chunks(16 * 2**20, 4, RATE)
    assert auto_chunks(16 * 2**20, 4, RATE, 1e-3) < auto_chunks(16 * 2**20, 4, RATE, 1e-5)
    assert auto_chunks(16 * 2**20, 4, RATE, 0.0) == MAX_AUTO_CHUNKS
