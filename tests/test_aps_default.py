"""``APS()``: a bound relative to the learner's own movement, why each pull happened, and the statistic of the KL."""

from __future__ import annotations

import functools
import math
import re

import gymnasium as gym
import numpy as np
import pytest

from clusterenv import APS, ClusterEnv, EveryUpdate, PolicyError, PolicyRunner, PullReason
from clusterenv.learner.movement import LearnerMovement
from clusterenv.policy.heads import Categorical
from clusterenv.policy.strategies import DEFAULT_UPDATES, KL_FLOOR, MOVEMENT_SMOOTHING, Telemetry, WorkerTelemetry
from tests.policies import BiasPolicy, EveryOtherVersion, OwnAPS, linear_policy

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def bernoulli_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def logit_kl(learner: float, local: float) -> float:
    """KL between the softmaxes of logits [0, learner] and [0, local] (BiasPolicy's outputs)."""
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    return bernoulli_kl(sigmoid(learner), sigmoid(local)) if learner != local else 0.0


@pytest.fixture(scope="module")
def cartpole():
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        yield envs


# -- the strategy, without processes --------------------------------------------------------
def test_aps_without_arguments_is_the_relative_bound():
    assert APS() == APS(updates=DEFAULT_UPDATES)
    assert APS().needs_movement and not APS(0.05).needs_movement
    assert APS(0.05) == APS(threshold=0.05) and APS(0.05).updates is None


@pytest.mark.parametrize(
    "kl, movement, versions_behind, pull",
    [
        (0.0399, 0.01, 5, False),  # within 4 times the movement
        (0.0401, 0.01, 1, True),  # past it, however few versions behind
        (0.0, 0.0, 0, False),  # nothing has moved
        (None, None, 1, True),  # nothing measured yet: pull if behind
        (None, None, 0, False),
        (0.5, None, 0, False),  # no movement known: pull only if behind
    ],
)
def test_relative_decisions(kl, movement, versions_behind, pull):
    strategy = APS(updates=4)
    decided = strategy.should_pull(local_version=2, learner_version=2 + versions_behind, kl=kl, movement=movement)
    assert decided is pull


@pytest.mark.parametrize("strategy", [APS(), APS(0.05)], ids=repr)
def test_a_copy_at_the_learners_version_never_pulls_it_again(strategy):
    assert not strategy.should_pull(local_version=3, learner_version=3, kl=1.0, movement=1e-9)


def test_the_reason_is_behind_while_the_bound_is_not_known():
    assert APS().reason(0.3, movement=None) is PullReason.BEHIND
    assert APS().reason(0.3, movement=0.01) is PullReason.DIVERGENCE
    assert APS(0.05).reason(0.3) is PullReason.DIVERGENCE


def test_an_infinite_step_leaves_the_learners_movement_as_it_was():
    class Previous:  # the version before: logits that make the second action impossible
        def outputs(self, obs):
            return np.array([[0.0, -np.inf]] * len(obs))

    telemetry = Telemetry([WorkerTelemetry(0)])
    movement = LearnerMovement(Previous(), telemetry)  # type: ignore[arg-type]
    finite = np.array([[0.0, 0.1]] * 3)
    movement.measure(Categorical(), np.zeros((3, 1)), finite, [slice(0, 3)], version=1)
    assert movement.of(0) == telemetry.workers[0].movement is None, "KL(latest ‖ previous) is infinite here"


def test_a_learner_that_stopped_moving_leaves_arithmetic_noise_alone():
    """Below KL_FLOOR the copy differs by float arithmetic, not drift: no pull for it."""
    assert APS().bound(0.0) == KL_FLOOR
    assert not APS().should_pull(local_version=0, learner_version=1, kl=KL_FLOOR / 10, movement=0.0)
    assert APS().should_pull(local_version=0, learner_version=1, kl=KL_FLOOR * 10, movement=0.0)


@pytest.mark.parametrize(
    "kwargs", [{"statistic": ["mean"]}, {"updates": "16"}, {"threshold": np.nan}], ids=lambda k: repr(k)
)
def test_bad_settings_are_refused_with_what_was_expected(kwargs):
    with pytest.raises(PolicyError, match="must be"):
        APS(**kwargs)


def test_numpy_numbers_are_settings_too():
    assert APS(np.float32(0.05)).bound(None) == pytest.approx(0.05)
    assert APS(updates=np.int64(8)).bound(0.01) == pytest.approx(0.08)


