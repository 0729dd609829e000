"""``on_env_error="reset"``: an env that raises ends only its own episode, is flagged once, and is rebuilt."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv, EveryUpdate, PolicyRunner, RemoteEnvError
from tests.envs import FlakyCartPole, failing_factory

FLAKY = [0, 3, 5]  # which of the 8 envs raise now and then; the others are plain CartPoles
NUM_ENVS = 8


def env_fns(log: Path, probability: float = 0.01) -> list:
    flaky = functools.partial(FlakyCartPole, str(log), probability)
    return [flaky if i in FLAKY else functools.partial(gym.make, "CartPole-v1") for i in range(NUM_ENVS)]


def raised(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def reported(infos: dict) -> list[str]:
    """The messages of the errors flagged in one step's infos (under SAME_STEP, in the ended step's ``final_info``)."""
    found = []
    for where in (infos, infos.get("final_info", {})):
        if "_env_error" in where:
            messages, flags = where["env_error"]["message"], where["_env_error"]
            found += [str(m) for m, flagged in zip(messages, flags, strict=True) if flagged]
    return found


def flagged_envs(infos: dict) -> np.ndarray:
    """The envs whose step an error ended."""
    where = infos.get("final_info", {}) if "_env_error" not in infos else infos
    return np.flatnonzero(where.get("_env_error", np.zeros(NUM_ENVS, bool)))


@pytest.mark.parametrize("autoreset_mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.name)
@pytest.mark.parametrize("procs_per_worker", [1, 2])
def test_every_error_is_flagged_once_and_no_other_env_is_touched(tmp_path, autoreset_mode, procs_per_worker):
    log = tmp_path / "raised.txt"
    stable = [i for i in range(NUM_ENVS) if i not in FLAKY]
    with (
        ClusterEnv(
            env_fns(log),
            num_workers=2,
            procs_per_worker=procs_per_worker,
            autoreset_mode=autoreset_mode,
            on_env_error="reset",
            max_env_errors=100,
        ) as envs,
        closing(
            SyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * len(stable), autoreset_mode=autoreset_mode)
        ) as reference,
    ):
        obs, _ = envs.reset(seed=7)
        expected, _ = reference.reset(seed=[7 + i for i in stable])
        np.testing.assert_array_equal(obs[stable], expected)
        rng = np.random.default_rng(0)
        messages = []
        for _ in range(5000):
            actions = rng.integers(0, 2, NUM_ENVS)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            want = reference.step(actions[stable])
            for got, wanted in zip((obs, rewards, terminations, truncations), want[:4], strict=True):
                np.testing.assert_array_equal(got[stable], wanted)
            flagged = flagged_envs(infos)
            if len(flagged):
                assert set(flagged) <= set(FLAKY)
                assert truncations[flagged].all() and not terminations[flagged].any() and (rewards[flagged] == 0).all()
                messages += reported(infos)
    assert len(messages) > 50, "the flaky envs should have raised dozens of times"
    assert sorted(messages) == sorted(raised(log))  # each error reported, and once


def test_first_ready_batches_flag_every_error_once(tmp_path):
    log = tmp_path / "raised.txt"
    messages = []
    with ClusterEnv(env_fns(log), num_workers=4, batch_size=4, on_env_error="reset", max_env_errors=100) as envs:
        envs.async_reset(seed=3)
        for _ in range(1500):
            *_, infos, env_ids = envs.recv()
            messages += reported(infos)
            envs.send(np.ones(len(env_ids), np.int64), env_ids)
        for _ in range(NUM_ENVS // envs.batch_size):  # every env is in flight: take them back
            *_, infos, _ = envs.recv()
            messages += reported(infos)
    assert messages and sorted(messages) == sorted(raised(log))


@contextlib.contextmanager
def flaky_runner(log: Path, prefetch: int) -> Iterator[PolicyRunner]:
    """A runner of local policies over the flaky envs; errors in 2% of steps."""
    with ClusterEnv(env_fns(log, probability=0.02), num_workers=2, on_env_error="reset", max_env_errors=100) as envs:
        envs.reset(seed=1)
        yield PolicyRunner(envs, torch.nn.Linear(4, 2), EveryUpdate(), seed=0, prefetch=prefetch)


def test_rollouts_flag_every_error_once(tmp_path):
    log = tmp_path / "raised.txt"
    messages = []
    with flaky_runner(log, prefetch=0) as runner:
        for _ in range(10):
            batch = runner.rollout(64)
            for infos, truncated in zip(batch.infos, batch.truncations, strict=True):
                messages += reported(infos)
                if "_env_error" in infos:
                    assert truncated[infos["_env_error"]].all()
    assert messages and sorted(messages) == sorted(raised(log))


def test_prefetched_rollouts_flag_every_error_once(tmp_path):
    log = tmp_path / "raised.txt"
    messages = []
    with flaky_runner(log, prefetch=1) as runner:
        batches = [runner.rollout(64) for _ in range(10)]
        batches += runner.stop()  # the rollouts collected ahead: every step the workers took
    for batch in batches:
        for infos in batch.infos:
            messages += reported(infos)
    assert messages and sorted(messages) == sorted(raised(log))


def test_an_env_past_its_error_bound_raises_as_without_reset(tmp_path):
    log = tmp_path / "raised.txt"
    envs = ClusterEnv(env_fns(log, probability=0.2), num_workers=2, on_env_error="reset", max_env_errors=3)
    envs.reset(seed=0)
    with pytest.raises(RemoteEnvError, match=r"raised RuntimeError while stepping: flaky error") as caught:
        for _ in range(500):
            envs.step(np.zeros(NUM_ENVS, np.int64))
    assert isinstance(caught.value, RuntimeError) and "Remote traceback" in str(caught.value)
    assert envs.closed


def test_a_factory_that_keeps_failing_is_a_clear_error(tmp_path):
    envs = ClusterEnv([functools.partial(failing_factory, str(tmp_path / "made.txt"))], on_env_error="reset")
    envs.reset(seed=0)
    *_, truncations, infos = envs.step(np.zeros(1, np.int64))  # the env raises, its episode ends
    assert truncations[0] and infos["_env_error"][0]
    expected = "The env's factory raised 3 times in a row while the env was rebuilt after an error"
    with pytest.raises(RemoteEnvError, match=re.escape(expected) + r".*licence server is down"):
        envs.step(np.zeros(1, np.int64))  # the autoreset rebuilds it


def test_the_settings_are_checked():
    fns = [functools.partial(gym.make, "CartPole-v1")]
    with pytest.raises(ValueError, match=r"`on_env_error` must be 'raise' or 'reset', got 'ignore'"):
        ClusterEnv(fns, on_env_error="ignore")
    with pytest.raises(ValueError, match=r"`max_env_errors` must be at least 0, got -1"):
        ClusterEnv(fns, on_env_error="reset", max_env_errors=-1)
