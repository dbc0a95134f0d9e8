"""Pipeline schedules: action IR, generators, validator (issue 2 item 5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshjob.schedule.actions import (
    Action,
    ScheduleError,
    generate,
    peak_stashed,
    validate,
    warmup_forwards,
    weight_delay_for,
)

KINDS = ("gpipe", "1f1b", "eager-1f1b")


def chain(num_stages: int) -> list[tuple[int, int, str]]:
    return [(i, i + 1, "activation") for i in range(num_stages - 1)]


def u_net(num_stages: int) -> list[tuple[int, int, str]]:
    """The chain plus U-Transformer skips: stage i feeds stage S-1-i."""
    skips = [(i, num_stages - 1 - i, f"skip{i}") for i in range(num_stages // 2 - 1)]
    return chain(num_stages) + skips


def computes(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions if not a.is_comm]


# --- the action IR ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["F3", "B0", "I12", "W7", "SEND_F3@2", "RECV_B3@1", "SEND_B0@0:skip0", "RECV_F9@4:skip1"]
)
def test_action_str_and_parse_are_inverse(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_action_str_omits_the_default_tensor() -> None:
    assert str(Action("SEND_F", 3, 2)) == "SEND_F3@2"
    assert str(Action("RECV_B", 3, 1, "skip0")) == "RECV_B3@1:skip0"


@pytest.mark.parametrize("text", ["", "X3", "F", "F-1", "SEND_F3", "F3@2", "RECV_B3@x"])
def test_action_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


# --- generators ------------------------------------------------------------------------------

SIZES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 8), (4, 4), (4, 8), (5, 3), (6, 12)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_stages,microbatches", SIZES)
def test_generated_chain_schedules_validate(kind: str, split: bool, num_stages: int, microbatches: int) -> None:
    edges = chain(num_stages)
    schedules = generate(kind, num_stages, microbatches, edges, split_backward=split)
    validate(schedules, edges, microbatches, split)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_stages,microbatches", [(4, 4), (4, 8), (6, 6), (8, 16)])
def test_generated_schedules_with_skip_edges_validate(
    kind: str, split: bool, num_stages: int, microbatches: int
) -> None:
    edges = u_net(num_stages)
    assert any(dst - src > 1 for src, dst, _ in edges)
    schedules = generate(kind, num_stages, microbatches, edges, split_backward=split)
    validate(schedules, edges, microbatches, split)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_dags_with_any_weight_delay_validate(data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(2, 6), label="S")
    microbatches = data.draw(st.integers(1, 10), label="M")
    pairs = [(i, j) for i in range(num_stages) for j in range(i + 2, num_stages)]
    skips = data.draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4), label="skips") if pairs else []
    edges = chain(num_stages) + [(i, j, f"skip{n}") for n, (i, j) in enumerate(skips)]
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    split = data.draw(st.booleans(), label="split")
    delay = {s: data.draw(st.integers(0, microbatches), label=f"delay{s}") for s in range(num_stages)}
    schedules = generate(kind, num_stages, microbatches, edges, split_backward=split, weight_delay=delay)
    validate(schedules, edges, microbatches, split)


@pytest.mark.parametrize("num_stages,microbatches", [(4, 8), (4, 3), (3, 16), (8, 8)])
def test_eager_1f1b_warmup_is_min_m_and_2_s_minus_i_minus_1(num_stages: int, microbatches: int) -> None:
    schedules = generate("eager-1f1b", num_stages, microbatches, chain(num_stages))
    for stage, actions in schedules.items():
        order = computes(actions)
        first_backward = next(i for i, a in enumerate(order) if a.startswith("B"))
        expected = min(microbatches, 2 * (num_stages - stage) - 1)
        assert first_backward == expected == warmup_forwards("eager-1f1b", stage, num_stages, microbatches)


def test_given_warmups_replace_the_kinds_and_give_eager_1f1b_from_1f1b() -> None:
    eager = generate("eager-1f1b", 4, 8, u_net(4), True, {1: 2})
    warmups = {s: warmup_forwards("eager-1f1b", s, 4, 8) for s in range(4)}
    assert generate("1f1b", 4, 8, u_net(4), True, {1: 2}, warmups) == eager
    between = generate("eager-1f1b", 4, 8, chain(4), warmups={0: 5})
    assert computes(between[0])[:6] == ["F0", "F1", "F2", "F3", "F4", "B0"]
    validate(between, chain(4), 8, False)


@pytest.mark.parametrize("warmup", [0, 9])
def test_a_warmup_outside_1_to_m_is_refused_naming_the_stage(warmup: int) -> None:
    with pytest.raises(ScheduleError, match=f"warm-up forwards of stage 2: {warmup} is invalid: 1 to 8"):
        generate("1f1b", 4, 8, chain(4), warmups={2: warmup})


def test_1f1b_warms_up_with_s_minus_i_forwards_then_alternates() -> None:
    schedules = generate("1f1b", 3, 5, chain(3))
    assert computes(schedules[0]) == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]
    assert computes(schedules[2]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4"]


def test_gpipe_runs_all_forwards_before_any_backward() -> None:
    schedules = generate("gpipe", 2, 3, chain(2))
    assert computes(schedules[1]) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_recv_comes_right_before_and_send_right_after_its_compute() -> None:
    edges = chain(3) + [(0, 2, "skip0")]
    schedules = generate("1f1b", 3, 2, edges)
    text = [str(a) for a in schedules[2]]
    f0 = text.index("F0")
    assert text[f0 - 2 : f0] == ["RECV_F0@0:skip0", "RECV_F0@1"]
    b0 = text.index("B0")
    assert text[b0 + 1 : b0 + 3] == ["SEND_B0@0:skip0", "SEND_B0@1"]


def test_eager_1f1b_peak_stashed_equals_its_warmup() -> None:
    num_stages, microbatches = 4, 12
    schedules = generate("eager-1f1b", num_stages, microbatches, chain(num_stages))
    assert peak_stashed(schedules) == {s: 2 * (num_stages - s) - 1 for s in range(num_stages)}


def test_1f1b_stashes_fewer_microbatches_than_gpipe() -> None:
    gpipe = peak_stashed(generate("gpipe", 4, 8, chain(4)))
    one_f_one_b = peak_stashed(generate("1f1b", 4, 8, chain(4)))
    assert gpipe == {s: 8 for s in range(4)}
    assert one_f_one_b == {s: 4 - s for s in range(4)}


def test_split_backward_replaces_b_with_i_then_w() -> None:
    schedules = generate("1f1b", 2, 2, chain(2), split_backward=True)
    assert [str(a) for a in schedules[1]] == [
        "RECV_F0@0",
        "F0",
        "I0",
        "SEND_B0@0",
        "W0",
        "RECV_F1@0",
        "F1",
        "I1",
        "SEND_B1@0",
        "W1",
    ]


def test_weight_delay_postpones_w_behind_later_i_and_drains_at_the_end() -> None:
    schedules = generate("1f1b", 2, 4, chain(2), split_backward=True, weight_delay={1: 2})
    assert computes(schedules[1]) == ["F0", "I0", "F1", "I1", "F2", "I2", "W0", "F3", "I3", "W1", "W2", "W3"]
    assert peak_stashed(schedules)[1] == 3  # one forward in flight plus two delayed W's


def test_weight_delay_for_covers_communication_minimally() -> None:
    assert weight_delay_for(comm_s=0.0, w_compute_s=0.1, cap=8) == 0
    assert weight_delay_for(comm_s=0.25, w_compute_s=0.1, cap=8) == 3
    assert weight_delay_for(comm_s=0.2, w_compute_s=0.1, cap=8) == 2
    assert weight_delay_for(comm_s=5.0, w_compute_s=0.1, cap=4) == 4


@pytest.mark.parametrize("edges", [[(1, 0, "activation")], [(0, 3, "activation")], [(0, 1, "a"), (0, 1, "a")]])
def test_generate_rejects_edges_that_are_not_a_forward_dag(edges: list[tuple[int, int, str]]) -> None:
    with pytest.raises(ScheduleError, match="edge"):
        generate("1f1b", 3, 2, edges)


def test_generate_rejects_an_unknown_kind() -> None:
    with pytest.raises(ScheduleError, match="interleaved"):
        generate("interleaved", 2, 2, chain(2))


# --- the validator rejects tampered lists, naming the action ---------------------------------


def tampered(kind: str = "1f1b", split: bool = False) -> tuple[dict[int, list[Action]], list[tuple[int, int, str]]]:
    edges = chain(3) + [(0, 2, "skip0")]
    return generate(kind, 3, 4, edges, split_backward=split), edges


def test_validator_rejects_a_dropped_action() -> None:
    schedules, edges = tampered()
    schedules[1].remove(Action("SEND_F", 2, 2))
    with pytest.raises(ScheduleError, match=r"stage 1: action SEND_F2@2 is missing"):
        validate(schedules, edges, 4, False)


def test_validator_rejects_a_duplicated_action() -> None:
    schedules, edges = tampered()
    schedules[2].append(Action("B", 3))
    with pytest.raises(ScheduleError, match=r"stage 2: action B3 appears twice"):
        validate(schedules, edges, 4, False)


def test_validator_rejects_a_backward_swapped_before_its_forward() -> None:
    schedules, edges = tampered()
    actions = schedules[2]
    f, b = actions.index(Action("F", 1)), actions.index(Action("B", 1))
    actions[f], actions[b] = actions[b], actions[f]
    with pytest.raises(ScheduleError, match=r"stage 2: action B1 .* comes before F1"):
        validate(schedules, edges, 4, False)


def test_validator_rejects_a_send_swapped_before_the_compute_producing_it() -> None:
    schedules, edges = tampered()
    actions = schedules[0]
    send = Action("SEND_F", 2, 2, "skip0")
    actions.remove(send)
    actions.insert(actions.index(Action("F", 2)), send)
    with pytest.raises(ScheduleError, match=r"stage 0: action SEND_F2@2:skip0 .* comes before F2"):
        validate(schedules, edges, 4, False)


def test_validator_rejects_w_before_its_i() -> None:
    schedules, edges = tampered(split=True)
    actions = schedules[1]
    i, w = actions.index(Action("I", 0)), actions.index(Action("W", 0))
    actions[i], actions[w] = actions[w], actions[i]
    with pytest.raises(ScheduleError, match=r"stage 1: action W0 .* comes before I0"):
        validate(schedules, edges, 4, True)


def test_validator_rejects_b_in_a_split_schedule() -> None:
    schedules, edges = tampered(split=False)
    with pytest.raises(ScheduleError, match=r"stage 0: unexpected action B0 .* split"):
        validate(schedules, edges, 4, True)


def test_validator_rejects_a_transfer_to_a_stage_without_that_edge() -> None:
    schedules, edges = tampered()
    schedules[1].append(Action("SEND_F", 0, 0))
    with pytest.raises(ScheduleError, match=r"stage 1: unexpected action SEND_F0@0"):
        validate(schedules, edges, 4, False)


def test_validator_detects_a_recv_placed_before_its_send_can_happen() -> None:
    schedules, edges = tampered()
    # locally fine (before B0), globally a deadlock: stage 1 needs stage 0's forwards first
    recv = Action("RECV_B", 0, 1)
    schedules[0].remove(recv)
    schedules[0].insert(0, recv)
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0: action RECV_B0@1 never completes"):
        validate(schedules, edges, 4, False)


def test_validator_detects_two_stages_waiting_on_each_other() -> None:
    edges = chain(2)
    schedules = generate("1f1b", 2, 2, edges)
    # stage 0 waits for mb 0's gradient before sending mb 0's activation: locally in order
    # (RECV_B0 before B0, SEND_F0 after F0), globally each stage waits for the other
    s0 = schedules[0]
    s0.remove(Action("RECV_B", 0, 1))
    s0.insert(s0.index(Action("SEND_F", 0, 1)), Action("RECV_B", 0, 1))
    with pytest.raises(
        ScheduleError, match=r"deadlock: stage 0: action RECV_B0@1 never completes.*stage 1 waits at RECV_F0@0"
    ):
        validate(schedules, edges, 2, False)


def test_validator_rejects_missing_stages() -> None:
    schedules, edges = tampered()
    del schedules[1]
    with pytest.raises(ScheduleError, match="stages"):
        validate(schedules, edges, 4, False)
