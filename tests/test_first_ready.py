"""First-ready batches (``batch_size``, ``async_reset``/``send``/``recv``): each env's trajectory is exact."""

from __future__ import annotations

import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv, WorkerTimeoutError
from tests.conftest import assert_same
from tests.envs import JitteryRichEnv, SlowCartPole

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def env_row(infos: dict, row: int) -> dict:
    """One env's info out of a batched info dict, keys sorted (batch composition decides their order)."""
    out = {}
    for key in sorted(k for k in infos if not k.startswith("_")):
        value = infos[key]
        if isinstance(value, dict):
            if infos[f"_{key}"][row]:
                out[key] = env_row(value, row)
        elif infos[f"_{key}"][row]:
            out[key] = value[row]
    return out


def env_obs(obs, row: int):
    if isinstance(obs, dict):
        return {key: env_obs(value, row) for key, value in obs.items()}
    if isinstance(obs, tuple):
        return tuple(env_obs(value, row) for value in obs)
    return obs[row]


def alone(env_fn, seed: int, actions: list, mode: AutoresetMode) -> list:
    """What one env stepped alone with ``seed`` and ``actions`` returns, one record per step (reset included)."""
    env = SyncVectorEnv([env_fn], autoreset_mode=mode)
    obs, infos = env.reset(seed=seed)
    records = [(env_obs(obs, 0), 0.0, False, False, env_row(infos, 0))]
    for action in actions:
        obs, rewards, terminations, truncations, infos = env.step(np.asarray([action]))
        records.append(
            (env_obs(obs, 0), float(rewards[0]), bool(terminations[0]), bool(truncations[0]), env_row(infos, 0))
        )
    env.close()
    return records


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("batch_size", [4, 12])
@pytest.mark.parametrize("reorder", [False, True], ids=["as-returned", "reversed-in-place"])
def test_each_env_steps_exactly_as_it_would_alone(mode, batch_size, reorder):
    """``reorder``: the envs are given back in reverse order, written into the very array recv() returned."""
    env_fn = functools.partial(JitteryRichEnv, "discrete")
    num_envs, seed, rounds = 12, 5, 60
    records: list[list] = [[] for _ in range(num_envs)]
    actions: list[list] = [[] for _ in range(num_envs)]
    pickers = [np.random.default_rng(i) for i in range(num_envs)]
    with ClusterEnv([env_fn] * num_envs, num_workers=6, autoreset_mode=mode, batch_size=batch_size) as envs:
        envs.async_reset(seed=seed)
        orders = set()
        for _ in range(rounds):
            obs, rewards, terminations, truncations, infos, env_ids = envs.recv()
            assert len(env_ids) == batch_size
            orders.add(tuple(env_ids.tolist()))
            for row, i in enumerate(env_ids):
                info = env_row(infos, row)
                records[i].append(
                    (env_obs(obs, row), float(rewards[row]), bool(terminations[row]), bool(truncations[row]), info)
                )
            if reorder:
                env_ids[:] = env_ids[::-1].copy()
            chosen = np.array([pickers[i].integers(3) for i in env_ids])
            for row, i in enumerate(env_ids):
                actions[i].append(int(chosen[row]))
            envs.send(chosen, env_ids)
        while True:  # drain what is still in flight
            try:
                obs, rewards, terminations, truncations, infos, env_ids = envs.recv()
            except NoAsyncCallError:
                break
            for row, i in enumerate(env_ids):
                info = env_row(infos, row)
                records[i].append(
                    (env_obs(obs, row), float(rewards[row]), bool(terminations[row]), bool(truncations[row]), info)
                )
    ended = 0
    for i in range(num_envs):
        expected = alone(env_fn, seed + i, actions[i], mode)
        assert len(records[i]) == len(expected) == len(actions[i]) + 1
        for t, (got, want) in enumerate(zip(records[i], expected, strict=True)):
            assert_same(want, got, f"env {i}, step {t}")
        ended += sum(terminated or truncated for _, _, terminated, truncated, _ in records[i])
    assert ended >= 10, "the run must cross episode boundaries to test autoreset"
    if batch_size < num_envs:
        assert len(orders) > 1, "the jitter should have varied which workers were ready first"


