"""``procs_per_worker``: a worker steps its slice in env processes of its own, one ZeroMQ peer per host.

Results are pinned bit-identical to SyncVectorEnv in tests/test_equivalence.py (and, through the
backends they run, test_api.py, test_shared_obs.py, test_rollout.py); this file pins the processes:
how many, that they work in parallel, that none outlives its worker, and what their failures become.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import time
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv, RemoteEnvError, WorkerLostError
from clusterenv.wire.liveness import Heartbeat
from clusterenv.worker.env_processes import ENV_PROCESS_LOST_EXIT_CODE
from tests.conftest import assert_same, child_pids, pid_alive, wait_until
from tests.envs import BrokenInitEnv, FailingEnv, FailingResetEnv, SlowEnv
from tests.test_remote import SECRET, free_address, run_lockstep, spawn, worker_command  # noqa: F401 (fixture)

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
FAST = Heartbeat(interval=0.1, liveness=10)  # a silent worker is lost after 1 s


def env_processes(worker_pid: int) -> set[int]:
    """The live children of a worker process, as ``pgrep -P`` lists them."""
    found = subprocess.run(["pgrep", "-P", str(worker_pid)], capture_output=True, text=True, check=False)
    return {int(pid) for pid in found.stdout.split() if pid_alive(int(pid))}


def worker_pids(envs: ClusterEnv) -> list[int]:
    return [info["pid"] for info in envs.worker_info]


def all_gone(pids: set[int], timeout: float = 10.0) -> bool:
    return wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=timeout)


# -- the processes -------------------------------------------------------------------------------
def test_each_worker_runs_min_procs_slice_env_processes_and_close_ends_them():
    envs = ClusterEnv([CARTPOLE] * 5, num_workers=2, procs_per_worker=3)  # slices of 2 and 3 envs
    workers = worker_pids(envs)
    children = [env_processes(pid) for pid in workers]
    assert [len(c) for c in children] == [2, 3]
    assert repr(envs) == "ClusterEnv(num_envs=5, num_workers=2, procs_per_worker=3)"
    envs.close()
    assert all_gone(set(workers).union(*children))


def test_env_processes_step_in_parallel_while_the_worker_keeps_beating():
    # Each step sleeps 1 s: four env processes take one sleep, not four, and the worker's
    # heartbeat (lost after 0.5 s of silence) goes on while it waits for them.
    heartbeat = Heartbeat(interval=0.1, liveness=5)
    with ClusterEnv(
        [functools.partial(SlowEnv, 1.0)] * 4, num_workers=1, procs_per_worker=4, heartbeat=heartbeat
    ) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            started = time.monotonic()
            envs.step(np.zeros(4, dtype=np.int64))
            assert time.monotonic() - started < 3.0


def test_a_killed_worker_takes_its_env_processes_with_it_even_mid_step():
    envs = ClusterEnv([functools.partial(SlowEnv, 60.0)] * 4, num_workers=2, procs_per_worker=2, timeout=60)
    try:
        envs.reset(seed=0)
        victim = worker_pids(envs)[0]
        orphans = env_processes(victim)
        assert len(orphans) == 2
        envs.step_async(np.zeros(4, dtype=np.int64))
        time.sleep(0.3)  # the env processes are inside their 60 s step, reading nothing
        os.kill(victim, signal.SIGKILL)
        assert all_gone(orphans, timeout=5)
        with pytest.raises(WorkerLostError, match=r"^worker 0 \(pid \d+\), running envs 0\.\.1, exited with code -9"):
            envs.step_wait()
    finally:
        envs.close(terminate=True)


def test_close_ends_env_processes_stuck_in_a_step():
    envs = ClusterEnv([functools.partial(SlowEnv, 60.0)] * 2, num_workers=1, procs_per_worker=2)
    children = env_processes(worker_pids(envs)[0])
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    started = time.monotonic()
    with pytest.warns(UserWarning, match="Calling `close` while waiting for a pending call to `step` to complete."):
        envs.close(timeout=1.0)
    assert time.monotonic() - started < 5
    assert all_gone(children, timeout=5)


# -- failures ------------------------------------------------------------------------------------
FAILURES = {
    "step, env 3 on worker 1": ([5, 5, 5, 2], FailingEnv, "step", 3, 1),
    "reset, env 2 on worker 1": ([5, 5, 2, 5], FailingResetEnv, "reset", 2, 1),
}


@pytest.mark.parametrize(("fail_at", "env_cls", "where", "env_index", "worker_id"), FAILURES.values(), ids=FAILURES)
def test_env_error_in_an_env_process_is_a_remote_env_error_with_its_traceback(
    fail_at, env_cls, where, env_index, worker_id
):
    envs = ClusterEnv([functools.partial(env_cls, n) for n in fail_at], num_workers=2, procs_per_worker=2)
    processes = set(worker_pids(envs)).union(*(env_processes(pid) for pid in worker_pids(envs)))
    envs.reset(seed=0)
    with pytest.raises(RemoteEnvError) as caught:
        for _ in range(3):
            if where == "step":
                envs.step(np.zeros(4, dtype=np.int64))
            else:
                envs.reset()
    error = caught.value
    exc_type = "ValueError" if where == "step" else "KeyError"
    doing = "stepping" if where == "step" else "resetting"
    assert (error.env_index, error.worker_id, error.exc_type) == (env_index, worker_id, exc_type)
    assert str(error).startswith(f"env {env_index} on worker {worker_id} raised {exc_type} while {doing}: ")
    assert "Remote traceback:\nTraceback (most recent call last):" in str(error)
    assert f"in {where}" in error.remote_traceback and "tests/envs.py" in error.remote_traceback
    assert type(error.__cause__).__name__ == exc_type
    assert envs.closed
    assert all_gone(processes)


def test_env_constructor_that_raises_in_an_env_process_leaks_nothing():
    before = child_pids()
    with pytest.raises(RemoteEnvError) as caught:
        ClusterEnv([CARTPOLE, CARTPOLE, CARTPOLE, BrokenInitEnv], num_workers=2, procs_per_worker=2)
    error = caught.value
    assert (error.env_index, error.worker_id, error.exc_type) == (3, 1, "RuntimeError")
    assert str(error).startswith("env 3 on worker 1 raised RuntimeError while building envs: cannot build this env")
    assert 'raise RuntimeError("cannot build this env")' in error.remote_traceback
    assert wait_until(lambda: child_pids() == before, timeout=10)


def test_a_dead_env_process_makes_its_worker_lost():
    envs = ClusterEnv([CARTPOLE] * 4, num_workers=2, procs_per_worker=2, heartbeat=FAST)
    try:
        envs.reset(seed=0)
        worker = worker_pids(envs)[1]
        siblings = env_processes(worker)
        victim = min(siblings)
        os.kill(victim, signal.SIGKILL)
        expected = f"worker 1 (pid {worker}), running envs 2..3, exited with code {ENV_PROCESS_LOST_EXIT_CODE}"
        with pytest.raises(WorkerLostError, match=re.escape(expected)):
            envs.step(np.zeros(4, dtype=np.int64))
        assert all_gone(siblings | {worker})
    finally:
        envs.close()


def test_a_dead_env_process_is_replaced_with_its_worker_under_restart():
    mode = AutoresetMode.NEXT_STEP  # the replacement's envs start with an autoreset step
    actions = [np.array([t % 2] * 4) for t in range(8)]
    with (
        ClusterEnv(
            [CARTPOLE] * 4,
            num_workers=2,
            procs_per_worker=2,
            autoreset_mode=mode,
            on_worker_failure="restart",
            heartbeat=FAST,
        ) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4, autoreset_mode=mode)) as reference,
    ):
        assert_same(envs.reset(seed=3), reference.reset(seed=3))
        old = worker_pids(envs)[1]
        os.kill(min(env_processes(old)), signal.SIGKILL)
        obs, rewards, terminations, truncations, infos = envs.step(actions[0])
        expected = reference.step(actions[0])
        assert_same(obs[:2], expected[0][:2])
        assert truncations[2:].all() and infos["worker_restarted"].tolist() == [False, False, True, True]
        new = worker_pids(envs)[1]
        assert new != old and len(env_processes(new)) == 2
        rewards = envs.step(actions[1])[1]
        assert rewards[2:].tolist() == [0.0, 0.0]  # the autoreset step
        assert envs.step(actions[2])[1][2:].tolist() == [1.0, 1.0]


# -- external workers choose their own count ------------------------------------------------------
def test_clusterenv_worker_procs_overrides_the_learners_count(spawn):  # noqa: F811 (the fixture)
    address = free_address()
    worker = spawn(worker_command(address, "--procs", "2"))
    with (
        ClusterEnv(
            [CARTPOLE] * 4, num_workers=1, bind=address, secret=SECRET, launcher="external", heartbeat=FAST
        ) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert envs.procs_per_worker == 1
        assert len(env_processes(worker.pid)) == 2
        run_lockstep(envs, reference, steps=30)
    assert worker.wait(timeout=10) == 0


def test_clusterenv_worker_refuses_procs_below_one(spawn):  # noqa: F811 (the fixture)
    worker = spawn(worker_command(free_address(), "--procs", "0"))
    assert worker.wait(timeout=30) == 2
    assert "argument --procs: must be at least 1, got 0" in worker.stderr.read()
