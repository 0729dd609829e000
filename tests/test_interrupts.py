"""Ctrl-C anywhere in a step leaves it to ``step_wait()``, which returns exactly what the uninterrupted step would.

Notebook users interrupt cells. A ``KeyboardInterrupt`` is raised here at each point of a
lockstep step, on both paths (before anything is sent, between two workers' commands, after
every command, with none, one or all replies taken), and the step is then finished by
``step_wait()`` and compared with ``SyncVectorEnv``; the run goes on exactly after it.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import closing
from typing import Any
from unittest import mock

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import NoAsyncCallError
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv
from clusterenv.learner.outbox import Outbox
from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import WorkerPool
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.wire.transport import Channel
from tests.conftest import assert_same, wait_until

CARTPOLES = [functools.partial(gym.make, "CartPole-v1")] * 4
PATHS = {"shared memory": {}, "messages": {"shared_memory": False}}


@contextlib.contextmanager
def interrupt_at(owner: type, method: str, call: int, after: bool, counts: Any = None) -> Iterator[None]:
    """Raise ``KeyboardInterrupt`` at the ``call``-th call of ``owner.method``: before it runs, or just after.

    ``counts``: with ``after``, only calls whose result it accepts count.
    """
    original = getattr(owner, method)
    calls = 0

    def interrupted(*args, **kwargs):
        nonlocal calls
        if not after:
            calls += 1
            if calls == call:
                raise KeyboardInterrupt
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        if counts is None or counts(result):
            calls += 1
            if calls == call:
                raise KeyboardInterrupt
        return result

    with mock.patch.object(owner, method, interrupted):
        yield


# (where, what is patched): the points of a step, in the order a step reaches them.
SHARED_POINTS = {
    "before any command": (SharedSteps, "_write_command", 1, False),
    "after the first command": (SharedSteps, "_write_command", 1, True),
    "after every command": (SharedSteps, "_write_command", 2, True),
    "before any wake-up": (SharedSteps, "_wake_if_waiting", 1, False),
}


# A lockstep step() reads every reply from the words before it takes any; step_wait() takes each as it comes.
def _answered(status: int | None) -> bool:
    return status is not None  # a worker's final status read: its reply is in its rows


LOCKSTEP_POINTS = {
    "one reply read": (SharedSteps, "final_status", 1, True, _answered),
    "every reply read": (SharedSteps, "final_status", 2, True, _answered),
}
TAKEN_POINTS = {
    "one reply taken": (WorkerPool, "_note_reply", 1, True),
    "every reply taken": (WorkerPool, "_note_reply", 2, True),
}
MESSAGE_POINTS = {
    "before any command": (Channel, "send_frames", 1, False),
    "after the first command": (Channel, "send_frames", 1, True),
    "after every command": (Channel, "send_frames", 2, True),
    **TAKEN_POINTS,
}
POINTS = {
    ("shared memory", "step"): {**SHARED_POINTS, **LOCKSTEP_POINTS},
    ("shared memory", "step_async"): {**SHARED_POINTS, **TAKEN_POINTS},
    ("messages", "step"): MESSAGE_POINTS,
    ("messages", "step_async"): MESSAGE_POINTS,
}
CASES = [
    pytest.param(path, how, *point, *[None] * (5 - len(point)), id=f"{how}-{path}: {where}")  # counts: every call
    for (path, how), points in POINTS.items()
    for where, point in points.items()
]


def step_both(reference: SyncVectorEnv, envs: ClusterEnv, actions: np.ndarray) -> None:
    assert_same(reference.step(actions), envs.step(actions))


@pytest.mark.parametrize("path, how, owner, method, call, after, counts", CASES)
def test_a_step_interrupted_anywhere_is_finished_exactly_by_step_wait(path, how, owner, method, call, after, counts):
    with (
        ClusterEnv(CARTPOLES, num_workers=2, **PATHS[path]) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=4), envs.reset(seed=4))
        for t in range(3):
            step_both(reference, envs, np.array([t % 2, 1, 0, 1]))
        actions = np.array([1, 0, 0, 1])
        with interrupt_at(owner, method, call, after, counts), pytest.raises(KeyboardInterrupt):
            if how == "step":
                envs.step(actions)
            else:
                envs.step_async(actions)
                envs.step_wait()
        assert_same(reference.step(actions), envs.step_wait())
        for t in range(20):  # every env steps once per step from here on: nothing was lost or done twice
            step_both(reference, envs, np.array([1, t % 2, 1, 0]))


@pytest.mark.parametrize("how", ["step", "step_async"])
@pytest.mark.parametrize("path", PATHS)
def test_an_interrupt_before_the_learners_own_envs_step_leaves_them_to_step_wait(path, how):
    """The workers were commanded, the learner's own envs had not stepped yet: step_wait() steps them too."""
    with (
        ClusterEnv(CARTPOLES, num_workers=1, learner_envs=2, **PATHS[path]) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=5), envs.reset(seed=5))
        step_both(reference, envs, np.array([0, 1, 1, 0]))
        actions = np.array([1, 1, 0, 0])
        with interrupt_at(LearnerEnvs, "run", 1, False), pytest.raises(KeyboardInterrupt):
            if how == "step":
                envs.step(actions)
            else:
                envs.step_async(actions)
        assert_same(reference.step(actions), envs.step_wait())
        for t in range(10):
            step_both(reference, envs, np.array([t % 2, 0, 1, 1]))


