"""The engine probe's guard: is a probe disturbed, which attempt is used, what the JSON records."""

import math

import pytest

from meshjob_bench.engine_costs import EngineCosts


def _costs(message_s: float = 120e-6, spread: tuple[float, float] | None = None, cpu: float = 270e-6) -> EngineCosts:
    lo, hi = spread or (message_s * 0.6, message_s * 1.3)
    return EngineCosts(
        message_s,
        80e-6,
        cpu,
        cpu / 2,
        1.5e-9,
        0.9e-9,
        (),
        spread={"message_s": (lo, hi), "message_cpu_s": (cpu * 0.95, cpu * 1.1)},
        rounds=5,
    )


def _machine(foreign_fraction: float = 0.02, wall_s: float = 30.0, cores: int = 2):
    from meshjob_bench.probe_guard import Machine

    own = 40.0
    return Machine(wall_s, own + foreign_fraction * wall_s * cores, own, cores, 0.4)


def test_a_quiet_probe_with_costs_like_the_quiet_runs_is_undisturbed():
    from meshjob_bench.probe_guard import judge

    for message_s in (76e-6, 118e-6, 182e-6):  # last session's quiet runs
        verdict = judge(_costs(message_s), _machine(0.05))
        assert not verdict.disturbed and verdict.reasons == () and verdict.severity <= 1


def test_foreign_cpu_above_a_quarter_of_the_cores_disturbs_the_probe():
    from meshjob_bench.probe_guard import FOREIGN_CPU_MAX, judge

    verdict = judge(_costs(), _machine(0.5))  # one other busy process on 2 cores
    assert verdict.disturbed and verdict.checks["foreign_cpu"] == pytest.approx(0.5 / FOREIGN_CPU_MAX)
    assert len(verdict.reasons) == 1 and "foreign CPU 30.0 s in 30 s = 0.50 of the 2 cores" in verdict.reasons[0]
    assert not judge(_costs(), _machine(FOREIGN_CPU_MAX * 0.9)).disturbed


def test_the_bench_counts_only_cpu_beyond_its_own_as_foreign():
    from meshjob_bench.probe_guard import CpuSnapshot, between, machine_busy_s

    text = "cpu  1000 50 300 9000 20 0 100 30 0 0\ncpu0 500 25 150 4500 10 0 50 15 0 0\n"
    assert machine_busy_s(text, 100) == pytest.approx((1000 + 50 + 300 + 100 + 30) / 100)  # idle, iowait out
    with pytest.raises(ValueError, match="/proc/stat"):
        machine_busy_s("intr 1 2 3\n", 100)
    m = between(CpuSnapshot(10.0, 500.0, 3.0), CpuSnapshot(40.0, 545.0, 33.0), cores=2, load_1m_at_start=1.5)
    assert (m.wall_s, m.foreign_cpu_s, m.foreign_fraction) == pytest.approx((30.0, 15.0, 0.25))
    assert between(CpuSnapshot(0, 0, 0), CpuSnapshot(1, 0.5, 0.9), cores=2).foreign_cpu_s == 0.0  # ticks vs rusage


def test_a_per_message_cost_far_from_the_nominal_disturbs_the_probe():
    from meshjob.network.model import EMULATED_MESSAGE_S
    from meshjob_bench.probe_guard import MESSAGE_S_FACTOR, judge

    slow = judge(_costs(1240e-6, spread=(850e-6, 1780e-6)), _machine(0.05))  # last session's disturbed probe
    assert slow.disturbed and slow.checks["message_s"] == pytest.approx(1240e-6 / EMULATED_MESSAGE_S / MESSAGE_S_FACTOR)
    assert f"per-message link time 1240 µs is {1240e-6 / EMULATED_MESSAGE_S:.2g}x the nominal" in slow.reasons[0]
    assert judge(_costs(EMULATED_MESSAGE_S / 5), _machine()).disturbed
    assert judge(_costs(0.0, spread=(0.0, 0.0)), _machine()).checks["message_s"] == math.inf


def test_through_the_tcp_wire_only_the_cpu_is_checked_not_a_link_time_of_a_few_microseconds():
    from meshjob_bench.probe_guard import judge

    quiet = judge(_costs(2e-6, spread=(0.0, 39e-6), cpu=270e-6), _machine(0.05), nominal_message_s=None)
    assert not quiet.disturbed and set(quiet.checks) == {"foreign_cpu", "spread_message_cpu_s"}
    busy = judge(_costs(2e-6, spread=(0.0, 39e-6)), _machine(0.5), nominal_message_s=None)
    assert busy.disturbed and "foreign CPU" in busy.reasons[0]


def test_the_link_time_is_judged_only_over_gloo_at_the_nominal_nic_rate():
    from meshjob.network.model import EMULATED_MESSAGE_S
    from meshjob.units import parse_rate
    from meshjob_bench.probe_guard import judge, nominal_message_s_for

    assert nominal_message_s_for("gloo", parse_rate("1gbit")) == EMULATED_MESSAGE_S
    assert nominal_message_s_for("tcp", parse_rate("1gbit")) is None
    assert nominal_message_s_for("gloo", parse_rate("250mbit")) is None
    # a quiet probe at 250mbit: every round fits 0 µs of link time, the gaps hidden behind the bytes
    quiet = judge(
        _costs(0.0, spread=(0.0, 0.0)),
        _machine(0.02),
        nominal_message_s=nominal_message_s_for("gloo", parse_rate("250mbit")),
    )
    assert not quiet.disturbed


