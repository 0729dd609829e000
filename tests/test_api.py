"""Everything a ``VectorEnv`` user relies on works on ClusterEnv exactly as on SyncVectorEnv."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import pkgutil

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space
from gymnasium.wrappers import vector as vector_wrappers

import clusterenv
from clusterenv import ClusterEnv
from tests.conftest import assert_same
from tests.envs import RichSpacesEnv, SlowCartPole

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
PENDULUM = functools.partial(gym.make, "Pendulum-v1", max_episode_steps=25)
RICH = functools.partial(RichSpacesEnv, "discrete", render_mode="rgb_array")

BACKENDS = {
    "SyncVectorEnv": SyncVectorEnv,
    "ClusterEnv(2 workers)": functools.partial(ClusterEnv, num_workers=2),
    "ClusterEnv(2 workers x 2 procs)": functools.partial(ClusterEnv, num_workers=2, procs_per_worker=2),
}


@pytest.fixture(params=BACKENDS.values(), ids=BACKENDS)
def vector(request):
    """``vector(env_fns, **kwargs)`` builds the backend under test; everything it built is closed after."""
    opened = []

    def make(env_fns, **kwargs):
        envs = request.param(env_fns, **kwargs)
        opened.append(envs)
        return envs

    yield make
    for envs in opened:
        envs.close()


def lockstep(reference, candidate, steps: int, seed: int = 0) -> None:
    """Same seeds, same actions: every return value is identical (but episode wall-clock times)."""
    assert_same(reference.reset(seed=seed), candidate.reset(seed=seed))
    reference.action_space.seed(seed)
    for _ in range(steps):
        actions = reference.action_space.sample()
        assert_same(without_times(reference.step(actions)), without_times(candidate.step(actions)))


def without_times(step):
    """RecordEpisodeStatistics puts wall-clock episode times in ``infos["episode"]["t"]``."""
    infos = step[-1]
    if isinstance(infos, dict) and "episode" in infos:
        infos["episode"].pop("t")
    return step


# -- the VectorEnv surface -------------------------------------------------------------------
def test_is_a_gymnasium_vector_env(vector):
    envs = vector([CARTPOLE] * 3)
    assert isinstance(envs, VectorEnv)
    assert envs.unwrapped is envs
    assert envs.num_envs == 3


def test_spaces_are_batched_single_spaces(vector):
    envs = vector([RICH] * 3)
    single = RichSpacesEnv("discrete")
    assert envs.single_observation_space == single.observation_space
    assert envs.single_action_space == single.action_space
    assert envs.observation_space == batch_space(single.observation_space, 3)
    assert envs.action_space == batch_space(single.action_space, 3)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=[m.value for m in AutoresetMode])
def test_metadata_carries_the_env_metadata_and_the_autoreset_mode(vector, mode):
    envs = vector([RICH] * 2, autoreset_mode=mode)
    assert envs.metadata == {"render_modes": ["rgb_array"], "render_fps": 30, "autoreset_mode": mode}
    assert isinstance(envs.metadata["autoreset_mode"], AutoresetMode)
    assert envs.autoreset_mode is mode


@pytest.mark.parametrize("render_mode", [None, "rgb_array"])
def test_render_mode_is_the_envs(vector, render_mode):
    envs = vector([functools.partial(RichSpacesEnv, "discrete", render_mode=render_mode)] * 2)
    assert envs.render_mode == render_mode


def test_render_returns_one_frame_per_env(vector):
    envs = vector([RICH] * 3)
    envs.reset(seed=0)
    envs.step(np.zeros(3, dtype=np.int64))
    envs.step(np.zeros(3, dtype=np.int64))
    frames = envs.render()
    assert isinstance(frames, tuple) and len(frames) == 3
    for frame, t in zip(frames, envs.get_attr("t"), strict=True):
        assert_same(frame, np.full((4, 4, 3), t, dtype=np.uint8))


def test_cartpole_renders_rgb_arrays(vector):
    envs = vector([functools.partial(gym.make, "CartPole-v1", render_mode="rgb_array")] * 2)
    envs.reset(seed=0)
    frames = envs.render()
    assert [frame.shape for frame in frames] == [(400, 600, 3)] * 2
    assert all(frame.dtype == np.uint8 for frame in frames)


def test_get_attr_and_call_read_every_env_in_order(vector):
    envs = vector([functools.partial(RichSpacesEnv, "discrete", max_len=n) for n in (5, 6, 7)])
    assert envs.get_attr("max_len") == (5, 6, 7)
    assert envs.call("max_len") == (5, 6, 7)  # not callable: read
    assert envs.call("get_wrapper_attr", "max_len") == (5, 6, 7)  # callable: called with args
    assert len(envs.call("set_wrapper_attr", "max_len", 8, force=True)) == 3  # and kwargs
    assert envs.get_attr("max_len") == (8, 8, 8)


def test_set_attr_with_one_value_or_one_per_env(vector):
    envs = vector([RICH] * 3)
    envs.set_attr("max_len", 9)
    assert envs.get_attr("max_len") == (9, 9, 9)
    envs.set_attr("max_len", [1, 2, 3])
    assert envs.get_attr("max_len") == (1, 2, 3)
    envs.set_attr("max_len", (4, 5, 6))
    assert envs.get_attr("max_len") == (4, 5, 6)


def test_set_attr_changes_what_the_envs_do(vector):
    envs = vector([RICH] * 2)
    envs.reset(seed=0)
    envs.set_attr("max_len", [1, 100])
    _, _, _, truncations, _ = envs.step(np.zeros(2, dtype=np.int64))
    assert truncations.tolist() == [True, False]


def test_np_random_seed_is_per_env(vector):
    envs = vector([RICH] * 3)
    envs.reset(seed=5)
    assert envs.np_random_seed == (5, 6, 7)
    envs.reset(seed=[11, None, 13])
    seeds = envs.np_random_seed
    assert (seeds[0], seeds[2]) == (11, 13)


def test_np_random_is_a_copy_of_each_envs_generator():
    reference = SyncVectorEnv([RICH] * 3)
    with ClusterEnv([RICH] * 3, num_workers=2) as envs:
        reference.reset(seed=3)
        envs.reset(seed=3)
        generators = envs.np_random
        assert isinstance(generators, tuple) and len(generators) == 3
        assert all(isinstance(g, np.random.Generator) for g in generators)
        for got, expected in zip(generators, reference.np_random, strict=True):
            assert got.bit_generator.state == expected.bit_generator.state
    reference.close()


# -- async API -------------------------------------------------------------------------------
def test_async_calls_match_their_sync_versions():
    reference = SyncVectorEnv([RICH] * 3)
    with ClusterEnv([RICH] * 3, num_workers=2) as envs:
        envs.reset_async(seed=4, options={"level": 1})
        assert_same(reference.reset(seed=4, options={"level": 1}), envs.reset_wait(timeout=10))
        reference.action_space.seed(0)
        for _ in range(30):
            actions = reference.action_space.sample()
            envs.step_async(actions)
            assert_same(reference.step(actions), envs.step_wait(timeout=10))
        envs.call_async("max_len")
        assert envs.call_wait(timeout=10) == (17, 17, 17)
    reference.close()


# -- Gymnasium's vector wrappers on top ------------------------------------------------------
WRAPPED = {
    "RecordEpisodeStatistics": (CARTPOLE, vector_wrappers.RecordEpisodeStatistics),
    "NormalizeObservation": (CARTPOLE, vector_wrappers.NormalizeObservation),
    "NormalizeReward": (PENDULUM, vector_wrappers.NormalizeReward),
    "ClipAction": (PENDULUM, vector_wrappers.ClipAction),
    "FlattenObservation(Dict obs)": (RICH, vector_wrappers.FlattenObservation),
    "DictInfoToList": (RICH, vector_wrappers.DictInfoToList),
    "RecordEpisodeStatistics+NormalizeObservation": (
        PENDULUM,
        lambda envs: vector_wrappers.NormalizeObservation(vector_wrappers.RecordEpisodeStatistics(envs)),
    ),
}


@pytest.mark.parametrize(("env_fn", "wrap"), WRAPPED.values(), ids=WRAPPED)
def test_vector_wrappers_give_the_same_results_as_on_sync_vector_env(env_fn, wrap):
    reference = wrap(SyncVectorEnv([env_fn] * 3))
    candidate = wrap(ClusterEnv([env_fn] * 3, num_workers=2))
    try:
        assert candidate.observation_space == reference.observation_space
        assert candidate.action_space == reference.action_space
        lockstep(reference, candidate, steps=60)
    finally:
        candidate.close()
        reference.close()
    assert candidate.unwrapped.closed


def test_record_episode_statistics_reports_episodes():
    envs = vector_wrappers.RecordEpisodeStatistics(ClusterEnv([CARTPOLE] * 2, num_workers=2))
    try:
        envs.reset(seed=0)
        lengths = []
        for _ in range(200):
            *_, infos = envs.step(np.ones(2, dtype=np.int64))
            if "episode" in infos:
                lengths += infos["episode"]["l"][infos["_episode"]].tolist()
        assert lengths and all(8 <= n <= 500 for n in lengths)
    finally:
        envs.close()


# -- observation_mode="different" ------------------------------------------------------------
def rescaled_pendulum() -> gym.Env:
    return gym.wrappers.RescaleObservation(PENDULUM(), min_obs=np.float32(-1.0), max_obs=np.float32(1.0))


def test_observation_mode_different_matches_sync_vector_env():
    env_fns = [PENDULUM, rescaled_pendulum, PENDULUM]
    reference = SyncVectorEnv(env_fns, observation_mode="different")
    with ClusterEnv(env_fns, num_workers=2, observation_mode="different") as candidate:
        assert candidate.observation_space == reference.observation_space
        assert candidate.single_observation_space == reference.single_observation_space
        lockstep(reference, candidate, steps=60)
    reference.close()


def test_observation_mode_same_refuses_differing_spaces(vector):
    with pytest.raises(RuntimeError, match="observation_mode='different'"):
        vector([PENDULUM, rescaled_pendulum])


# -- make_vec ----------------------------------------------------------------------------------
def test_make_vec_matches_gymnasium_make_vec():
    kwargs = {"num_envs": 3, "wrappers": [gym.wrappers.TimeAwareObservation], "max_episode_steps": 10}
    reference = gym.make_vec("CartPole-v1", vectorization_mode="sync", **kwargs)
    with clusterenv.make_vec("CartPole-v1", vector_kwargs={"num_workers": 2}, **kwargs) as candidate:
        assert isinstance(candidate, ClusterEnv)
        assert candidate.single_observation_space == reference.single_observation_space
        lockstep(reference, candidate, steps=40)
        assert candidate.get_attr("spec")[0].max_episode_steps == 10
        expected_spec = {
            **reference.spec.kwargs,
            "vectorization_mode": "clusterenv",
            "vector_kwargs": {"num_workers": 2},
        }
        assert candidate.spec.kwargs == expected_spec
        assert candidate.spec.id == reference.spec.id
        assert repr(candidate) == "ClusterEnv(CartPole-v1, num_envs=3, num_workers=2)"
    reference.close()


def test_make_vec_env_kwargs_reach_the_env():
    with clusterenv.make_vec("Pendulum-v1", num_envs=2, g=3.5, vector_kwargs={"num_workers": 1}) as envs:
        assert envs.get_attr("g") == (3.5, 3.5)
        assert envs.spec.kwargs["g"] == 3.5


def test_make_vec_vector_kwargs_reach_cluster_env():
    vector_kwargs = {"num_workers": 2, "autoreset_mode": AutoresetMode.SAME_STEP, "timeout": 30.0}
    with clusterenv.make_vec("CartPole-v1", num_envs=4, vector_kwargs=vector_kwargs) as envs:
        assert (envs.num_workers, envs.timeout) == (2, 30.0)
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert envs.spec.kwargs["vector_kwargs"] == vector_kwargs


def test_make_vec_from_its_own_spec_makes_the_same_envs():
    with clusterenv.make_vec("CartPole-v1", num_envs=3, vector_kwargs={"num_workers": 2}, max_episode_steps=7) as first:
        with clusterenv.make_vec(first.spec) as second:
            assert (second.num_envs, second.num_workers) == (3, 2)
            assert second.spec.kwargs == first.spec.kwargs
            lockstep(first, second, steps=20)


def test_make_vec_accepts_and_ignores_vectorization_mode():
    with clusterenv.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync") as envs:
        assert isinstance(envs, ClusterEnv)
        assert envs.spec.kwargs["vectorization_mode"] == "clusterenv"


def test_make_vec_without_a_mode_logs_once_what_the_vector_entry_point_would_have_given(caplog, monkeypatch):
    """``gymnasium.make_vec(id, n)`` would have made CartPole's own vector env: say so, once per id and process."""
    cartpole = "gymnasium.envs.classic_control.cartpole"
    vectorized, chosen = "clusterenv-test/VectorizedCartPole-v0", "clusterenv-test/SyncChosenCartPole-v0"
    for env_id in (vectorized, chosen):
        monkeypatch.setitem(
            gym.registry,
            env_id,
            gym.envs.registration.EnvSpec(
                env_id, f"{cartpole}:CartPoleEnv", vector_entry_point=f"{cartpole}:CartPoleVectorEnv"
            ),
        )
    with caplog.at_level(logging.INFO, logger="clusterenv.make"):
        for _ in range(2):
            clusterenv.make_vec(vectorized, num_envs=2, vector_kwargs={"num_workers": 1}).close()
        clusterenv.make_vec(chosen, num_envs=2, vectorization_mode="sync", vector_kwargs={"num_workers": 1}).close()
        clusterenv.make_vec("Pendulum-v1", num_envs=2, vector_kwargs={"num_workers": 1}).close()  # has none
    told = [record for record in caplog.records if record.name == "clusterenv.make"]
    assert [record.levelno for record in told] == [logging.INFO]
    message = told[0].getMessage()
    assert message.startswith(f"clusterenv.make_vec('{vectorized}', 2) steps 2 single envs in worker processes")
    assert f"(vector_entry_point: {cartpole}:CartPoleVectorEnv)" in message
    assert (
        f"functools.partial(gymnasium.make_vec, '{vectorized}', k, vectorization_mode='vector_entry_point')" in message
    )
    assert "docs/guides/units.md" in message