def test_a_step_interrupted_before_it_was_pending_leaves_nothing_for_a_reset_that_spares_the_learners_envs():
    with (
        ClusterEnv(CARTPOLES, num_workers=1, learner_envs=2) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=2), envs.reset(seed=2))
        step_both(reference, envs, np.array([0, 1, 1, 0]))
        with interrupt_at(Outbox, "record_shared", 1, True), pytest.raises(KeyboardInterrupt):
            envs.step(np.array([1, 1, 1, 1]))
        workers_only = {"reset_mask": np.array([False, False, True, True])}
        assert_same(reference.reset(options=dict(workers_only)), envs.reset(options=dict(workers_only)))
        for t in range(10):  # the learner's envs did not take the interrupted step either
            step_both(reference, envs, np.array([t % 2, 1, 0, 0]))


def test_an_interrupt_before_a_lockstep_step_is_pending_leaves_nothing_sent():
    """Recorded but not yet pending: no worker was commanded, so there is nothing to wait for, and no step happened."""
    with (
        ClusterEnv(CARTPOLES, num_workers=2) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=8), envs.reset(seed=8))
        step_both(reference, envs, np.array([0, 1, 1, 0]))
        with interrupt_at(Outbox, "record_shared", 1, True), pytest.raises(KeyboardInterrupt):
            envs.step(np.array([1, 1, 1, 1]))
        with pytest.raises(NoAsyncCallError):
            envs.step_wait()
        for t in range(10):  # the interrupted step never happened
            step_both(reference, envs, np.array([t % 2, 1, 0, 0]))


@pytest.mark.parametrize("path", PATHS)
def test_a_reset_interrupted_while_sending_is_finished_by_reset_wait(path):
    with (
        ClusterEnv(CARTPOLES, num_workers=2, **PATHS[path]) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        envs.reset(seed=0)
        with interrupt_at(Channel, "send_frames", 1, True), pytest.raises(KeyboardInterrupt):
            envs.reset(seed=9)
        assert_same(reference.reset(seed=9), envs.reset_wait())
        step_both(reference, envs, np.array([0, 1, 1, 0]))


@pytest.mark.parametrize("path", PATHS)
def test_ctrl_c_while_waiting_for_a_frozen_worker_keeps_the_reply_already_taken(path):
    """The reported case: the fast worker's reply is taken, then Ctrl-C lands while the learner waits for the other."""
    with (
        ClusterEnv(CARTPOLES, num_workers=2, **PATHS[path]) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=6), envs.reset(seed=6))
        slow = envs.worker_info[1]["pid"]
        os.kill(slow, signal.SIGSTOP)
        taken: list[int] = []
        note_reply = WorkerPool._note_reply

        def noting(pool, worker_id, msg):
            taken.append(worker_id)
            return note_reply(pool, worker_id, msg)

        interrupt = threading.Thread(target=lambda: wait_until(lambda: taken, 10) and _thread.interrupt_main())
        try:
            with mock.patch.object(WorkerPool, "_note_reply", noting), pytest.raises(KeyboardInterrupt):
                interrupt.start()
                envs.step(np.array([0, 1, 1, 0]))
            interrupt.join()
            assert taken == [0]
        finally:
            os.kill(slow, signal.SIGCONT)
        assert_same(reference.step(np.array([0, 1, 1, 0])), envs.step_wait(timeout=10))
        step_both(reference, envs, np.array([1, 1, 0, 0]))
