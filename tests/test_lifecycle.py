"""Workers never outlive their use: deaths and timeouts are reported promptly, and close() always returns.

Decision pinned here: a ``WorkerTimeoutError`` closes the ClusterEnv (its workers are killed), because a
worker that missed its deadline is still busy with a step whose result nobody will read, so its envs
are in an unknown state. Build a new env, with a larger ``timeout`` if the environments are this slow.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ClosedEnvironmentError

from clusterenv import ClusterEnv, ClusterEnvError, RemoteEnvError, WorkerLostError, WorkerTimeoutError
from clusterenv.wire.cleanup import remove_stale_dirs, scratch_dir, shared_memory_base
from tests.conftest import child_pids, pid_alive, wait_until
from tests.envs import FailingEnv, SlowEnv, StuckEnv

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
ACTIONS = np.zeros(4, dtype=np.int64)


def start(env_fns, **kwargs) -> tuple[ClusterEnv, set[int]]:
    """A ClusterEnv and the pids of its worker processes."""
    before = child_pids()
    envs = ClusterEnv(env_fns, **kwargs)
    return envs, child_pids() - before


def all_gone(pids: set[int], timeout: float = 10.0) -> bool:
    return wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=timeout)


# -- a worker dies ---------------------------------------------------------------------------
def test_worker_killed_between_steps_raises_worker_lost():
    envs, pids = start([CARTPOLE] * 4, num_workers=2, timeout=30)
    try:
        envs.reset(seed=0)
        envs.step(ACTIONS)
        victim = max(pids)
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(victim), timeout=5)
        started = time.monotonic()
        with pytest.raises(
            WorkerLostError, match=r"^worker \d \(pid \d+\), running envs \d\.\.\d, exited with code -9"
        ):
            for _ in range(100):
                envs.step(ACTIONS)
        assert time.monotonic() - started < 10, "death must be noticed well within `timeout`"
        assert envs.closed
    finally:
        envs.close()
    assert all_gone(pids)


def test_worker_killed_while_learner_waits_raises_within_timeout():
    timeout = 20.0
    envs, pids = start([functools.partial(SlowEnv, 1.0)] * 2, num_workers=2, timeout=timeout)
    try:
        envs.reset(seed=0)
        victim = min(pids)
        killer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))
        started = time.monotonic()
        killer.start()
        try:
            with pytest.raises(WorkerLostError, match=r"exited with code -9 while stepping\.$"):
                envs.step(np.zeros(2, dtype=np.int64))
        finally:
            killer.join()
        elapsed = time.monotonic() - started
        assert elapsed < timeout / 2, f"took {elapsed:.1f} s to notice a dead worker"
        with pytest.raises(ClosedEnvironmentError):
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()
    assert all_gone(pids)


def test_learner_killed_with_sigkill_takes_its_workers_with_it(tmp_path):
    """No worker outlives the learner: they notice the parent is gone, remove its scratch directories, and exit."""
    script = textwrap.dedent(
        """
        import sys
        import gymnasium as gym
        import numpy as np
        from clusterenv import ClusterEnv
        from tests.conftest import child_pids

        envs = ClusterEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2)
        envs.reset(seed=0)
        print(" ".join(map(str, sorted(child_pids()))), flush=True)
        while True:
            envs.step(np.zeros(4, dtype=np.int64))
        """
    )
    learner = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        assert learner.stdout is not None
        line = learner.stdout.readline()  # bounded by the test timeout
        workers = {int(pid) for pid in line.split()}
        assert len(workers) == 2, f"expected two worker pids, got {line!r}"
        assert all(pid_alive(pid) for pid in workers)
        assert scratch_dirs_of(learner.pid), "the learner's ipc directories are named after its pid"
        learner.send_signal(signal.SIGKILL)
        assert all_gone(workers, timeout=10), (
            f"workers {sorted(p for p in workers if pid_alive(p))} outlived the learner"
        )
        assert not scratch_dirs_of(learner.pid), "the workers remove their dead learner's directories"
        learner.wait(timeout=10)
    finally:
        learner.kill()
        learner.wait()
        learner.stdout.close()


LEARNER_MID_STEP = textwrap.dedent(
    """
    import functools, json, sys, time
    import numpy as np
    from clusterenv import ClusterEnv
    from clusterenv.wire.liveness import Heartbeat
    from tests.envs import StuckEnv

    started, bind, launcher = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    envs = ClusterEnv(
        [functools.partial(StuckEnv, 600.0, started)] * 2,
        num_workers=1,
        heartbeat=Heartbeat(interval=0.2, liveness=15),
        bind=bind,
        launcher=launcher,
        secret="{secret}",
        timeout=None,
    )
    envs.reset(seed=0)
    print(json.dumps({{"worker": envs.worker_info[0]["pid"], "helpers": envs.get_attr("helper_pid")}}), flush=True)
    envs.step_async(np.zeros(2, dtype=np.int64))
    time.sleep(600)
    """
)
MID_STEP_EXPIRY = 3.0  # Heartbeat(interval=0.2, liveness=15)
SECRET = "a-test-secret-of-32-characters!!"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scratch_dirs_of(pid: int) -> set[str]:
    """A learner's ipc directories, and its shared observation files (``/dev/shm``)."""
    bases = {tempfile.gettempdir(), shared_memory_base() or tempfile.gettempdir()}
    patterns = [f"clusterenv-{pid}-*", f"clusterenv-*-{pid}-*"]  # without and with a kind ("obs")
    return {path for base in bases for pattern in patterns for path in glob.glob(os.path.join(base, pattern))}


