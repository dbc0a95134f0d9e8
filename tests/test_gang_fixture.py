"""The `gang` fixture launches a gang once more only when gloo's connection mesh did not form."""

from __future__ import annotations

from conftest import failed_only_forming_the_mesh

from meshjob_trainer.launch import LaunchResult, RankResult

MESH = (
    "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:20661."
)
KILLED = "killed: another rank failed"


def test_a_gang_whose_gloo_mesh_did_not_form_is_launched_again():
    result = LaunchResult([RankResult(0, 1, error=MESH), RankResult(1, -15, error=KILLED), RankResult(2, 0)])
    assert failed_only_forming_the_mesh(result)


def test_a_gang_that_failed_in_the_test_itself_is_not_launched_again():
    failed = LaunchResult([RankResult(0, 1, error="AssertionError: tiles differ"), RankResult(1, -15, error=KILLED)])
    also_mesh = LaunchResult([RankResult(0, 1, error=MESH), RankResult(1, 1, error="AssertionError: tiles differ")])
    assert not failed_only_forming_the_mesh(failed)
    assert not failed_only_forming_the_mesh(also_mesh)
    assert not failed_only_forming_the_mesh(LaunchResult([RankResult(0, 0)], timed_out=True))
