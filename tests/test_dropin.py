"""ClusterEnv is a drop-in for SyncVectorEnv at the contract's edges, where real clients probe it."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.envs.classic_control import CartPoleEnv
from gymnasium.error import ResetNeeded
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import clusterenv
from clusterenv import ClusterEnv, RemoteEnvError, WorkerTimeoutError
from tests.conftest import assert_same
from tests.envs import (
    SELF_REGISTERED_ID,
    CountingEnv,
    FailingEnv,
    ObservationSpaceEnv,
    RichSpacesEnv,
    SlowEnv,
    TextActionEnv,
    UnsortedDictActionEnv,
    make_after_registering,
    register_self_registered,
)

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
LAYOUTS = {"2 workers": {"num_workers": 2}, "1 worker, 2 env processes": {"num_workers": 1, "procs_per_worker": 2}}


@pytest.fixture(params=LAYOUTS.values(), ids=LAYOUTS)
def layout(request):
    return request.param


# -- attribute errors are the caller's business ----------------------------------------------
def test_a_missing_attribute_raises_attribute_error_and_the_env_stays_usable(layout):
    reference = SyncVectorEnv([CARTPOLE] * 4)
    with ClusterEnv([CARTPOLE] * 4, **layout) as envs:
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        with pytest.raises(AttributeError) as sync_error:
            reference.get_attr("no_such_attribute")
        with pytest.raises(AttributeError, match=re.escape(str(sync_error.value))) as raised:
            envs.get_attr("no_such_attribute")
        assert isinstance(raised.value, RemoteEnvError) and "Remote traceback" in str(raised.value)
        assert isinstance(raised.value.__cause__, AttributeError)
        assert not envs.closed
        actions = np.array([0, 1, 1, 0])
        assert_same(reference.step(actions), envs.step(actions))
    reference.close()


def test_a_method_called_through_call_raises_its_own_type_and_the_env_stays_usable(layout):
    with ClusterEnv([CARTPOLE] * 4, **layout) as envs:
        envs.reset(seed=0)
        with pytest.raises(TypeError):
            envs.call("step")  # a missing argument
        with pytest.raises(AttributeError):
            envs.call("no_such_method", 1)
        envs.step(np.zeros(4, dtype=np.int64))


def test_an_error_inside_step_still_closes_the_env():
    with ClusterEnv([functools.partial(FailingEnv, 1)] * 2, num_workers=2) as envs:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match="deliberate failure"):
            envs.step(np.zeros(2, dtype=np.int64))
        assert envs.closed


# -- exceptions raised by envs keep their type ------------------------------------------------
def test_an_env_exception_is_catchable_as_its_own_type_with_its_index_and_traceback(layout):
    fns = [functools.partial(FailingEnv, fail_at) for fail_at in (2, 9, 9, 9)]
    with ClusterEnv(fns, **layout) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(ValueError, match="deliberate failure at step 2") as raised:
            envs.step(np.zeros(4, dtype=np.int64))
    error = raised.value
    assert isinstance(error, RemoteEnvError) and type(error).__name__ == "RemoteEnvError[ValueError]"
    assert error.env_index == 0 and error.exc_type == "ValueError" and "in step" in error.remote_traceback


@pytest.mark.parametrize("num_workers", [1, 2], ids=["within one worker", "across workers"])
def test_mismatched_observation_spaces_raise_sync_vector_envs_runtime_error(num_workers):
    fns = [functools.partial(ObservationSpaceEnv, spaces.Box(0, high, (2,))) for high in (1, 1, 2, 2)]
    message = "SyncVectorEnv(..., observation_mode='same') however the sub-environments observation spaces are not"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        SyncVectorEnv(fns)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ClusterEnv(fns, num_workers=num_workers)


def test_mismatched_observation_spaces_across_env_processes_raise_the_same_error():
    fns = [functools.partial(ObservationSpaceEnv, spaces.Box(0, high, (2,))) for high in (1, 1, 2, 2)]
    with pytest.raises(RuntimeError, match="observation spaces are not equivalent") as raised:
        ClusterEnv(fns, num_workers=1, procs_per_worker=2)
    assert "could not map" not in str(raised.value)


def test_a_timeout_is_a_multiprocessing_timeout_error_as_async_vector_env_raises():
    envs = ClusterEnv([functools.partial(SlowEnv, 0.5)] * 2, num_workers=2)
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    with pytest.raises(multiprocessing.TimeoutError) as raised:
        envs.step_wait(timeout=0.05)
    assert isinstance(raised.value, WorkerTimeoutError) and isinstance(raised.value, TimeoutError)
    envs.close(terminate=True)


# -- actions ----------------------------------------------------------------------------------
def test_dict_actions_with_unsorted_keys_step_as_with_sync(layout):
    actions = {"a": np.array([1, 2, 0, 2]), "b": np.array([[5.0], [6.0], [-7.0], [8.0]], np.float32)}
    reference = SyncVectorEnv([UnsortedDictActionEnv] * 4)
    with ClusterEnv([UnsortedDictActionEnv] * 4, **layout) as envs:
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        assert_same(reference.step(actions), envs.step(actions))
    reference.close()


def test_actions_without_an_array_form_reach_each_env_as_given(layout):
    reference = SyncVectorEnv([TextActionEnv] * 4)
    with ClusterEnv([TextActionEnv] * 4, **layout) as envs:
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        for actions in [("a", "bb", "ccc", "dddd"), ("stop", "x", "stop", "yy"), ["", "q", "rr", "stop"]]:
            assert_same(reference.step(actions), envs.step(actions))
    reference.close()


def test_a_scalar_action_for_a_vector_env_is_a_type_error():
    with ClusterEnv([CARTPOLE] * 2, num_workers=2) as envs:
        envs.reset(seed=0)
        with pytest.raises(TypeError, match="one action per env"):
            envs.step(np.int64(1))
        with pytest.raises(ValueError, match=re.escape("must have shape (2,)")):
            envs.step(np.zeros(3, dtype=np.int64))


# -- observation_mode as a (batch space, single space) tuple ------------------------------------
def test_observation_mode_given_as_spaces_matches_sync():
    fns = [functools.partial(ObservationSpaceEnv, spaces.Box(0, high, (5,))) for high in (1, 2, 3)]
    mode = (spaces.Box(0, np.repeat(np.arange(1, 4), 5).reshape(3, 5), (3, 5)), spaces.Box(0, 1, (5,)))
    reference = SyncVectorEnv(fns, observation_mode=mode)
    with ClusterEnv(fns, num_workers=2, observation_mode=mode) as envs:
        assert envs.observation_space == reference.observation_space
        assert envs.single_observation_space == reference.single_observation_space
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        assert_same(reference.step(np.array([0, 1, 0])), envs.step(np.array([0, 1, 0])))
    reference.close()


# -- make_vec with AsyncVectorEnv's arguments ---------------------------------------------------
def test_make_vec_accepts_async_arguments_and_reproduces_sync():
    reference = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    envs = clusterenv.make_vec(
        "CartPole-v1",
        num_envs=4,
        vectorization_mode="async",
        vector_kwargs={"shared_memory": True, "context": "spawn", "daemon": True, "num_workers": 2},
    )
    with envs:
        assert_same(reference.reset(seed=1), envs.reset(seed=1))
        for _ in range(30):
            actions = np.array([0, 1, 1, 0])
            assert_same(reference.step(actions), envs.step(actions))
    reference.close()


def test_make_vec_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match=re.escape("`vector_kwargs['worker']` cannot be honoured")):
        clusterenv.make_vec("CartPole-v1", 2, vectorization_mode="async", vector_kwargs={"worker": print})
    with pytest.raises(ValueError, match="vector_entry_point"):
        clusterenv.make_vec("CartPole-v1", 2, vectorization_mode="vector_entry_point")


# -- the learner's env registry -----------------------------------------------------------------
def test_an_env_id_registered_only_in_the_learner_is_known_in_the_workers(layout):
    env_id = "clusterenv-test/OnlyInTheLearner-v0"
    gym.register(env_id, entry_point=RichSpacesEnv, max_episode_steps=5, kwargs={"action_kind": "box"})
    try:
        make = functools.partial(gym.make, env_id)
        reference = SyncVectorEnv([make] * 4)
        with ClusterEnv([make] * 4, **layout) as envs:
            assert_same(reference.reset(seed=3), envs.reset(seed=3))
            for _ in range(8):
                actions = reference.action_space.sample()
                assert_same(reference.step(actions), envs.step(actions))
        reference.close()
    finally:
        del gym.registry[env_id]


def _self_registered_run(layout, max_episode_steps: int, capfd) -> str:
    """What the workers print building envs whose factory registers its id again (the learner registered it)."""
    register_self_registered()
    try:
        with ClusterEnv([functools.partial(make_after_registering, max_episode_steps)] * 2, **layout) as envs:
            envs.reset(seed=0)
    finally:
        del gym.registry[SELF_REGISTERED_ID]
    return capfd.readouterr().err


def test_a_factory_registering_the_learners_ids_again_prints_no_override_warnings(layout, capfd):
    printed = _self_registered_run(layout, 5, capfd)
    assert "Overriding environment" not in printed
    # Every other warning is still shown, once per process that builds envs.
    assert printed.count("UserWarning: a factory's own warning") == 2


def test_a_factory_registering_an_id_differently_from_the_learner_is_still_warned_about(layout, capfd):
    printed = _self_registered_run(layout, 7, capfd)
    assert printed.count(f"Overriding environment {SELF_REGISTERED_ID} already in registry") == 2


# -- envs addressed by index, functions run where the envs live, per-env reset options ---------
def test_get_attr_set_attr_and_apply_take_indices(layout):
    with ClusterEnv([CARTPOLE] * 4, **layout) as envs:
        envs.reset(seed=0)
        envs.set_attr("marker", [10, 11], indices=[3, 0])
        assert envs.get_attr("marker", indices=[0, -1]) == (11, 10)
        envs.set_attr("marker", 5, indices=2)
        assert envs.get_attr("marker", indices=[2]) == (5,)
        assert envs.apply(lambda env: env.unwrapped.spec.id) == ("CartPole-v1",) * 4
        assert envs.apply(lambda env: type(env).__name__, indices=[1]) == ("TimeLimit",)
        with pytest.raises(IndexError, match=re.escape("Env index 4 is out of range for num_envs=4.")):
            envs.get_attr("marker", indices=[4])
        with pytest.raises(AttributeError):
            envs.get_attr("marker", indices=[1])


def test_per_env_reset_options_reach_their_own_env(layout):
    options = [{"level": 1}, None, {"level": 3}, {}]
    fn = functools.partial(RichSpacesEnv, "discrete")
    references = [fn() for _ in range(4)]
    expected = [
        env.reset(seed=7 + i, options=opts) for i, (env, opts) in enumerate(zip(references, options, strict=True))
    ]
    with ClusterEnv([fn] * 4, **layout) as envs:
        obs, infos = envs.reset(seed=7, options=options)
    assert infos["start"].tolist() == [info["start"] for _, info in expected]
    assert infos["_options"].tolist() == [True, False, True, False]
    assert infos["options"]["level"][[0, 2]].tolist() == [1, 3]
    assert_same(obs["image"], np.stack([o["image"] for o, _ in expected]))


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_pickled_actions_are_exact_in_each_autoreset_mode(mode):
    reference = SyncVectorEnv([TextActionEnv] * 3, autoreset_mode=mode)
    with ClusterEnv([TextActionEnv] * 3, num_workers=2, autoreset_mode=mode) as envs:
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        for actions in [("stop", "a", "b"), ("c", "stop", "d"), ("e", "f", "g")]:
            assert_same(reference.step(actions), envs.step(actions))
    reference.close()


# -- a step before the first reset -----------------------------------------------------------
PATHS = {"shared memory": {"num_workers": 2}, "messages": {"num_workers": 2, "shared_memory": False}, **LAYOUTS}


@pytest.mark.parametrize("options", PATHS.values(), ids=PATHS)
def test_envs_built_without_order_enforcing_step_before_any_reset_as_with_sync(options):
    with ClusterEnv([CountingEnv] * 4, **options) as envs, contextlib.closing(SyncVectorEnv([CountingEnv] * 4)) as ref:
        for t in range(3):
            assert_same(ref.step(np.array([t % 3, 1, 2, 0])), envs.step(np.array([t % 3, 1, 2, 0])))
        assert_same(ref.reset(seed=2), envs.reset(seed=2))
        assert_same(ref.step(np.array([1, 1, 1, 1])), envs.step(np.array([1, 1, 1, 1])))


@pytest.mark.parametrize("options", PATHS.values(), ids=PATHS)
def test_an_env_that_refuses_a_step_before_reset_raises_its_own_error(options):
    """A raw CartPole asserts that it was reset: that AssertionError reaches the caller, as from Sync."""
    with contextlib.closing(SyncVectorEnv([CartPoleEnv] * 2)) as reference, pytest.raises(AssertionError):
        reference.step(np.array([0, 1]))
    with ClusterEnv([CartPoleEnv] * 2, **options) as envs:
        with pytest.raises(AssertionError, match="Call reset before using step method"):
            envs.step(np.array([0, 1]))


@pytest.mark.parametrize("options", PATHS.values(), ids=PATHS)
def test_envs_made_with_gym_make_raise_reset_needed_and_stay_usable(options):
    with contextlib.closing(SyncVectorEnv([CARTPOLE] * 2)) as reference, pytest.raises(ResetNeeded):
        reference.step(np.array([0, 1]))
    with ClusterEnv([CARTPOLE] * 2, **options) as envs:
        with pytest.raises(ResetNeeded):
            envs.step(np.array([0, 1]))
        envs.reset(seed=0)
        envs.step(np.array([0, 1]))
