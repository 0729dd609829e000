"""``clusterenv.sb3.ClusterVecEnv`` returns what Stable-Baselines3's ``DummyVecEnv`` returns, and trains identically."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch

sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize  # noqa: E402

from clusterenv.sb3 import ClusterVecEnv  # noqa: E402
from tests.conftest import assert_same  # noqa: E402
from tests.envs import CountingEnv, FlakyCartPole, NoOptionsEnv, ResetArgumentsEnv, RichSpacesEnv  # noqa: E402


def monitored_cartpole() -> gym.Env:
    return Monitor(gym.make("CartPole-v1"))


def monitored_pendulum() -> gym.Env:
    return Monitor(gym.make("Pendulum-v1", max_episode_steps=50))


def same_infos(expected: list[dict], got: list[dict]) -> None:
    """Per-env infos equal in keys (and their order) and values; numbers may be numpy scalars after batching.

    Monitor's ``info["episode"]["t"]`` is wall-clock time, so it is not compared.
    """
    assert len(expected) == len(got)
    for want, have in zip(expected, got, strict=True):
        assert list(want) == list(have)
        for key, value in want.items():
            if key == "t" and "r" in want:
                continue
            if isinstance(value, dict):
                same_infos([value], [have[key]])
            elif isinstance(value, np.ndarray) or isinstance(have[key], np.ndarray):
                np.testing.assert_array_equal(value, have[key])
            else:
                assert value == have[key], key


@pytest.mark.parametrize("env_fn", [monitored_cartpole, monitored_pendulum], ids=["CartPole", "Pendulum"])
def test_steps_match_dummy_vec_env(env_fn):
    reference = DummyVecEnv([env_fn] * 4)
    env = ClusterVecEnv([env_fn] * 4, num_workers=2)
    try:
        reference.seed(3)
        env.seed(3)
        assert_same(reference.reset(), env.reset())
        same_infos(reference.reset_infos, env.reset_infos)
        reference.action_space.seed(0)
        for _ in range(200):
            actions = np.stack([reference.action_space.sample() for _ in range(4)])
            want, got = reference.step(actions), env.step(actions)
            assert_same(want[:3], got[:3])  # observations, float32 rewards, dones
            same_infos(want[3], got[3])
            same_infos(reference.reset_infos, env.reset_infos)
    finally:
        reference.close()
        env.close()


def test_options_seeds_attributes_and_wrappers_follow_sb3():
    env = ClusterVecEnv([functools.partial(RichSpacesEnv, "discrete")] * 3, num_workers=2)
    try:
        env.set_options([{"level": 1}, {}, {"level": 3}])
        env.reset()
        assert [info.get("options") for info in env.reset_infos] == [{"level": 1}, None, {"level": 3}]
        env.reset()  # options are used once
        assert [info.get("options") for info in env.reset_infos] == [None, None, None]
        assert env.env_is_wrapped(gym.Wrapper) == [False] * 3
        assert not env.has_attr("no_such_attribute")
        env.set_attr("marker", 7, indices=[0, 2])
        assert env.get_attr("marker", indices=[0, -1]) == [7, 7]
        assert env.env_method("render", indices=1)[0].shape == (4, 4, 3)
    finally:
        env.close()
    with pytest.raises(ValueError, match="sets `autoreset_mode` itself"):
        ClusterVecEnv([monitored_cartpole], autoreset_mode="NextStep")
    with pytest.raises(ValueError):
        ClusterVecEnv([monitored_cartpole], start_method="no_such_method")


def test_sb3_wrappers_stack_on_it():
    env = VecNormalize(ClusterVecEnv([monitored_cartpole] * 2, num_workers=2))
    try:
        env.seed(0)
        obs = env.reset()
        obs, rewards, dones, infos = env.step(np.array([0, 1]))
        assert obs.shape == (2, 4) and rewards.dtype == np.float32 and len(infos) == 2
    finally:
        env.close()


def final_weights_and_returns(algorithm: type, vec_env_cls: type, steps: int, **hyperparameters) -> tuple:
    env = vec_env_cls([monitored_cartpole] * 4, **({} if vec_env_cls is DummyVecEnv else {"num_workers": 2}))
    try:
        model = algorithm("MlpPolicy", env, seed=0, device="cpu", **hyperparameters)
        returns = []
        model.learn(steps, callback=lambda locals_, _: returns.extend(_episode_returns(locals_)) or True)
        weights = {name: value.clone() for name, value in model.policy.state_dict().items()}
    finally:
        env.close()
    return weights, returns


def _episode_returns(locals_: dict) -> list[float]:
    return [info["episode"]["r"] for info in locals_.get("infos", []) if "episode" in info]


ALGORITHMS = {
    "PPO": ("PPO", 1024, {"n_steps": 64, "batch_size": 64, "n_epochs": 2}),
    "DQN": ("DQN", 1500, {"learning_starts": 200, "buffer_size": 2000, "train_freq": 4, "target_update_interval": 100}),
}


@pytest.mark.parametrize(("name", "steps", "hyperparameters"), ALGORITHMS.values(), ids=ALGORITHMS)
def test_training_is_bit_identical_to_dummy_vec_env(name, steps, hyperparameters):
    algorithm = getattr(sb3, name)
    torch.set_num_threads(1)
    weights, returns = final_weights_and_returns(algorithm, DummyVecEnv, steps, **hyperparameters)
    cluster_weights, cluster_returns = final_weights_and_returns(algorithm, ClusterVecEnv, steps, **hyperparameters)
    assert len(returns) > 10 and returns == cluster_returns
    assert weights.keys() == cluster_weights.keys()
    for key in weights:
        assert torch.equal(weights[key], cluster_weights[key]), key


def no_options_returns(vec_env_cls: type) -> list[tuple[float, int]]:
    vec_env_kwargs = {} if vec_env_cls is DummyVecEnv else {"num_workers": 2}
    env = make_vec_env(NoOptionsEnv, n_envs=4, seed=5, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
    try:
        model = sb3.PPO("MlpPolicy", env, seed=0, device="cpu", n_steps=32, batch_size=64, n_epochs=1)
        episodes: list[tuple[float, int]] = []
        model.learn(1024, callback=lambda locals_, _: episodes.extend(_episodes(locals_)) or True)
    finally:
        env.close()
    return episodes


def _episodes(locals_: dict) -> list[tuple[float, int]]:
    return [(info["episode"]["r"], info["episode"]["l"]) for info in locals_.get("infos", []) if "episode" in info]


def test_envs_whose_reset_takes_no_options_train_as_on_dummy_vec_env():
    """SB3 passes ``options=`` only to envs that ``set_options`` gave options, and none when it autoresets."""
    torch.set_num_threads(1)
    episodes = no_options_returns(DummyVecEnv)
    assert len(episodes) > 20
    assert no_options_returns(ClusterVecEnv) == episodes


def test_resets_get_the_arguments_dummy_vec_env_gives():
    """``seed=`` always, ``options=`` only where set; an autoreset gets no arguments at all."""
    envs = [DummyVecEnv([ResetArgumentsEnv] * 3), ClusterVecEnv([ResetArgumentsEnv] * 3, num_workers=2)]
    try:
        for env in envs:
            env.seed(1)
            env.set_options([None, {"level": 2}, {}])
            env.reset()
        assert envs[0].reset_infos[1]["reset_arguments"] == ["options", "seed"]
        assert envs[0].reset_infos[0]["reset_arguments"] == envs[0].reset_infos[2]["reset_arguments"] == ["seed"]
        same_infos(envs[0].reset_infos, envs[1].reset_infos)
        for _ in range(25):  # every episode ends by step 25, and is reset without arguments
            steps = [env.step(np.array([0, 1, 1])) for env in envs]
            same_infos(steps[0][3], steps[1][3])
            same_infos(envs[0].reset_infos, envs[1].reset_infos)
        assert [info["reset_arguments"] for info in envs[1].reset_infos] == [[], [], []]
        assert envs[1].get_attr("t") == envs[0].get_attr("t")  # attribute methods see the env itself
        assert envs[1].env_is_wrapped(gym.Wrapper) == [False] * 3
    finally:
        for env in envs:
            env.close()


def test_an_env_error_ends_the_episode_as_sb3_reports_a_time_limit(tmp_path):
    flaky = functools.partial(FlakyCartPole, str(tmp_path / "raised.txt"), 0.05)
    env = ClusterVecEnv([flaky] * 2, num_workers=2, on_env_error="reset", max_env_errors=100)
    try:
        env.seed(0)
        env.reset()
        errors = []
        for _ in range(200):
            _, rewards, dones, infos = env.step(np.array([0, 1]))
            for i, info in enumerate(infos):
                if "env_error" in info:
                    assert dones[i] and rewards[i] == 0 and info["TimeLimit.truncated"]
                    assert info["terminal_observation"].shape == (4,)
                    errors.append(info["env_error"]["message"])
    finally:
        env.close()
    assert errors and sorted(errors) == sorted((tmp_path / "raised.txt").read_text().splitlines())


def test_a_step_before_any_reset_returns_what_dummy_vec_env_returns():
    """Stable-Baselines3's own ``test_check_nan`` steps a raw env (no ``OrderEnforcing``) without a reset."""
    reference, envs = DummyVecEnv([CountingEnv] * 2), ClusterVecEnv([CountingEnv] * 2, num_workers=2)
    try:
        for t in range(3):
            actions = np.array([t % 3, 2])
            reference.step_async(actions)
            envs.step_async(actions)
            assert_same(reference.step_wait(), envs.step_wait())
    finally:
        reference.close()
        envs.close()
