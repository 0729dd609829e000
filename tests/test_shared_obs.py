"""Large observations go through shared memory on the learner's host, with results still bit-identical."""

from __future__ import annotations

import functools
import glob
import logging
import os
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv
from clusterenv.launch.launchers import LocalLauncher
from clusterenv.wire.shared_memory import SHARED_OBS_MIN_BYTES, SharedObservations, attach, bytes_per_env
from tests.test_equivalence import run_lockstep

FRAME = (96, 128, 3)  # 36 KB per env: two envs per worker are above the sharing threshold


class ImageEnv(gym.Env):
    """Random frames, episodes of random length, and an info that changes with the step."""

    def __init__(self, dict_obs: bool) -> None:
        frame = gym.spaces.Box(0, 255, FRAME, dtype=np.uint8)
        self.dict_obs = dict_obs
        self.observation_space = (
            gym.spaces.Dict({"frame": frame, "pos": gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)})
            if dict_obs
            else frame
        )
        self.action_space = gym.spaces.Discrete(3)

    def _obs(self) -> Any:
        frame = self.np_random.integers(0, 256, FRAME, dtype=np.uint8)
        if not self.dict_obs:
            return frame
        return {"frame": frame, "pos": self.np_random.uniform(-1, 1, 2).astype(np.float32)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self._left = int(self.np_random.integers(3, 25))
        return self._obs(), {"left": self._left}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self._left -= 1
        return self._obs(), float(action), self._left == 0, False, {"left": self._left}


MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
OBS = {"Box image": False, "Dict(image, vector)": True}


CASES = {f"{name}-{mode.value}": (dict_obs, mode, 1) for name, dict_obs in OBS.items() for mode in MODES}
# With env processes, each of them writes its part of the worker's slice into the learner's batch.
CASES.update({f"Dict(image, vector)-{mode.value}-2 procs": (True, mode, 2) for mode in MODES})


@pytest.mark.parametrize(("dict_obs", "mode", "procs"), CASES.values(), ids=CASES.keys())
def test_shared_observations_are_bit_identical_to_sync_vector_env(dict_obs, mode, procs, caplog):
    env_fn = functools.partial(ImageEnv, dict_obs)
    reference = SyncVectorEnv([env_fn] * 5, autoreset_mode=mode)
    with caplog.at_level(logging.DEBUG, logger="clusterenv.learner.step_buffers"):
        candidate = ClusterEnv([env_fn] * 5, num_workers=2, autoreset_mode=mode, procs_per_worker=procs)
    with candidate:
        assert "Workers [0, 1] write observations into shared memory" in caplog.text
        episodes = run_lockstep(reference, candidate, steps=200, seed=7)
    reference.close()
    assert episodes > 20


def test_small_observations_travel_as_frames_where_workers_have_no_shared_step_path(caplog):
    """Workers on the learner's host without the shared step path (no pipes here): the file pays for large ones only."""
    assert 2 * bytes_per_env(gym.make("CartPole-v1").observation_space) < SHARED_OBS_MIN_BYTES
    with caplog.at_level(logging.DEBUG, logger="clusterenv.learner.step_buffers"):
        ClusterEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2, launcher=LocalLauncher(pipes=False)).close()
    assert "observations into shared memory" not in caplog.text


def test_the_shared_file_is_removed_once_workers_have_mapped_it():
    def ours() -> set[str]:  # this process's only: tests running in parallel make their own
        return set(
            glob.glob(f"/dev/shm/clusterenv-obs-{os.getpid()}-*") + glob.glob(f"/tmp/clusterenv-obs-{os.getpid()}-*")
        )

    before = ours()
    with ClusterEnv([functools.partial(ImageEnv, False)] * 4, num_workers=2) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        assert ours() == before


@pytest.fixture
def shared() -> SharedObservations:
    space = ImageEnv(False).observation_space
    return SharedObservations(space, num_envs=4)


def test_a_worker_maps_exactly_its_slice(shared):
    space = ImageEnv(False).observation_space
    view = attach(shared.meta(1, 3), space)
    view[...] = 7
    assert (shared.observations[1:3] == 7).all()
    assert (shared.observations[[0, 3]] == 0).all()
    shared.unlink()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"token": "00" * 16}, id="wrong token"),
        pytest.param({"path": "/nonexistent/observations"}, id="unreachable file"),
        pytest.param({"size": 123}, id="wrong size"),
        pytest.param({"stop": 9}, id="slice out of range"),
    ],
)
def test_a_worker_that_cannot_verify_the_mapping_does_not_use_it(shared, change):
    space = ImageEnv(False).observation_space
    assert attach({**shared.meta(0, 2), **change}, space) is None
    shared.unlink()


def test_a_worker_with_another_observation_space_does_not_map(shared):
    other = gym.spaces.Box(0, 255, (10,), dtype=np.uint8)
    assert attach(shared.meta(0, 2), other) is None
    shared.unlink()
    assert not os.path.exists(shared.path)
