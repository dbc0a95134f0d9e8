"""Sharding specs: notation, validation errors, tiles and the nesting relation."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshjob.errors import SpecError
from meshjob.layout.sharding import (
    ShardingSpec,
    at_least_as_sharded,
    check_spec,
    contains,
    intersect,
    slice_numel,
    slice_shape,
    tile,
)


@pytest.mark.parametrize(
    "text, dims",
    [
        ("S01R", ((0, 1), ())),
        ("S0R", ((0,), ())),
        ("RS1", ((), (1,))),
        ("S0RR", ((0,), (), ())),
        ("S01,R", ((0, 1), ())),
        ("S1, R, S0", ((1,), (), (0,))),
        ("S10R", ((1, 0), ())),
        ("S0S1", ((0,), (1,))),
    ],
)
def test_parse_accepts_compact_and_separated_forms(text, dims):
    assert ShardingSpec.parse(text).dims == dims


@pytest.mark.parametrize("text, canonical", [("S01,R", "S01R"), ("R,S1", "RS1"), ("S0RR", "S0RR"), ("R, R, R", "RRR")])
def test_str_prints_the_canonical_compact_form(text, canonical):
    assert str(ShardingSpec.parse(text)) == canonical


@given(
    st.lists(
        st.one_of(st.just(()), st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True).map(tuple)),
        min_size=1,
        max_size=4,
    )
)
def test_printing_then_parsing_round_trips(dims):
    spec = ShardingSpec(tuple(dims))
    assert ShardingSpec.parse(str(spec)) == spec
    assert ShardingSpec.parse(",".join("R" if not d else "S" + "".join(map(str, d)) for d in dims)) == spec


@pytest.mark.parametrize("text", ["", "X0R", "S", "SR", "s01r", "S0,,R", "S0R,S1", "R1"])
def test_unknown_tokens_raise_a_spec_error_naming_the_path_and_value(text):
    with pytest.raises(SpecError) as err:
        ShardingSpec.parse(text, path="spec.edges[0].send")
    assert err.value.errors[0].path == "spec.edges[0].send"
    assert err.value.errors[0].value == text
    assert "R (replicated)" in str(err.value) or "one token" in str(err.value)


def test_parse_with_ndim_rejects_the_wrong_number_of_tokens():
    with pytest.raises(SpecError, match="3 tokens"):
        ShardingSpec.parse("S0R", ndim=3)


def test_check_spec_accepts_a_valid_spec():
    assert check_spec(ShardingSpec.parse("S01R"), (2, 4), (16, 4)) == []


def test_check_spec_reports_wrong_number_of_dims():
    [error] = check_spec(ShardingSpec.parse("S0R"), (2, 4), (8, 4, 4), path="p")
    assert error.path == "p" and error.value == "S0R" and "3 tokens" in error.allowed


def test_check_spec_reports_a_mesh_dim_used_twice():
    [error] = check_spec(ShardingSpec.parse("S0S0"), (2, 4), (8, 8))
    assert "mesh dim 0 is used 2 times" in error.allowed


def test_check_spec_reports_a_mesh_dim_beyond_the_mesh():
    [error] = check_spec(ShardingSpec.parse("S2R"), (2, 4), (8, 8))
    assert "mesh dim 2 does not exist" in error.allowed


def test_check_spec_reports_indivisible_tensor_dims():
    [error] = check_spec(ShardingSpec.parse("RS01"), (2, 4), (8, 12))
    assert "tensor dim 1 (length 12)" in error.allowed and "8 shards" in error.allowed


def test_check_spec_reports_every_problem_at_once():
    errors = check_spec(ShardingSpec.parse("S00S3"), (2, 4), (8, 8, 8))
    assert len(errors) == 3


def test_tile_of_s01r_follows_the_paper_figure():
    # Fig. 2 of "On Optimizing the Communication of Model Parallelism" (Zhuang et al., 2022):
    # a 4x4 matrix on a 2x2 mesh, S01R: device (i, j) holds row 2i + j.
    spec = ShardingSpec.parse("S01R")
    assert [tile(spec, (2, 2), (4, 4), ix) for ix in itertools.product(range(2), range(2))] == [
        ((0, 1), (0, 4)),
        ((1, 2), (0, 4)),
        ((2, 3), (0, 4)),
        ((3, 4), (0, 4)),
    ]


def test_tile_major_mesh_dim_is_listed_first():
    spec = ShardingSpec.parse("S10R")
    assert tile(spec, (2, 2), (4, 4), (0, 1)) == ((2, 3), (0, 4))
    assert tile(spec, (2, 2), (4, 4), (1, 0)) == ((1, 2), (0, 4))


def test_replicated_tile_is_the_whole_tensor():
    assert tile(ShardingSpec.parse("RR"), (3,), (5, 7), (2,)) == ((0, 5), (0, 7))


def test_tiles_of_a_sharded_spec_partition_the_tensor():
    spec, mesh_shape, shape = ShardingSpec.parse("S1S0R"), (2, 3, 2), (6, 4, 2)
    tiles = {tile(spec, mesh_shape, shape, ix) for ix in itertools.product(*(range(n) for n in mesh_shape))}
    assert len(tiles) == 6  # mesh dim 2 replicates
    assert sum(slice_numel(t) for t in tiles) == math.prod(shape)


def test_slice_helpers():
    a, b = ((0, 4), (2, 6)), ((2, 8), (0, 3))
    assert slice_shape(a) == (4, 4) and slice_numel(a) == 16
    assert intersect(a, b) == ((2, 4), (2, 3))
    assert intersect(a, ((4, 5), (0, 9))) is None
    assert contains(((0, 8), (0, 8)), a) and not contains(a, b)


def test_more_sharded_spec_nests_in_a_less_sharded_one():
    assert at_least_as_sharded(ShardingSpec.parse("S01R"), ShardingSpec.parse("S0R"), (2, 4), (8, 4))
    assert at_least_as_sharded(ShardingSpec.parse("S0S1"), ShardingSpec.parse("S0R"), (2, 4), (8, 4))


def test_spec_sharded_over_another_mesh_dim_does_not_nest():
    assert not at_least_as_sharded(ShardingSpec.parse("S1R"), ShardingSpec.parse("S0R"), (2, 4), (8, 4))
    assert not at_least_as_sharded(ShardingSpec.parse("S10R"), ShardingSpec.parse("S0R"), (2, 4), (8, 4))
    assert not at_least_as_sharded(ShardingSpec.parse("RR"), ShardingSpec.parse("S0R"), (2, 4), (8, 4))
