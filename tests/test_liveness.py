"""Busy is not dead: a worker or learner that holds the GIL keeps its workers; a frozen one is lost.

Liveness is judged by libzmq's own heartbeats (ZMTP PING/PONG), which its I/O threads answer
without the GIL, so env code or learner code that starves a heartbeat thread no longer looks
like a dead process. A frozen (``SIGSTOP``) process answers nothing and is still found.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
import zmq
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, WorkerLostError
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import assert_same, pid_alive, wait_until
from tests.envs import BusyEnv, hold_gil

FAST = Heartbeat(interval=0.1, liveness=10, reconnect_initial=0.1, reconnect_max=0.2, max_reconnects=1)
BUSY_S = 3 * FAST.expiry  # a step that starves the heartbeat thread for 3 s; a silent worker expires after 1 s
CARTPOLE = functools.partial(gym.make, "CartPole-v1")
HOW = {"pure-Python loop": "python", "C call holding the GIL": "c"}


@pytest.mark.parametrize("how", HOW.values(), ids=HOW)
def test_worker_busy_for_longer_than_the_expiry_is_not_lost(how):
    fns = [CARTPOLE, functools.partial(BusyEnv, BUSY_S, how)]
    with (
        ClusterEnv(fns, num_workers=2, heartbeat=FAST, timeout=60) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 2)) as reference,
    ):
        assert_same(envs.reset(seed=3), reference.reset(seed=3))
        pids = [info["pid"] for info in envs.worker_info]
        for t in range(2):
            actions = np.array([t % 2, 1 - t % 2])
            started = time.monotonic()
            result = envs.step(actions)
            assert time.monotonic() - started >= BUSY_S
            assert_same(result, reference.step(actions))
        assert [info["pid"] for info in envs.worker_info] == pids


def test_worker_frozen_while_busy_is_lost_within_the_expiry(tmp_path):
    started = tmp_path / "stepping"
    fns = [CARTPOLE, functools.partial(BusyEnv, 60.0, "c", str(started))]
    with ClusterEnv(fns, num_workers=2, heartbeat=FAST, timeout=120) as envs:
        envs.reset(seed=0)
        pid = envs.worker_info[1]["pid"]
        envs.step_async(np.array([0, 0]))
        try:
            assert wait_until(started.exists, timeout=30), "the worker never entered its step"
            time.sleep(2 * FAST.expiry)  # busy, and past the expiry: still a worker
            os.kill(pid, signal.SIGSTOP)
            frozen = time.monotonic()
            with pytest.raises(WorkerLostError, match=r"running envs 1\.\.1, stopped answering heartbeats"):
                envs.step_wait()
            elapsed = time.monotonic() - frozen
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert elapsed < FAST.expiry + 5.0, f"detected after {elapsed:.1f} s"
        assert envs.closed


def test_learner_busy_for_longer_than_its_workers_patience_keeps_them():
    # Silent for (1 + max_reconnects) * expiry plus the backoff (about 2.1 s) used to make a worker give up.
    with (
        ClusterEnv([CARTPOLE] * 2, num_workers=2, heartbeat=FAST) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 2)) as reference,
    ):
        assert_same(envs.reset(seed=4), reference.reset(seed=4))
        pids = [info["pid"] for info in envs.worker_info]
        hold_gil(4 * FAST.expiry)
        actions = np.array([1, 0])
        assert_same(envs.step(actions), reference.step(actions))
        assert all(pid_alive(pid) for pid in pids)
        assert [info["pid"] for info in envs.worker_info] == pids


def test_busy_timeout_bounds_how_long_a_connected_worker_may_starve_its_heartbeats():
    heartbeat = Heartbeat(interval=0.1, liveness=10, busy_timeout=3.0)
    fns = [CARTPOLE, functools.partial(BusyEnv, 60.0, "c")]
    with ClusterEnv(fns, num_workers=2, heartbeat=heartbeat, timeout=120) as envs:
        envs.reset(seed=0)
        started = time.monotonic()
        with pytest.raises(
            WorkerLostError, match=r"although its connection is alive: busy for longer than busy_timeout=3\.0 s"
        ):
            envs.step(np.array([0, 0]))
        elapsed = time.monotonic() - started
        assert 2.5 < elapsed < heartbeat.busy_timeout + 5.0, f"lost after {elapsed:.1f} s"
        assert envs.closed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"busy_timeout": 0}, "`Heartbeat.busy_timeout` must be a positive number of seconds or None, got 0."),
        ({"interval": -1.0}, "`Heartbeat.interval` must be a positive number of seconds, got -1.0."),
        ({"liveness": 0}, "`Heartbeat.liveness` must be a positive integer, got 0."),
    ],
)
def test_heartbeat_constants_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Heartbeat(**kwargs)
    assert Heartbeat(busy_timeout=None).busy_timeout is None


def test_zmtp_heartbeats_follow_the_constants():
    assert Heartbeat(interval=0.5, liveness=4).zmtp_options() == {
        zmq.HEARTBEAT_IVL: 500,
        zmq.HEARTBEAT_TIMEOUT: 2000,
        zmq.HEARTBEAT_TTL: 2000,
    }
