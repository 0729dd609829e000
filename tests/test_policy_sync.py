"""Policy synchronization: the KL a worker measures, when each strategy pulls, and bad input."""

from __future__ import annotations

import functools
import math
import re

import gymnasium as gym
import numpy as np
import pytest
import torch

from clusterenv import (
    APS,
    Categorical,
    ClusterEnv,
    EpsilonGreedy,
    EveryUpdate,
    FixedInterval,
    Greedy,
    Never,
    PolicyError,
    PolicyRunner,
)
from clusterenv.policy.strategies import kl_divergence, mean_kl
from tests.policies import BiasPolicy, FlatOutputPolicy, LockedPolicy, linear_policy, outputs, pole_policy

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def bernoulli_kl(p: float, q: float) -> float:
    """Closed form KL(Bern(p) ‖ Bern(q))."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def cartpole():
    """Four CartPole envs on two workers, shared by the tests that only need some envs."""
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        yield envs


# -- the divergence ------------------------------------------------------------------------
def test_kl_matches_the_closed_form_in_the_learner_to_local_direction():
    learner = np.log(np.array([[0.9, 0.1]]))
    local = np.log(np.array([[0.5, 0.5]]))
    expected = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(learner, local)[0] == pytest.approx(expected, rel=1e-12)
    # The outputs are logits; Categorical turns them into the two distributions above.
    got = mean_kl(Categorical(), np.log([[0.9, 0.1]]), np.log([[0.5, 0.5]]))
    assert got == pytest.approx(expected, rel=1e-9)
    assert got != pytest.approx(bernoulli_kl(0.5, 0.9), rel=0.1), "the reverse direction differs by ~40%"


def test_kl_is_averaged_over_probe_states_not_summed():
    learner = np.log([[0.9, 0.1], [0.5, 0.5], [0.2, 0.8]])
    local = np.log([[0.5, 0.5], [0.5, 0.5], [0.6, 0.4]])
    per_state = [bernoulli_kl(0.9, 0.5), 0.0, bernoulli_kl(0.2, 0.6)]
    assert mean_kl(Categorical(), learner, local) == pytest.approx(np.mean(per_state), rel=1e-9)


def test_temperature_scales_logits_before_the_softmax():
    logits = np.array([[0.0, 2.0]])
    hot = mean_kl(Categorical(temperature=2.0), logits, np.zeros((1, 2)))
    assert hot == pytest.approx(bernoulli_kl(sigmoid(1.0), 0.5), rel=1e-9)


def test_epsilon_greedy_kl_is_the_closed_form_where_greedy_actions_differ():
    eps, n = 0.1, 4
    learner = np.array([[3.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    local = np.array([[0.0, 0.0, 5.0, 0.0], [0.0, 2.0, 0.0, 0.0]])  # first state differs, second agrees
    high, low = 1 - eps + eps / n, eps / n
    differing = high * math.log(high / low) + low * math.log(low / high)
    assert mean_kl(EpsilonGreedy(eps), learner, local) == pytest.approx(differing / 2, rel=1e-9)
    assert mean_kl(EpsilonGreedy(0.0), learner, local) == math.inf


def test_identical_outputs_have_zero_kl():
    logits = np.random.default_rng(0).normal(size=(5, 3))
    assert mean_kl(Categorical(), logits, logits) == 0.0


# -- strategies, without processes ---------------------------------------------------------
@pytest.mark.parametrize(
    "strategy, versions_behind, kl, pull",
    [
        (Never(), 5, 9.0, False),
        (EveryUpdate(), 0, None, False),
        (EveryUpdate(), 1, 0.0, True),
        (FixedInterval(3), 2, 9.0, False),
        (FixedInterval(3), 3, 0.0, True),
        (APS(threshold=0.1), 7, 0.1, False),
        (APS(threshold=0.1), 1, 0.1000001, True),
        (APS(threshold=0.1), 0, None, False),
        (APS(threshold=0.1), 1, None, True),
    ],
    ids=repr,
)
def test_strategy_decisions(strategy, versions_behind, kl, pull):
    assert strategy.should_pull(local_version=3, learner_version=3 + versions_behind, kl=kl) is pull


@pytest.mark.parametrize("threshold", [0, -0.5, math.nan, math.inf, "0.1", True])
def test_aps_threshold_must_be_a_positive_finite_number(threshold):
    with pytest.raises(
        PolicyError, match=re.escape(f"`threshold` must be a positive finite KL (nats), got {threshold!r}.")
    ):
        APS(threshold=threshold)


@pytest.mark.parametrize("make", [lambda: FixedInterval(0), lambda: Categorical(0.0), lambda: EpsilonGreedy(1.5)])
def test_other_strategy_and_head_parameters_are_checked(make):
    with pytest.raises(PolicyError, match="must be"):
        make()


# -- APS in workers ------------------------------------------------------------------------
def test_aps_pulls_exactly_when_the_measured_kl_exceeds_the_threshold(cartpole):
    threshold = 0.4
    policy = BiasPolicy(2)
    runner = PolicyRunner(cartpole, policy, APS(threshold=threshold), seed=0, probe_steps=3)
    runner.rollout(4)  # nothing to compare against yet, and nothing published: no pull
    assert runner.telemetry.total.pulls == 0 and runner.telemetry.total.kl_checks == 0

    # Learner logits [0, d]; the local copy starts at [0, 0]. None: no new version this time.
    schedule = [2.1972246, 2.6, None, 1.0, -0.5, -0.6]
    learner, local, local_version, expected_pulls = 0.0, 0.0, 0, 0
    for d in schedule:
        if d is not None:
            learner = d
            policy.set(0.0, d)
            runner.publish()
        kl = bernoulli_kl(sigmoid(learner), sigmoid(local)) if learner != local else 0.0
        assert kl == 0.0 or abs(kl - threshold) > 0.03, "keep the schedule clear of the threshold"
        batch = runner.rollout(4)
        if kl > threshold:
            local, local_version, expected_pulls = learner, runner.version, expected_pulls + 1
        for worker in runner.telemetry.workers:
            assert worker.last_kl == pytest.approx(kl, rel=1e-5, abs=1e-7)
            assert worker.pulls == expected_pulls
        assert (batch.policy_versions == local_version).all()
        np.testing.assert_allclose(batch.logits, np.broadcast_to([0.0, local], batch.logits.shape), atol=1e-6)
    # The first step measured KL(learner ‖ local) = 0.368 < 0.4; the reverse, 0.511, would have pulled.
    assert bernoulli_kl(0.5, sigmoid(schedule[0])) > threshold
    assert expected_pulls == 2


def test_after_a_pull_actions_come_from_the_new_weights(cartpole):
    old, new = pole_policy(+1.0), pole_policy(-1.0)
    actor = pole_policy(+1.0)
    runner = PolicyRunner(cartpole, actor, APS(threshold=1e-6), head=Greedy(), seed=0)
    first = runner.rollout(30)
    np.testing.assert_array_equal(first.actions, outputs(old, first.obs).argmax(-1))
    actor.load_state_dict(new.state_dict())
    runner.publish()
    second = runner.rollout(30)
    assert runner.telemetry.total.pulls == 2
    assert (second.policy_versions == 1).all()
    np.testing.assert_array_equal(second.actions, outputs(new, second.obs).argmax(-1))
    assert (outputs(old, second.obs).argmax(-1) != second.actions).any(), "the two policies must disagree somewhere"


@pytest.mark.parametrize(
    "strategy, versions, pulls",
    [
        (EveryUpdate(), [0, 1, 2, 3, 4], 4),
        (FixedInterval(2), [0, 0, 2, 2, 4], 2),
        (Never(), [0, 0, 0, 0, 0], 0),
    ],
    ids=["EveryUpdate", "FixedInterval(2)", "Never"],
)
def test_acting_versions_and_telemetry_per_strategy(cartpole, strategy, versions, pulls):
    actor = linear_policy(4, 2, seed=0)
    runner = PolicyRunner(cartpole, actor, strategy, seed=0)
    weight_bytes = sum(p.numel() * 4 for p in actor.parameters())
    steps = 3
    for update, version in enumerate(versions):
        batch = runner.rollout(steps)
        assert (batch.policy_versions == version).all(), f"update {update}"
        assert batch.learner_version == update
        with torch.no_grad():
            actor.weight.add_(0.1)
        assert runner.publish() == update + 1
    telemetry = runner.telemetry
    lags = {}
    for update, version in enumerate(versions):
        lags[update - version] = lags.get(update - version, 0) + steps * cartpole.num_envs
    assert dict(telemetry.total.lag_counts) == lags
    assert telemetry.total.mean_lag == pytest.approx(sum(k * v for k, v in lags.items()) / sum(lags.values()))
    for worker in telemetry.workers:
        assert worker.pulls == pulls
        assert worker.weight_bytes == pulls * weight_bytes
        assert worker.kl_checks == len(versions) - 1, "KL is measured for telemetry by every strategy"
        assert worker.initial_bytes > weight_bytes
    assert telemetry.total.pulls == 2 * pulls
    assert telemetry.summary()["sync/pulls"] == 2 * pulls
    assert telemetry.learner_version == len(versions)


# -- bad input -----------------------------------------------------------------------------
def test_a_policy_with_the_wrong_number_of_outputs_is_refused(cartpole):
    with pytest.raises(PolicyError, match=re.escape("Categorical head needs 2 outputs per observation")) as info:
        PolicyRunner(cartpole, linear_policy(4, 3, seed=0))
    assert "but the policy outputs 3" in str(info.value)
    with pytest.raises(PolicyError, match=re.escape("got shape (2,)")):
        PolicyRunner(cartpole, FlatOutputPolicy(4))
    with pytest.raises(PolicyError, match=re.escape("raised RuntimeError on a batch of observations of shape (2, 4)")):
        PolicyRunner(cartpole, linear_policy(5, 2, seed=0))


def test_a_policy_that_cannot_be_pickled_is_refused(cartpole):
    with pytest.raises(PolicyError, match=r"LockedPolicy cannot be pickled with cloudpickle.*_thread.lock"):
        PolicyRunner(cartpole, LockedPolicy(4, 2))


def test_other_bad_policy_arguments(cartpole):
    with pytest.raises(PolicyError, match="`policy` must be a torch.nn.Module"):
        PolicyRunner(cartpole, "not a module")
    with pytest.raises(PolicyError, match=re.escape("`sync` must be a SyncStrategy")):
        PolicyRunner(cartpole, linear_policy(4, 2, seed=0), sync=0.01)
    runner = PolicyRunner(cartpole, lambda: linear_policy(4, 2, seed=0))  # a factory works too
    with pytest.raises(PolicyError, match="publish a module with the same architecture"):
        runner.publish(linear_policy(4, 3, seed=0))
    # A refused policy leaves the envs usable in step mode.
    cartpole.reset(seed=0)
    assert cartpole.step(np.zeros(4, dtype=np.int64))[1].tolist() == [1.0] * 4


def test_envs_the_local_policies_cannot_drive_are_refused():
    with ClusterEnv([functools.partial(gym.make, "Pendulum-v1")], num_workers=1) as envs:
        # Box actions take a Gaussian head: means then log-stds, 2 outputs for Pendulum's one action.
        with pytest.raises(PolicyError, match=re.escape("Gaussian head needs 2 outputs per observation")):
            PolicyRunner(envs, torch.nn.Linear(3, 1))
    with ClusterEnv([CARTPOLE], num_workers=1, autoreset_mode="Disabled") as envs:
        with pytest.raises(PolicyError, match="not DISABLED"):
            PolicyRunner(envs, torch.nn.Linear(4, 2))
