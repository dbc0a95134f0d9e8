"""BoundaryKey: one name per transfer between stages, one text form, read back by one parser."""

from __future__ import annotations

import pytest

from meshjob.schedule.actions import Action
from meshjob.schedule.boundary import BoundaryKey


def test_text_form_names_stages_tensor_and_direction():
    assert str(BoundaryKey(0, 1, "activation")) == "0->1:activation"
    assert str(BoundaryKey(3, 1, "skip2", grad=True)) == "3->1:grad:skip2"


@pytest.mark.parametrize("key", [BoundaryKey(0, 1, "activation"), BoundaryKey(12, 3, "skip10", grad=True)])
def test_parse_reads_back_the_text_form(key):
    assert BoundaryKey.parse(str(key)) == key


@pytest.mark.parametrize("text", ["0->1", "0-1:activation", "a->1:activation", "0->1:grad:", "", None])
def test_parse_rejects_other_text_naming_it_and_the_form(text):
    with pytest.raises(ValueError, match=r"is invalid: must be '<from>-><to>:<tensor>'"):
        BoundaryKey.parse(text)


@pytest.mark.parametrize(
    "stage,action,key",
    [
        (0, Action("SEND_F", 2, 1), BoundaryKey(0, 1, "activation")),
        (1, Action("RECV_F", 2, 0), BoundaryKey(0, 1, "activation")),
        (1, Action("SEND_B", 2, 0), BoundaryKey(1, 0, "activation", grad=True)),
        (0, Action("RECV_B", 2, 1), BoundaryKey(1, 0, "activation", grad=True)),
        (3, Action("RECV_F", 0, 1, "skip1"), BoundaryKey(1, 3, "skip1")),
    ],
)
def test_a_send_and_its_recv_name_the_same_boundary(stage, action, key):
    assert BoundaryKey.of_action(stage, action) == key


def test_compute_actions_move_no_boundary():
    with pytest.raises(ValueError, match="moves no tensor"):
        BoundaryKey.of_action(0, Action("F", 0))


def test_a_gradient_belongs_to_its_forward_edge():
    forward = BoundaryKey(1, 3, "skip1")
    assert forward.backward() == BoundaryKey(3, 1, "skip1", grad=True)
    assert forward.edge == forward.backward().edge == (1, 3)