def test_recv_returns_the_workers_that_are_ready_first():
    slow, fast = functools.partial(SlowCartPole, 1.5), functools.partial(SlowCartPole, 0.0)
    with ClusterEnv([slow] * 2 + [fast] * 6, num_workers=4, batch_size=2) as envs:
        envs.async_reset(seed=0)
        for env_ids in [envs.recv()[-1] for _ in range(4)]:  # every reset first, then every step
            envs.send(np.zeros(2, dtype=np.int64), env_ids)
        firsts = [envs.recv()[-1].tolist() for _ in range(3)]
        assert [0, 1] not in firsts, "worker 0 sleeps 1.5 s per step; the others are ready long before"
        for ids in firsts:
            envs.send(np.zeros(2, dtype=np.int64), ids)
        for _ in range(4):
            envs.recv()


def test_gymnasium_calls_wait_until_every_env_is_back_and_then_work_again():
    with ClusterEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2, batch_size=2) as envs:
        envs.async_reset(seed=0)
        with pytest.raises(AlreadyPendingCallError, match="in flight from async_reset"):
            envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(AlreadyPendingCallError, match="recv\\(\\) them all first"):
            envs.reset(seed=1)
        first = envs.recv()[-1]
        with pytest.raises(ValueError, match="whose last results recv\\(\\) has not returned yet"):
            envs.send(np.zeros(2, dtype=np.int64), [i for i in range(4) if i not in first])
        for part in first[:1], first[1:]:
            with pytest.raises(ValueError, match="whole workers' envs"):
                envs.send(np.zeros(1, dtype=np.int64), part)
        with pytest.raises(ValueError, match=r"Actions must have shape \(2,\)"):
            envs.send(np.zeros(3, dtype=np.int64), first)
        with pytest.raises(AlreadyPendingCallError, match="Cannot change `batch_size` while envs are in flight"):
            envs.batch_size = 4
        envs.send(np.zeros(2, dtype=np.int64), first)
        with pytest.raises(ValueError, match="whose last results recv\\(\\) has not returned yet"):
            envs.send(np.zeros(2, dtype=np.int64), first)  # the same envs twice
        envs.recv()
        envs.recv()
        with pytest.raises(NoAsyncCallError, match="only 0 are in flight"):
            envs.recv()
        obs, *_ = envs.step(np.zeros(4, dtype=np.int64))  # nothing in flight: Gymnasium's API again
        assert obs.shape == (4, 4)
        with pytest.raises(ValueError, match="multiple of the envs per worker \\(2"):
            envs.batch_size = 3
        envs.batch_size = 4
        envs.async_reset(seed=0)
        assert len(envs.recv()[-1]) == 4


def test_recv_timeout_leaves_the_envs_in_flight():
    with ClusterEnv([functools.partial(SlowCartPole, 0.6)] * 2, num_workers=2) as envs:
        envs.reset(seed=0)
        envs.send(np.zeros(2, dtype=np.int64), [0, 1])
        with pytest.raises(WorkerTimeoutError, match="stay in flight"):
            envs.recv(timeout=0.05)
        obs, rewards, *_, env_ids = envs.recv()
        assert sorted(env_ids.tolist()) == [0, 1] and (rewards == 1.0).all()


def test_bad_first_ready_configuration_is_refused_before_anything_starts():
    fns = [lambda: gym.make("CartPole-v1")] * 6
    with pytest.raises(ValueError, match="must be a multiple of the envs per worker \\(3"):
        ClusterEnv(fns, num_workers=2, batch_size=2)
    with pytest.raises(ValueError, match="do not split evenly over num_workers=4"):
        ClusterEnv(fns, num_workers=4, batch_size=2)
    with pytest.raises(ValueError, match="between 1 and num_envs=6, got 7"):
        ClusterEnv(fns, num_workers=2, batch_size=7)
    with ClusterEnv(fns[:2], num_workers=2, autoreset_mode="Disabled") as envs:
        with pytest.raises(ValueError, match="need an autoreset mode"):
            envs.async_reset(seed=0)
        envs.reset(seed=0)  # still usable