@pytest.mark.parametrize("launcher", ["local", "external"])
def test_learner_killed_mid_step_ends_its_worker_within_the_heartbeat_expiry(launcher, tmp_path):
    """The worker's watchdog does not need its main thread, stuck in a 600 s step: the worker and
    the processes its envs started are gone within about the heartbeat expiry (36 s before).

    A local worker sees its parent die; an external one (no parent to watch) sees the learner's end
    of the heartbeat connection close. The worker removes the learner's ipc directories as it goes.
    """
    started = tmp_path / "stepping"
    bind = f"ipc://{tmp_path}/learner.sock" if launcher == "external" else ""
    script = LEARNER_MID_STEP.format(secret=SECRET)
    learner = subprocess.Popen(
        [sys.executable, "-c", script, str(started), bind, launcher], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    worker = None
    if launcher == "external":
        env = {**os.environ, "CLUSTERENV_SECRET": SECRET, "PYTHONPATH": ROOT}
        worker = subprocess.Popen([sys.executable, "-m", "clusterenv.worker", "--connect", bind], env=env, cwd=ROOT)
    survivors: set[int] = set()
    try:
        assert learner.stdout is not None
        pids = json.loads(learner.stdout.readline())  # bounded by the test timeout
        survivors = {pids["worker"], *pids["helpers"]}
        assert wait_until(started.exists, timeout=30), "the worker never entered its step"
        dirs = scratch_dirs_of(learner.pid)
        assert dirs, "the learner's ipc directories are named after its pid"

        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=10)
        killed = time.monotonic()
        bound = MID_STEP_EXPIRY + 5.0  # expiry, the main thread's 1 s grace, and margin for a loaded machine
        gone = wait_until(lambda: not any(pid_alive(pid) for pid in survivors), timeout=bound)
        elapsed = time.monotonic() - killed
        alive = sorted(pid for pid in survivors if pid_alive(pid))
        assert gone, f"processes {alive} (worker {pids['worker']}) outlived the learner by more than {bound} s"
        assert elapsed < bound
        assert not scratch_dirs_of(learner.pid), "the worker removes its dead learner's directories"
    finally:
        for pid in survivors:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for process in (learner, worker):
            if process is not None:
                process.kill()
                process.wait()
        if learner.stdout is not None:
            learner.stdout.close()


def test_scratch_directories_are_removed_only_when_their_learner_is_gone():
    make = (
        "from clusterenv.wire.cleanup import *; print(scratch_dir()); print(scratch_dir('obs', shared_memory_base()))"
    )
    made = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, check=True, cwd=ROOT)
    of_dead = made.stdout.split()  # an ipc directory and a shared observations directory
    dead_pid = os.path.basename(of_dead[0]).split("-")[1]
    own = scratch_dir()
    other_namespace = tempfile.mkdtemp(prefix=f"clusterenv-{dead_pid}-00000000-")
    try:
        assert all(os.path.isdir(path) for path in of_dead)
        assert set(of_dead) <= set(remove_stale_dirs())
        assert not any(os.path.exists(path) for path in of_dead)
        assert os.path.isdir(own), "a live learner's directory stays"
        assert os.path.isdir(other_namespace), "a pid of another host or pid namespace cannot be judged here"
    finally:
        for path in (own, other_namespace, *of_dead):
            shutil.rmtree(path, ignore_errors=True)


# -- a worker is too slow --------------------------------------------------------------------
@pytest.mark.parametrize("how", ["env timeout", "step_wait(timeout=)"])
def test_slow_step_raises_worker_timeout_and_closes(how):
    fast, slow = functools.partial(SlowEnv, 0.0), functools.partial(SlowEnv, 30.0)
    envs, pids = start([fast, slow], num_workers=2, timeout=0.5 if how == "env timeout" else 60)
    try:
        envs.reset(seed=0)
        started = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as caught:
            if how == "env timeout":
                envs.step(np.zeros(2, dtype=np.int64))
            else:
                envs.step_async(np.zeros(2, dtype=np.int64))
                envs.step_wait(timeout=0.5)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 10, elapsed
        assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, ClusterEnvError)
        assert str(caught.value).startswith("Workers [1] did not reply within 0.5 s while stepping.")
        assert envs.closed
        with pytest.raises(ClosedEnvironmentError):
            envs.reset()
        started = time.monotonic()
        envs.close()
        assert time.monotonic() - started < 5
    finally:
        envs.close()
    assert all_gone(pids)


def slow_to_build() -> gym.Env:
    time.sleep(60)
    return CARTPOLE()


