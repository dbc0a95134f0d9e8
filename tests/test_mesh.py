"""Mesh: index arithmetic, host mapping, and rejection of malformed meshes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshjob.layout.mesh import Mesh


def test_grid_puts_one_host_per_index_of_mesh_dim_0():
    mesh = Mesh.grid((2, 4), first_rank=3, first_host=5)
    assert mesh.size == 8
    assert mesh.ranks == tuple(range(3, 11))
    assert [mesh.host_of(r) for r in mesh.ranks] == [5] * 4 + [6] * 4
    assert mesh.hosts_used() == (5, 6)


def test_index_of_is_row_major():
    mesh = Mesh.grid((2, 3, 2))
    assert mesh.index_of(0) == (0, 0, 0)
    assert mesh.index_of(1) == (0, 0, 1)
    assert mesh.index_of(2) == (0, 1, 0)
    assert mesh.index_of(11) == (1, 2, 1)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 50))
def test_rank_at_inverts_index_of(shape, first):
    mesh = Mesh.grid(tuple(shape), first_rank=first)
    for rank in mesh.ranks:
        assert mesh.rank_at(mesh.index_of(rank)) == rank


def test_hosts_used_keeps_first_seen_order():
    mesh = Mesh((2, 2), (0, 1, 2, 3), (7, 7, 2, 7))
    assert mesh.hosts_used() == (7, 2)


def test_unknown_rank_is_rejected_with_the_rank_named():
    with pytest.raises(ValueError, match="rank 9"):
        Mesh.grid((2, 2)).index_of(9)


def test_index_outside_the_mesh_is_rejected():
    with pytest.raises(ValueError, match=r"\(2, 0\)"):
        Mesh.grid((2, 2)).rank_at((2, 0))


@pytest.mark.parametrize("shape", [(), (1, 1, 1, 1), (0, 2), (2, -1)])
def test_bad_shapes_are_rejected(shape):
    with pytest.raises(ValueError, match="mesh shape"):
        Mesh(shape, (), ())


def test_rank_count_must_match_shape():
    with pytest.raises(ValueError, match="needs 4 ranks"):
        Mesh((2, 2), (0, 1, 2), (0, 0, 1))


def test_duplicate_ranks_are_rejected():
    with pytest.raises(ValueError, match="at most once"):
        Mesh((2,), (1, 1), (0, 0))