def test_a_worker_lost_in_flight_is_replaced_and_its_episodes_reported_cut():
    fns = [lambda: gym.make("CartPole-v1")] * 4
    with ClusterEnv(fns, num_workers=2, batch_size=2, on_worker_failure="restart") as envs:
        envs.async_reset(seed=0)
        got = [envs.recv()[-1], envs.recv()[-1]]
        os.kill(envs.worker_info[1]["pid"], signal.SIGKILL)
        time.sleep(0.2)
        for ids in got:
            envs.send(np.zeros(2, dtype=np.int64), ids)
        results = {}
        for _ in range(2):
            obs, rewards, terminations, truncations, infos, env_ids = envs.recv()
            results[tuple(env_ids.tolist())] = (rewards, truncations, infos)
        rewards, truncations, infos = results[(2, 3)]
        assert truncations.all() and (rewards == 0).all() and infos["worker_restarted"].all()
        rewards, truncations, infos = results[(0, 1)]
        assert not truncations.any() and (rewards == 1).all() and "worker_restarted" not in infos


class SlowResetCartPole(gym.Wrapper):
    """CartPole whose reset takes 0.5 s: long enough to lose its worker in the middle of one."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def reset(self, **kwargs):
        time.sleep(0.5)
        return self.env.reset(**kwargs)


def test_a_worker_lost_during_async_reset_has_its_seeded_reset_replayed():
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    expected, _ = reference.reset(seed=3)
    reference.close()
    with ClusterEnv([SlowResetCartPole] * 4, num_workers=2, batch_size=2, on_worker_failure="restart") as envs:
        envs.async_reset(seed=3)
        os.kill(envs.worker_info[1]["pid"], signal.SIGKILL)
        seen = []
        for _ in range(2):
            obs, _, _, truncations, infos, env_ids = envs.recv()
            np.testing.assert_array_equal(obs, expected[env_ids])
            assert not truncations.any() and "worker_restarted" not in infos
            seen += env_ids.tolist()
        assert sorted(seen) == [0, 1, 2, 3]


@pytest.mark.parametrize("on_worker_failure", ["restart", "rehome"])
def test_a_worker_lost_while_its_envs_are_in_the_callers_hands_reports_their_cut_at_the_next_send(on_worker_failure):
    fns = [lambda: gym.make("CartPole-v1")] * 6
    with ClusterEnv(fns, num_workers=3, batch_size=2, on_worker_failure=on_worker_failure) as envs:
        envs.async_reset(seed=0)
        held = {tuple(envs.recv()[-1].tolist()) for _ in range(3)}
        for ids in held - {(4, 5)}:
            envs.send(np.zeros(2, dtype=np.int64), np.array(ids))
        pid = envs.worker_info[2]["pid"]
        os.kill(pid, signal.SIGKILL)  # worker 2 is idle: its envs are with the caller
        deadline = time.monotonic() + 10
        while envs.worker_info[2]["pid"] == pid and envs.worker_info[2]["state"] == "active":
            assert time.monotonic() < deadline, "the loss of an idle worker went unnoticed"
            *_, env_ids = envs.recv()  # the other workers keep stepping meanwhile
            envs.send(np.zeros(2, dtype=np.int64), env_ids)
        envs.send(np.zeros(2, dtype=np.int64), np.array([4, 5]))
        # The other workers' envs may come back many times first: the process that now carries
        # envs 4 and 5 can be descheduled for a while on a busy machine.
        deadline = time.monotonic() + 10
        while True:
            _, rewards, _, truncations, infos, env_ids = envs.recv()
            if env_ids.tolist() == [4, 5] or time.monotonic() > deadline:
                break
            envs.send(np.zeros(2, dtype=np.int64), env_ids)
        assert env_ids.tolist() == [4, 5]
        assert truncations.all() and (rewards == 0).all() and infos["worker_restarted"].all()