def test_repr_without_spec():
    with ClusterEnv([CARTPOLE] * 2, num_workers=1) as envs:
        assert repr(envs) == "ClusterEnv(num_envs=2, num_workers=1)"
        assert envs.spec is None


# -- the package surface ---------------------------------------------------------------------
def test_all_lists_exactly_the_public_names():
    """As httpx does: ``from clusterenv import *`` is the documented API, no more, no less."""
    for name in clusterenv.__all__:  # the package imports its public names on first use
        getattr(clusterenv, name)
    names = {
        name
        for name, value in vars(clusterenv).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert sorted(clusterenv.__all__) == sorted(names)
    assert len(set(clusterenv.__all__)) == len(clusterenv.__all__)


def submodules():
    return [info.name for info in pkgutil.walk_packages(clusterenv.__path__, "clusterenv.")]


@pytest.mark.parametrize("module_name", submodules())
def test_every_module_declares_its_public_names(module_name):
    module = importlib.import_module(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names {missing}, which do not exist"
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module_name
    }
    unlisted = sorted(defined - set(module.__all__))
    assert not unlisted, f"{module_name} defines public {unlisted} but leaves them out of __all__"


def test_version_matches_the_installed_distribution():
    assert clusterenv.__version__ == importlib.metadata.version("clusterenv-rl")


def test_worker_info_names_each_worker_its_envs_and_how_long_it_has_been_silent():
    with ClusterEnv([CARTPOLE] * 5, num_workers=2) as envs:
        info = envs.worker_info
        assert [entry["worker_id"] for entry in info] == [0, 1]
        assert [entry["env_ids"] for entry in info] == [[0, 1], [2, 3, 4]]
        assert all(entry["pid"] > 0 and entry["host"] for entry in info)
        assert all(0.0 <= entry["silent_s"] < 60.0 for entry in info)


def test_worker_info_shows_which_worker_is_the_straggler():
    """Reply latencies per worker: the one whose envs take 20 ms per step stands out."""
    slow = functools.partial(SlowCartPole, 0.02)
    with ClusterEnv([CARTPOLE, CARTPOLE, slow, slow], num_workers=2) as envs:
        envs.reset(seed=0)
        for _ in range(10):
            envs.step(np.zeros(4, dtype=np.int64))
        fast_worker, slow_worker = (entry["latency_ms"] for entry in envs.worker_info)
        assert slow_worker["replies"] == fast_worker["replies"] >= 11  # building the envs, the reset, 10 steps
        assert slow_worker["p50"] >= 40.0  # two envs of 20 ms each
        assert fast_worker["p50"] < slow_worker["p50"] / 2
        assert fast_worker["p50"] <= fast_worker["p95"] <= fast_worker["max"]