def test_env_slower_to_build_than_start_timeout_raises_and_leaks_nothing():
    before = child_pids()
    started = time.monotonic()
    with pytest.raises(
        WorkerTimeoutError, match=re.escape("Workers [0] did not reply within 5.0 s while building envs.")
    ):
        ClusterEnv([slow_to_build, CARTPOLE], num_workers=2, start_timeout=5.0)
    assert time.monotonic() - started < 20
    assert wait_until(lambda: child_pids() == before, timeout=10)


def test_timeout_none_waits_as_long_as_it_takes():
    with ClusterEnv([functools.partial(SlowEnv, 0.3)] * 2, num_workers=2, timeout=None) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        envs.step_async(np.zeros(2, dtype=np.int64))
        assert envs.step_wait(timeout=5)[1].shape == (2,)


# -- close() always returns ------------------------------------------------------------------
# As AsyncVectorEnv warns when closed with a call pending (its results are lost).
PENDING_STEP_WARNING = re.escape("Calling `close` while waiting for a pending call to `step` to complete.")


def closed_twice(envs: ClusterEnv, pids: set[int]) -> None:
    envs.close()


def closed_with_pending_step(envs: ClusterEnv, pids: set[int]) -> None:
    envs.step_async(ACTIONS)


def closed_after_worker_killed(envs: ClusterEnv, pids: set[int]) -> None:
    pid = min(pids)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), timeout=5)


CLOSE_AFTER = {
    "twice": closed_twice,
    "with a pending step": closed_with_pending_step,
    "after a worker was killed": closed_after_worker_killed,
}


@pytest.mark.parametrize("before_close", CLOSE_AFTER.values(), ids=CLOSE_AFTER)
def test_close_returns_promptly(before_close):
    envs, pids = start([CARTPOLE] * 4, num_workers=2)
    envs.reset(seed=0)
    before_close(envs, pids)
    started = time.monotonic()
    pending = before_close is closed_with_pending_step
    with pytest.warns(UserWarning, match=PENDING_STEP_WARNING) if pending else contextlib.nullcontext():
        envs.close()
    envs.close()
    assert time.monotonic() - started < 8  # the grace period is 5 s
    assert envs.closed
    assert all_gone(pids)


def test_close_after_an_env_error_and_again():
    envs, pids = start([functools.partial(FailingEnv, 1)] * 2, num_workers=2)
    envs.reset(seed=0)
    with pytest.raises(RemoteEnvError):
        envs.step(np.zeros(2, dtype=np.int64))
    envs.close()
    envs.close()
    assert all_gone(pids)


def test_close_kills_a_worker_stuck_in_a_step_after_the_grace_period():
    envs, pids = start([functools.partial(SlowEnv, 60.0)] * 2, num_workers=2)
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    started = time.monotonic()
    with pytest.warns(UserWarning, match=PENDING_STEP_WARNING):
        envs.close(timeout=0.5)
    assert time.monotonic() - started < 5
    assert all_gone(pids)


def test_close_waits_one_grace_period_in_all_and_ends_the_env_processes_of_a_worker_that_ignores_close():
    grace = 3.0  # a confirmation wait and a process wait of one grace each took 2 * grace (6 s) before
    envs, pids = start([functools.partial(StuckEnv, 600.0)] * 2, num_workers=1)
    helpers: set[int] = set()
    try:
        envs.reset(seed=0)
        helpers = set(envs.get_attr("helper_pid"))
        envs.step_async(np.zeros(2, dtype=np.int64))
        started = time.monotonic()
        with pytest.warns(UserWarning, match=PENDING_STEP_WARNING):
            envs.close(timeout=grace)
        elapsed = time.monotonic() - started
        assert grace <= elapsed < grace + 2.0, f"close(timeout={grace}) took {elapsed:.1f} s"
        assert all_gone(pids | helpers, timeout=5), "the worker and the processes its envs started must all be gone"
    finally:
        envs.close(terminate=True)
        for pid in helpers:  # not our children: the leak check cannot see them
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_close_with_terminate_does_not_wait():
    envs, pids = start([functools.partial(SlowEnv, 60.0)] * 2, num_workers=2)
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    started = time.monotonic()
    with pytest.warns(UserWarning, match=PENDING_STEP_WARNING):
        envs.close(terminate=True)
    assert time.monotonic() - started < 3
    assert all_gone(pids)


# -- ownership -------------------------------------------------------------------------------
def test_context_manager_closes_even_when_the_body_raises():
    before = child_pids()
    with pytest.raises(KeyError):
        with ClusterEnv([CARTPOLE] * 2, num_workers=2) as envs:
            pids = child_pids() - before
            assert len(pids) == 2
            envs.reset(seed=0)
            raise KeyError("body failed")
    assert envs.closed
    assert all_gone(pids)


def test_garbage_collected_env_leaves_no_process():
    envs, pids = start([CARTPOLE] * 2, num_workers=2)
    envs.reset(seed=0)
    del envs
    gc.collect()
    assert all_gone(pids)
