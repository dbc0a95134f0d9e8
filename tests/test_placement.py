"""Placement of stage meshes on hosts (issue 2 item 6)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjob.errors import PlacementError, SpecError
from meshjob.plan.placement import Host, Placement, default_hosts, load_hosts, place
from meshjob.spec.manifest import StageSpec, TopologySpec, TrainingJob


def job(*meshes: tuple[int, ...], devices_per_host: int = 2, resource: str = "cpu") -> TrainingJob:
    stages = tuple(StageSpec(layers=(i, i + 1), mesh=m, data_parallel_dim=0) for i, m in enumerate(meshes))
    topology = TopologySpec(devices_per_host=devices_per_host, device_resource=resource)
    return TrainingJob(name="demo", stages=stages, topology=topology)


def hosts_of(placement, stage: int) -> list[str]:
    return [row["host"] for row in placement.to_json() if row["stage"] == stage]


def racks_of(placement, stage: int) -> set[str]:
    return {row["rack"] for row in placement.to_json() if row["stage"] == stage}


def test_global_ranks_run_stage_by_stage_row_major() -> None:
    placement = place(job((1, 2), (2, 1)), default_hosts(job((1, 2), (2, 1))))
    assert [(s.rank, s.stage) for s in placement.slots] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert placement.world_size == 4
    assert placement.mesh(0).ranks == (0, 1)
    assert placement.mesh(1).shape == (2, 1)
    assert placement.mesh(1).ranks == (2, 3)


def test_each_mesh_row_lies_on_one_host_and_rows_of_a_stage_on_distinct_hosts() -> None:
    j = job((2, 2), (3, 1), (1, 2))
    placement = place(j, [Host(f"h{i}", 4) for i in range(3)])
    for row in placement.to_json():
        assert {placement.host_of(r) for r in row["devices"]} == {
            placement.hosts.index(next(h for h in placement.hosts if h.name == row["host"]))
        }
    for stage in range(3):
        names = hosts_of(placement, stage)
        assert len(names) == len(set(names))
    mesh = placement.mesh(0)
    assert mesh.hosts == tuple(placement.host_of(r) for r in mesh.ranks)


def test_no_host_gets_more_devices_than_it_has_and_local_devices_are_distinct() -> None:
    hosts = [Host("a", 3), Host("b", 2), Host("c", 3)]
    placement = place(job((2, 1), (2, 2), (1, 1)), hosts)
    for index, host in enumerate(hosts):
        local = [s.local_device for s in placement.slots if s.host == index]
        assert sorted(local) == list(range(len(local)))
        assert len(local) <= host.devices


def test_a_stage_stays_within_one_rack_when_a_rack_can_hold_it() -> None:
    hosts = [Host("a0", 2, "rack-a"), Host("b0", 2, "rack-b"), Host("b1", 2, "rack-b"), Host("a1", 2, "rack-a")]
    placement = place(job((2, 2), (2, 2)), hosts)
    assert racks_of(placement, 0) == {"rack-a"}
    assert racks_of(placement, 1) == {"rack-b"}


def test_adjacent_stages_prefer_the_nearest_rack() -> None:
    racks = ["r0", "r1", "r2", "r3"]
    hosts = [Host(f"{r}-h{i}", 1, r) for r in racks for i in range(2)]
    placement = place(job((2, 1), (2, 1), (2, 1), (2, 1)), hosts)
    assert [racks_of(placement, s) for s in range(4)] == [{"r0"}, {"r1"}, {"r2"}, {"r3"}]


def test_adjacent_stages_share_hosts_when_devices_allow() -> None:
    hosts = [Host(f"h{i}", 2) for i in range(4)]
    placement = place(job((2, 1), (2, 1)), hosts)
    assert hosts_of(placement, 0) == hosts_of(placement, 1) == ["h0", "h1"]


def test_best_fit_keeps_big_hosts_for_big_rows() -> None:
    # a greedy first-fit would put stage 0's row on the 4-device host and strand stage 1
    hosts = [Host("big", 4), Host("small", 1)]
    placement = place(job((1, 1), (1, 4)), hosts)
    assert hosts_of(placement, 0) == ["small"]
    assert hosts_of(placement, 1) == ["big"]


def test_backtracking_finds_a_placement_preferences_alone_would_miss() -> None:
    # stage 0 prefers rack a (first), but stage 1 needs both 2-device hosts, one of them in rack a
    hosts = [Host("a0", 2, "a"), Host("a1", 1, "a"), Host("b0", 2, "b")]
    placement = place(job((1, 1), (2, 2)), hosts)
    assert hosts_of(placement, 0) == ["a1"]
    assert sorted(hosts_of(placement, 1)) == ["a0", "b0"]


def test_placement_is_deterministic() -> None:
    hosts = [Host(f"h{i}", 1 + i % 3, f"rack{i % 2}") for i in range(8)]
    j = job((2, 2), (3, 1), (2, 1), (1, 3))
    assert place(j, hosts) == place(j, list(hosts))
    assert place(j, hosts).to_json() == place(j, hosts).to_json()


def test_too_small_cluster_says_how_many_hosts_of_what_size_are_missing() -> None:
    with pytest.raises(PlacementError, match=r"missing 1 host with 2 free cpu devices each") as err:
        place(job((2, 2), (1, 2)), [Host("h0", 2), Host("h1", 2)])
    assert "'demo'" in str(err.value)
    assert "6 cpu devices" in str(err.value)


def test_distinct_host_rule_can_require_more_hosts_than_devices_alone() -> None:
    # 4 devices suffice in number, but a 4-row stage needs 4 distinct hosts
    with pytest.raises(PlacementError, match=r"missing 2 hosts with 1 free nvidia.com/gpu device each"):
        place(job((4, 1), resource="nvidia.com/gpu"), [Host("h0", 2), Host("h1", 2)])


def test_a_row_larger_than_every_host_is_named() -> None:
    with pytest.raises(PlacementError, match=r"a mesh row needs 4 cpu devices on one host; the largest host has 2"):
        place(job((1, 4), devices_per_host=4), [Host("h0", 2), Host("h1", 2)])


def test_duplicate_host_names_are_rejected_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"hosts\[1\]\.name: 'h0'"):
        place(job((1, 1)), [Host("h0", 1), Host("h0", 1)])


def test_default_hosts_is_the_smallest_cluster_of_identical_hosts() -> None:
    assert default_hosts(job((2, 1), (2, 1))) == (Host("host-0", 2), Host("host-1", 2))
    # stage 0 fills one host; stage 1's two rows need two more distinct hosts
    assert default_hosts(job((1, 2), (2, 1))) == tuple(Host(f"host-{i}", 2) for i in range(3))
    # three 1-device rows of one stage need three hosts even though 2x2 devices would do
    assert len(default_hosts(job((3, 1), devices_per_host=2))) == 3
    assert len(default_hosts(job((2, 2), (2, 2), (1, 2), devices_per_host=2))) == 5


def test_default_hosts_rejects_rows_bigger_than_a_host() -> None:
    with pytest.raises(PlacementError, match=r"stage 0 mesh rows need 4 cpu devices .* topology.devicesPerHost is 2"):
        default_hosts(job((1, 4)))


def test_load_hosts_reads_a_list_or_a_hosts_mapping(tmp_path: Path) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- {name: n0, devices: 4, rack: r0}\n- {name: n1, devices: 2}\n")
    mapped = tmp_path / "map.yaml"
    mapped.write_text("hosts:\n  - {name: n0, devices: 4, rack: r0}\n  - {name: n1, devices: 2}\n")
    expected = (Host("n0", 4, "r0"), Host("n1", 2, ""))
    assert load_hosts(listed) == expected
    assert load_hosts(mapped) == expected


@pytest.mark.parametrize(
    "text,field",
    [
        ("- {name: n0, devices: -1}", r"hosts\[0\]\.devices: -1"),
        ("- {name: n0, devices: two}", r"hosts\[0\]\.devices: 'two'"),
        ("- {devices: 2}", r"hosts\[0\]\.name: None"),
        ("- {name: n0, devices: 2, gpus: 4}", r"hosts\[0\]\.gpus: 4"),
        ("- {name: n0, devices: 2}\n- {name: n0, devices: 2}", r"hosts\[1\]\.name: 'n0'"),
        ("hosts: []", r"hosts: \[\]"),
        ("nodes: []", r"nodes: \[\]"),
        ("- [n0, 2]", r"hosts\[0\]: \['n0', 2\]"),
        ("hosts: [", r"--hosts .*hosts.yaml:\d+:\d+: .*valid YAML"),
        ("- {name: n0, devices: 2, devices: 3}", r"hosts.yaml:1:\d+: .*given twice"),
        ("- {name: n0, devices: 5000}", r"hosts\[0\]\.devices: 5000 .*0\.\.1024"),
    ],
)
def test_load_hosts_rejects_bad_files_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=field):
        load_hosts(path)


def test_load_hosts_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"--hosts .*nope.yaml"):
        load_hosts(tmp_path / "nope.yaml")


def assert_valid(placement: Placement, meshes: list[tuple[int, ...]]) -> None:
    used = [0] * len(placement.hosts)
    for stage, mesh in enumerate(meshes):
        per_row = 1 if len(mesh) == 1 else mesh[1] * (mesh[2] if len(mesh) > 2 else 1)
        ranks = placement.mesh(stage).ranks
        rows = [ranks[r * per_row : (r + 1) * per_row] for r in range(mesh[0])]
        row_hosts = [{placement.host_of(rank) for rank in row} for row in rows]
        assert all(len(h) == 1 for h in row_hosts)  # a row on one host
        assert len({min(h) for h in row_hosts}) == len(rows)  # rows of a stage on distinct hosts
        for rank in ranks:
            used[placement.host_of(rank)] += 1
    assert all(u <= h.devices for u, h in zip(used, placement.hosts))


@settings(max_examples=80, deadline=None)
@given(
    meshes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4),
    devices=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    racks=st.integers(1, 3),
)
def test_random_clusters_either_fit_validly_or_name_hosts_that_would_make_them_fit(
    meshes: list[tuple[int, int]], devices: list[int], racks: int
) -> None:
    j = job(*meshes, devices_per_host=3)
    hosts = [Host(f"h{i}", d, f"r{i % racks}") for i, d in enumerate(devices)]
    try:
        placement = place(j, hosts)
    except PlacementError as err:
        match = re.search(r"missing (\d+) hosts? with (\d+) free cpu devices? each", str(err))
        assert match, str(err)
        extra = [Host(f"x{i}", int(match[2]), "rx") for i in range(int(match[1]))]
        assert_valid(place(j, hosts + extra), list(meshes))
        if int(match[1]) > 1 or int(match[2]) > 1:  # and no smaller addition would do
            fewer = [Host(f"x{i}", int(match[2]), "rx") for i in range(int(match[1]) - 1)]
            with pytest.raises(PlacementError):
                place(j, hosts + fewer)
    else:
        assert_valid(placement, list(meshes))