def test_the_bound_is_stated_in_nats_for_both_forms():
    assert APS().bound(0.01) == pytest.approx(DEFAULT_UPDATES * 0.01)
    assert APS().bound(None) is None
    assert APS(0.05).bound(123.0) == 0.05


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: APS(0.05, updates=4), "APS takes an absolute `threshold` or a relative `updates`, not both"),
        (lambda: APS(updates=0), "`updates` must be a positive finite multiple of the learner's per-version movement"),
        (lambda: APS(updates=math.inf), "`updates` must be a positive finite multiple"),
        (lambda: APS(0.05, statistic="median"), "`statistic` must be one of ['max', 'mean', 'p95'], got 'median'"),
        (lambda: APS(statistic="p95"), "statistic='p95' needs an absolute `threshold`"),
    ],
)
def test_bad_aps_arguments_say_what_was_expected(make, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        make()


def test_the_statistic_reduces_the_probe_states_kls():
    kls = np.array([0.0] * 18 + [0.5, 1.0])
    assert APS(0.1).divergence(kls) == pytest.approx(0.075)
    assert APS(0.1, statistic="p95").divergence(kls) == pytest.approx(np.quantile(kls, 0.95))
    assert APS(0.1, statistic="max").divergence(kls) == 1.0
    assert EveryUpdate().divergence(kls) == pytest.approx(0.075)


def test_pull_reasons():
    assert APS().reason(None) is PullReason.BEHIND
    assert APS().reason(0.3, movement=0.01) is PullReason.DIVERGENCE
    assert EveryUpdate().reason(0.3) is PullReason.SCHEDULE


# -- in workers ------------------------------------------------------------------------------
def test_a_relative_bound_pulls_when_the_copy_is_past_its_multiple_of_the_learners_movement(cartpole):
    """BiasPolicy's KLs have a closed form: the learner's movement and each pull are predicted exactly."""
    policy = BiasPolicy(2)
    updates = 4
    runner = PolicyRunner(cartpole, policy, APS(updates=updates), seed=0, probe_steps=3)
    runner.rollout(4)  # nothing published, nothing to compare with: no pull
    # Small steps, then a jump far past four of them, then small steps again.
    schedule = [0.1, 0.15, 0.25, 0.3, 1.5, 1.6, 1.62, 1.7, 1.75, 1.85]
    learner, local, movement, pulls, reasons = 0.0, 0.0, None, 0, []
    for d in schedule:
        step = logit_kl(d, learner)
        learner = d
        policy.set(0.0, d)
        runner.publish()
        movement = step if movement is None else MOVEMENT_SMOOTHING * movement + (1 - MOVEMENT_SMOOTHING) * step
        kl = logit_kl(learner, local)
        assert abs(kl / (updates * movement) - 1) > 0.05, "keep the schedule clear of the bound"
        batch = runner.rollout(4)
        if kl > updates * movement:
            local, pulls = learner, pulls + 1
            reasons.append(d)
        for worker in runner.telemetry.workers:
            assert worker.movement == pytest.approx(movement, rel=1e-4)
            assert worker.last_kl == pytest.approx(kl, rel=1e-4, abs=1e-8)
            assert worker.pulls == pulls
            assert dict(worker.pull_reasons) == ({"divergence": pulls} if pulls else {})
        np.testing.assert_allclose(batch.logits, np.broadcast_to([0.0, local], batch.logits.shape), atol=1e-6)
    assert reasons == [0.25, 1.5], "the jump pulls at once; after it, small steps are tolerated for long"
    summary = runner.telemetry.summary()
    assert summary["sync/pulls_divergence"] == 2 * pulls and summary["sync/pulls_behind"] == 0
    assert summary["sync/movement"] == pytest.approx(movement, rel=1e-4)


def test_a_copy_behind_before_any_measurement_pulls_as_behind(cartpole):
    runner = PolicyRunner(cartpole, linear_policy(4, 2, seed=0), APS(), seed=0)
    runner.publish()
    runner.rollout(3)  # no probe states yet: the copy is behind, so it pulls
    assert runner.telemetry.summary()["sync/pulls_behind"] == 2
    assert runner.telemetry.total.movement is None, "no KL check has measured the learner yet"


def test_schedule_pulls_are_counted_as_such(cartpole):
    runner = PolicyRunner(cartpole, linear_policy(4, 2, seed=0), EveryUpdate(), seed=0)
    for _ in range(3):
        runner.rollout(2)
        runner.publish()
    runner.rollout(2)
    assert dict(runner.telemetry.total.pull_reasons) == {"schedule": 6}
    assert runner.telemetry.total.movement is None, "only a strategy that needs it measures the learner's movement"


def versions_acted(runner, rollouts):
    """The version the first env acted with in each rollout, the learner publishing after each."""
    versions = []
    for _ in range(rollouts):
        versions.append(int(runner.rollout(2).policy_versions[0, 0]))
        runner.publish()
    return versions


def test_a_strategy_written_without_the_movement_keyword_still_decides(cartpole):
    runner = PolicyRunner(cartpole, linear_policy(4, 2, seed=0), EveryOtherVersion(), seed=0)
    assert versions_acted(runner, 4) == [0, 0, 2, 2]


def test_an_aps_subclass_without_the_movement_keyword_still_runs(cartpole):
    runner = PolicyRunner(cartpole, linear_policy(4, 2, seed=0), OwnAPS(), seed=0)
    assert versions_acted(runner, 3) == [0, 1, 2], "without the learner's movement the bound pulls whenever behind"
    assert dict(runner.telemetry.total.pull_reasons) == {"behind": 4}, "its bound was never known"
    assert runner.telemetry.total.movement is None, "the learner does not measure what the strategy cannot take"


def test_prefetching_workers_get_the_learners_movement_with_its_outputs(cartpole):
    policy = BiasPolicy(2)
    runner = PolicyRunner(cartpole, policy, APS(updates=4), seed=0, probe_steps=3, prefetch=1)
    try:
        for d in [0.05, 0.1, 0.15, 0.2, 3.0, 3.05, 3.1]:
            runner.rollout(4)
            policy.set(0.0, d)
            runner.publish()
        for _ in range(3):
            runner.rollout(4)
    finally:
        runner.stop()
    total = runner.telemetry.total
    assert total.movement is not None and total.movement > 0
    assert total.pull_reasons["divergence"] >= 2, "the jump to 3.0 is far past four times the movement"
    assert total.pull_reasons["behind"] == 0, "every probe after a publish carries that version's movement"
    assert sum(total.pull_reasons.values()) == total.pulls
