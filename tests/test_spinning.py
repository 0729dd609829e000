"""Bounded spinning on the shared step path: chosen only where it fits, exact, and never a way to hang or leak.

Each side of the path reads the other's words in a loop for a while before it blocks
(``spin_us``). Spinning is chosen only where the learner and every local worker have a core
each; these tests make that rule hold where they need spinning, whatever the machine.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, WorkerLostError
from clusterenv.wire import waiting
from clusterenv.wire.waiting import MIN_SPIN_S, SpinBudget
from tests.conftest import assert_same, pid_alive
from tests.envs import SparseInfoRichEnv
from tests.test_equivalence import MODES, run_lockstep
from tests.test_lifecycle import all_gone

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may use ``n`` cores (the rule that decides whether anyone spins)."""

    def pretend(n: int) -> None:
        monkeypatch.setattr(waiting, "usable_cores", lambda: n)

    return pretend


def test_spinning_is_chosen_only_where_the_learner_and_every_worker_have_a_core(cores):
    cores(2)
    with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as envs:
        info = envs.learner_info
        assert info["spin"] == "adaptive" and info["spin_rule"] == "every spinning process has a core"
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        info = envs.learner_info
        assert info["spin"] == "never"
        assert info["spin_rule"] == "3 spinning processes would not fit in this process's cores: all block"
    with ClusterEnv([CARTPOLE] * 4, num_workers=2, spin_us=100.0) as envs:  # a bound the user set: the same rule
        assert envs.learner_info["spin"] == "never" and envs.learner_info["spin_rule"].startswith("3 spinning")
    with ClusterEnv([CARTPOLE] * 4, num_workers=2, spin_us=0) as envs:
        assert envs.learner_info["spin"] == "never"


@pytest.mark.parametrize("spin_us", [None, 50.0], ids=["adaptive", "50 us"])
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_spinning_steps_are_bit_identical_to_sync_vector_env(mode, spin_us, cores):
    cores(4)
    env_fns = [functools.partial(SparseInfoRichEnv, "box")] * 5
    with (
        ClusterEnv(env_fns, num_workers=1, learner_envs=2, autoreset_mode=mode, spin_us=spin_us) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert run_lockstep(reference, envs, steps=150, seed=1) >= 10
        info = envs.learner_info
        assert info["spin"] == ("adaptive" if spin_us is None else "fixed") and info["waits"] > 0


def test_a_spinning_learner_notices_a_worker_that_died(cores):
    cores(4)
    with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2, spin_us=1e6) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        victim = envs.worker_info[0]["pid"]
        os.kill(victim, signal.SIGSTOP)  # it cannot answer: the learner spins on its words
        threading.Timer(0.3, os.kill, (victim, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(WorkerLostError, match="exited with code -9 while stepping"):
            envs.step(np.zeros(4, dtype=np.int64))
        assert time.monotonic() - started < 5


def test_ctrl_c_while_the_learner_spins_is_finished_by_step_wait(cores):
    cores(4)
    with (
        ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2, spin_us=1e6) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert_same(reference.reset(seed=3), envs.reset(seed=3))
        worker = envs.worker_info[0]["pid"]
        os.kill(worker, signal.SIGSTOP)
        timer = threading.Timer(0.2, _thread.interrupt_main)  # well inside the learner's 1 s spin
        try:
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.array([1, 0, 1, 0]))
            timer.join()
        finally:
            os.kill(worker, signal.SIGCONT)
        assert_same(reference.step(np.array([1, 0, 1, 0])), envs.step_wait())
        assert_same(reference.step(np.array([0, 0, 1, 1])), envs.step(np.array([0, 0, 1, 1])))


def test_spinning_workers_do_not_outlive_their_learner():
    """Workers spin a whole second after each reply here: killed mid-run, the learner still takes them with it."""
    script = textwrap.dedent(
        """
        import gymnasium as gym
        import numpy as np
        from clusterenv import ClusterEnv
        from clusterenv.wire import waiting
        from tests.conftest import child_pids

        waiting.usable_cores = lambda: 4
        envs = ClusterEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1, learner_envs=2, spin_us=1e6)
        envs.reset(seed=0)
        assert envs.learner_info["spin"] == "fixed"
        print(" ".join(map(str, sorted(child_pids()))), flush=True)
        while True:
            envs.step(np.zeros(4, dtype=np.int64))
        """
    )
    learner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert learner.stdout is not None
        workers = {int(pid) for pid in learner.stdout.readline().split()}
        assert len(workers) == 1 and all(pid_alive(pid) for pid in workers)
        time.sleep(0.5)
        learner.send_signal(signal.SIGKILL)
        assert all_gone(workers, timeout=10), "a spinning worker outlived its learner"
    finally:
        learner.kill()
        learner.wait()
        learner.stdout.close()


def test_an_adaptive_spin_lasts_while_waits_end_within_its_cap_and_shrinks_when_they_do_not():
    budget = SpinBudget(None, cap_s=1e-3)
    assert budget.bound() == 1e-3
    for _ in range(40):
        budget.observe(200e-6, caught=True)  # a policy's forward pass between steps
    assert budget.bound() == 1e-3 and budget.caught == 40
    for _ in range(40):
        budget.observe(50e-3, caught=False)  # a learning update: block, leave the cores to it
    assert budget.bound() == MIN_SPIN_S
    for _ in range(40):
        budget.observe(100e-6, caught=True)
    assert budget.bound() == 1e-3
    assert SpinBudget(0.0).bound() == 0 and not SpinBudget(0.0).spins
    assert SpinBudget(25e-6).bound() == 25e-6