def test_rounds_that_disagree_badly_disturb_the_probe_and_one_bad_round_does_not():
    from meshjob_bench.probe_guard import judge

    assert not judge(_costs(118e-6, spread=(59e-6, 326e-6)), _machine()).disturbed  # 5.5x: one bad round
    verdict = judge(_costs(118e-6, spread=(20e-6, 400e-6)), _machine())
    assert verdict.disturbed and verdict.reasons == (
        "rounds disagree: message_s 20-400 µs over the 5 rounds, 20x (limit 8x)",
    )
    assert judge(_costs(118e-6, spread=(0.0, 300e-6)), _machine()).disturbed  # a round fitted 0


class _FakeMachine:
    """Snapshots of a machine where other processes use `foreign` of 2 cores while the probe runs (and
    `between` of them between probes); the probe itself takes 30 s and uses 40 s of the bench's CPU."""

    def __init__(self, costs: list[EngineCosts | None], foreign: list[float], between: float = 0.0):
        self.costs, self.foreign, self.between = list(costs), list(foreign), between
        self.now, self.busy, self.own, self.probes = 0.0, 0.0, 0.0, 0

    def snapshot(self):
        from meshjob_bench.probe_guard import CpuSnapshot

        return CpuSnapshot(self.now, self.busy, self.own)

    def sleep(self, s: float) -> None:
        self.now += s
        self.busy += self.between * 2 * s

    def probe(self) -> EngineCosts | None:
        self.now += 30.0
        self.own += 40.0
        self.busy += 40.0 + self.foreign[self.probes] * 60.0
        self.probes += 1
        return self.costs.pop(0)

    def run(self, attempts: int, **kwargs):
        from meshjob_bench.probe_guard import guarded_probe

        return guarded_probe(
            self.probe, attempts, cores=2, snapshot=self.snapshot, load=lambda: 0.5, sleep=self.sleep, **kwargs
        )


def test_a_disturbed_probe_is_retried_after_a_quiet_window_and_the_undisturbed_attempt_used():
    fake = _FakeMachine([_costs(1240e-6), _costs(118e-6), _costs(130e-6)], foreign=[0.6, 0.03, 0.03])
    guarded = fake.run(attempts=3)
    assert fake.probes == 2 and guarded.used == 1 and not guarded.disturbed
    assert guarded.costs.message_s == pytest.approx(118e-6)
    first, second = guarded.attempts
    assert first.verdict.disturbed and first.machine.foreign_fraction == pytest.approx(0.6)
    assert second.waited_s == pytest.approx(1.0) and second.quiet_fraction == pytest.approx(0.0)
    line = guarded.describe()
    assert line.startswith("engine probe: attempt 2 of 2 used, undisturbed") and "1: foreign CPU" in line


def test_when_every_attempt_is_disturbed_the_least_disturbed_is_used_and_said_loudly():
    from meshjob_bench.probe_guard import QUIET_WAIT_S

    fake = _FakeMachine([_costs(1240e-6), _costs(700e-6), _costs(2000e-6)], foreign=[0.9, 0.3, 0.9], between=0.9)
    guarded = fake.run(attempts=3)
    assert fake.probes == 3 and guarded.used == 1 and guarded.disturbed
    assert [a.waited_s for a in guarded.attempts] == pytest.approx([0.0, QUIET_WAIT_S, QUIET_WAIT_S])
    assert guarded.describe().startswith(
        "WARNING: engine probe DISTURBED on all 3 attempt(s); planning with the least disturbed, attempt 2 of 3"
    )


def test_a_quick_run_probes_once_and_still_records_the_verdict():
    fake = _FakeMachine([_costs(1240e-6), _costs(118e-6)], foreign=[0.6, 0.0])
    guarded = fake.run(attempts=1)
    assert fake.probes == 1 and len(guarded.attempts) == 1 and guarded.used == 0 and guarded.disturbed


def test_a_failed_probe_is_not_retried():
    fake = _FakeMachine([None, _costs()], foreign=[0.0, 0.0])
    assert fake.run(attempts=3) is None and fake.probes == 1


def test_the_last_undisturbed_attempt_is_chosen_else_the_least_severe():
    from meshjob_bench.probe_guard import Attempt, Verdict, choose

    def attempt(disturbed: bool, severity: float) -> Attempt:
        return Attempt(_costs(), _machine(), Verdict(disturbed, severity, {}, ()))

    assert choose([attempt(True, 3.0), attempt(False, 0.5), attempt(False, 0.9)]) == 2
    assert choose([attempt(True, 3.0), attempt(True, 1.5), attempt(True, 1.5)]) == 1
    with pytest.raises(ValueError, match="attempts"):
        choose([])


def test_the_json_carries_every_attempt_which_was_used_and_the_guards_limits():
    import json

    fake = _FakeMachine([_costs(1240e-6), _costs(118e-6)], foreign=[0.6, 0.03])
    doc = json.loads(json.dumps(fake.run(attempts=3).to_json()))
    assert doc["message_s"] == pytest.approx(118e-6) and doc["used_attempt"] == 1 and doc["disturbed"] is False
    first, second = doc["attempts"]
    assert first["verdict"]["disturbed"] is True and len(first["verdict"]["reasons"]) == 2
    assert first["machine"]["foreign_fraction"] == pytest.approx(0.6) and first["machine"]["load_1m_at_start"] == 0.5
    assert first["costs"]["message_s"] == pytest.approx(1240e-6) and second["verdict"]["reasons"] == []
    assert set(first["verdict"]["checks"]) == {"foreign_cpu", "message_s", "spread_message_s", "spread_message_cpu_s"}
    assert doc["guard"]["foreign_cpu_max"] == 0.25 and doc["guard"]["nominal_message_s"] > 0
    slow_nic = _FakeMachine([_costs(0.0, spread=(0.0, 0.0))], foreign=[0.03]).run(attempts=3, nominal_message_s=None)
    assert slow_nic.used == 0 and not slow_nic.disturbed and slow_nic.to_json()["guard"]["nominal_message_s"] is None
