"""PettingZoo games across the cluster: ``clusterenv.pettingzoo.make_vec`` equals SuperSuit's ``concat_vec_envs_v1``.

Copies of a parallel game, each SuperSuit's vector env over its agents (one slot per agent),
stepped as units; with the same copies and seeds the ``ClusterEnv`` returns, step for step, what
``concat_vec_envs_v1(..., num_cpus=0, base_class="gymnasium")`` returns (its per-env infos
merged as Gymnasium merges them).
"""

from __future__ import annotations

import functools
from contextlib import closing
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from tests.conftest import assert_same

pettingzoo = pytest.importorskip("pettingzoo")
pytest.importorskip("supersuit")

from supersuit import black_death_v3, concat_vec_envs_v1, pettingzoo_env_to_vec_env_v1  # noqa: E402

import clusterenv.pettingzoo  # noqa: E402  (after the skips: it needs neither, but the tests do)

# (No `supersuit` module at module level: its __getattr__ raises ImportError for any other name,
# which breaks pytest's collection.)


# PettingZoo 1.27 makes games from its registry (importing `pistonball_v6` and calling it is deprecated there).
pistonball = functools.partial(pettingzoo.make, "parallel", "butterfly/pistonball-v6")


def knights_archers_zombies() -> Any:
    # Archers and knights can die: SuperSuit's vector env needs black death for that.
    # (PettingZoo 1.27 ships knights_archers_zombies v11; v10 is deprecated there.)
    return black_death_v3(pettingzoo.make("parallel", "butterfly/knights_archers_zombies-v11"))


GAMES = {"pistonball_v6": pistonball, "knights_archers_zombies_v11": knights_archers_zombies}


def batched(per_env_infos: list[dict[str, Any]]) -> dict[str, Any]:
    """SuperSuit's list of per-env infos, merged by Gymnasium's own ``_add_info`` as the ``ClusterEnv`` merges them."""
    merger = SyncVectorEnv([lambda: gym.make("CartPole-v1")])
    merger.num_envs = len(per_env_infos)
    infos: dict[str, Any] = {}
    for i, info in enumerate(per_env_infos):
        if info:
            infos = merger._add_info(infos, info, i)
    merger.close()
    return infos


@pytest.mark.parametrize("game", GAMES.values(), ids=GAMES.keys())
def test_copies_of_a_game_equal_supersuits_concat_vec_envs(game):
    # Past a game's end (pistonball's games last 125 steps): copies reset within the step.
    copies, steps = 3, 130 if game is pistonball else 400
    reference = concat_vec_envs_v1(pettingzoo_env_to_vec_env_v1(game()), copies, num_cpus=0, base_class="gymnasium")
    with clusterenv.pettingzoo.make_vec(game, copies, num_workers=2) as envs, closing(reference):
        agents = reference.num_envs // copies
        assert envs.num_envs == copies * agents
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert envs.single_observation_space == reference.observation_space
        assert envs.single_action_space == reference.action_space
        # 2 copies on worker 0, 1 on worker 1: whole games per worker.
        assert [w["units"] for w in envs.worker_info] == [
            [(0, agents - 1), (agents, 2 * agents - 1)],
            [(2 * agents, 3 * agents - 1)],
        ]
        obs, infos = reference.reset(seed=42)
        assert_same(envs.reset(seed=42), (obs, batched(infos)))
        reference.action_space.seed(0)
        ended = 0
        for _ in range(steps):
            actions = np.stack([reference.action_space.sample() for _ in range(reference.num_envs)])
            obs, rewards, terminations, truncations, infos = reference.step(actions)
            expected = (
                obs,
                rewards.astype(np.float64),
                terminations.astype(bool),
                truncations.astype(bool),
                batched(infos),
            )
            assert_same(envs.step(actions), expected)
            ended += int("terminal_observation" in expected[4])
        assert ended >= 1, "a game must end, to test the reset within the step"


def test_copy_i_is_seeded_seed_plus_i_as_supersuit_seeds_it():
    game = pistonball
    with clusterenv.pettingzoo.make_vec(game, 2, num_workers=1) as envs:
        obs, _ = envs.reset(seed=7)
    first = pettingzoo_env_to_vec_env_v1(game())
    second = pettingzoo_env_to_vec_env_v1(game())
    np.testing.assert_array_equal(obs[:20], first.reset(seed=7)[0])
    np.testing.assert_array_equal(obs[20:], second.reset(seed=8)[0])  # not 7 + 20, its first slot


def test_bad_arguments_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"`num_envs` \(copies of the game\) must be a positive int, got 0"):
        clusterenv.pettingzoo.make_vec(pistonball, 0)
    with pytest.raises(
        TypeError, match=r"`parallel_env_fn` must be a callable that makes the game, got aec_to_parallel_wrapper"
    ):
        clusterenv.pettingzoo.make_vec(pistonball(), 2)


def preprocessed_pistonball() -> Any:
    """The game of SuperSuit's Stable-Baselines3 recipe: grey 84 x 84 frames, 3 stacked, continuous pistons."""
    from supersuit import color_reduction_v0, frame_stack_v1, resize_v1

    env = pettingzoo.make("parallel", "butterfly/pistonball-v6", continuous=True, max_cycles=125)
    return frame_stack_v1(resize_v1(color_reduction_v0(env, mode="B"), x_size=84, y_size=84), 3)


# SuperSuit's SB3 wrapper has no `get_attr` for SB3's render-mode probe, and SB3 warns about it.
@pytest.mark.filterwarnings("ignore:The `render_mode` attribute is not defined:UserWarning")
def test_sb3_ppo_on_pistonball_trains_to_supersuits_weights_through_cluster_vec_env():
    pytest.importorskip("stable_baselines3")
    torch = pytest.importorskip("torch")
    from stable_baselines3 import PPO
    from stable_baselines3.common.utils import set_random_seed

    from clusterenv.sb3 import ClusterVecEnv

    def train(env: Any, seeded_reset: Any) -> dict[str, Any]:
        # SuperSuit's SB3 wrapper resets without SB3's seeds: both runs start from one seeded reset.
        seeded_reset(7)
        set_random_seed(0)
        model = PPO("CnnPolicy", env, n_steps=8, batch_size=160, n_epochs=1, learning_rate=1e-3, device="cpu")
        model.learn(total_timesteps=2 * 8 * env.num_envs)
        return model.policy.state_dict()

    reference = concat_vec_envs_v1(
        pettingzoo_env_to_vec_env_v1(preprocessed_pistonball()), 2, num_cpus=0, base_class="stable_baselines3"
    )
    with closing(reference):
        expected = train(reference, lambda seed: reference.venv.reset(seed=seed))
    env = ClusterVecEnv(clusterenv.pettingzoo.env_fns(preprocessed_pistonball, 2), num_workers=2)
    with closing(env):
        assert env.num_envs == 40
        got = train(env, lambda seed: env.cluster_env.reset(seed=seed))
    assert expected.keys() == got.keys()
    for name, weights in expected.items():
        assert torch.equal(weights, got[name]), name
