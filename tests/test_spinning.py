"""Bounded spinning on the shared step path: chosen only where it fits, exact, and never a way to hang or leak.

Each side of the path reads the other's words in a loop for a while before it blocks
(``spin_us``). Spinning is chosen only where the learner and every local worker, of every
ClusterEnv in the process, have a core each; these tests make that rule hold where they
need spinning, whatever the machine.
"""

from __future__ import annotations

import _thread
import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, WorkerLostError
from clusterenv.wire import waiting
from clusterenv.wire.waiting import MIN_SPIN_S, SPIN_SEATS, SpinBudget, SpinSeats
from tests.conftest import assert_same, pid_alive
from tests.envs import SparseInfoRichEnv
from tests.test_equivalence import MODES, run_lockstep
from tests.test_lifecycle import all_gone

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may use ``n`` cores (the rule that decides whether anyone spins)."""
    gc.collect()  # the seats of envs an earlier test left to the garbage collector go back first

    def pretend(n: int) -> None:
        monkeypatch.setattr(waiting, "usable_cores", lambda: n)

    return pretend


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, all its threads (``schedstat``: nanoseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return total * 1e-9


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
    assert SPIN_SEATS.held() == 0  # every env gave its seats back when it closed


def test_two_cluster_envs_in_one_process_share_its_cores(cores):
    """A training env and an eval env: their spinners together never outnumber the cores; a closed env's seats free."""
    cores(2)
    actions = np.zeros(4, dtype=np.int64)
    with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as training:
        assert training.learner_info["spin"] == "adaptive"
        with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as evaluation:
            info = evaluation.learner_info
            assert info["spin"] == "never"
            assert info["spin_rule"] == (
                "1 worker spinning for another ClusterEnv in this process leaves no core: all block"
            )
            for envs in (training, evaluation):  # both step, one spinning and one blocking
                envs.reset(seed=0)
                envs.step(actions)
        with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as third:  # the eval env's seats: none
            assert third.learner_info["spin"] == "never"
    with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as third:  # the training env's: free again
        assert third.learner_info["spin"] == "adaptive"
        assert third.learner_info["spin_rule"] == "every spinning process has a core"


def test_a_worker_told_not_to_spin_blocks_between_steps(cores):
    """Both envs ask workers to spin a second after each step; the one whose workers would not fit blocks."""
    cores(2)
    actions = np.zeros(4, dtype=np.int64)
    with (
        ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2, spin_us=1e6) as spinning,
        ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2, spin_us=1e6) as blocking,
    ):
        assert spinning.learner_info["spin"] == "fixed"
        assert blocking.learner_info["spin"] == "never"
        assert blocking.learner_info["spin_rule"].startswith("1 worker spinning for another ClusterEnv")
        pids = [envs.worker_info[0]["pid"] for envs in (spinning, blocking)]
        for envs in (blocking, spinning):  # the spinning worker's second starts last
            envs.reset(seed=0)
            envs.step(actions)
        before = [cpu_s(pid) for pid in pids]
        time.sleep(0.5)  # both workers wait for their next command
        used = [cpu_s(pid) - b for pid, b in zip(pids, before, strict=True)]
    assert used[1] < 0.05, f"a worker told not to spin used {used[1]:.3f} s of CPU while it waited 0.5 s"
    assert used[0] > 0.02, f"the spinning worker used only {used[0]:.3f} s: this test cannot tell spinning apart"


def test_spinners_seats_go_back_with_an_env_left_to_the_garbage_collector(cores):
    cores(2)
    envs = ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2)
    assert envs.learner_info["spin"] == "adaptive" and SPIN_SEATS.held() == 1
    del envs
    gc.collect()
    assert SPIN_SEATS.held() == 0


def test_spin_seats_never_seat_more_workers_than_the_cores_beside_the_learner(cores):
    cores(4)
    seats = SpinSeats()
    claims = [seats.claim(1) for _ in range(4)]
    assert [claim.granted for claim in claims] == [True, True, True, False]
    assert claims[3].reason == "3 workers spinning for 3 other ClusterEnvs in this process leave no core: all block"
    claims[0].release()
    claims[0].release()  # once
    assert seats.held() == 2
    assert seats.claim(2).reason == (
        "2 workers spinning for 2 other ClusterEnvs in this process leave 1 core for 2: all block"
    )
    assert seats.claim(4).reason == "5 spinning processes would not fit in this process's cores: all block"
    del claims
    gc.collect()
    assert seats.held() == 0  # a claim left to the garbage collector gives its seats back
    with ThreadPoolExecutor(8) as threads:  # claims from many threads at once: still one core each
        granted = [claim for claim in threads.map(lambda _: seats.claim(1), range(64)) if claim.granted]
    assert len(granted) == 3 and seats.held() == 3


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
        assert SPIN_SEATS.held() == 0  # the loss closed the env: its worker's seat is free


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


def test_waits_that_outlast_the_cap_turn_the_spin_off_within_three_and_keep_it_off():
    """Steps 4 ms apart (a training loop's forward pass and more): after a few waits, each spins 30 µs, then blocks."""
    budget = SpinBudget(None, cap_s=1e-3)
    bounds = []
    for _ in range(200):
        bounds.append(budget.bound())
        budget.observe(4e-3, caught=False)  # the spin ran out; the command came 4 ms after the wait began
    assert bounds[:1] == [1e-3] and bounds[3:] == [MIN_SPIN_S] * 197


def test_a_wait_counts_whole_from_its_beginning_to_its_end():
    """A waiter whose spin ran out knows only that: its wait counts when it ends, the time spent blocked included."""
    budget = SpinBudget(None, cap_s=1e-3)
    for _ in range(5):
        budget.begin()
        time.sleep(4e-3)  # the spin ran out, then it blocked until the next command
        budget.end(caught=False)
    assert budget.bound() == MIN_SPIN_S and budget.waits == 5 and budget.caught == 0
    budget.end(caught=False)  # no wait begun since: nothing to count
    assert budget.waits == 5
    for _ in range(20):
        budget.begin()
        budget.end(caught=True)
    assert budget.bound() == 1e-3 and budget.caught == 20


@pytest.mark.parametrize(
    ("wait_s", "caught"), [(20e-6, True), (200e-6, False)], ids=["caught within the short spin", "measured short"]
)
def test_short_waits_turn_the_spin_on_again_after_any_run_of_long_ones(wait_s, caught):
    budget = SpinBudget(None, cap_s=1e-3)
    for _ in range(100):
        budget.observe(10.0, caught=False)  # evaluations of seconds
    assert budget.bound() == MIN_SPIN_S
    short = 0
    while budget.bound() == MIN_SPIN_S:
        budget.observe(wait_s, caught=caught)
        short += 1
    assert short <= 12


def test_one_learning_update_among_fast_steps_leaves_the_spin_on():
    budget = SpinBudget(None, cap_s=1e-3)
    for _ in range(128):
        budget.observe(200e-6, caught=True)  # a rollout: a policy's forward pass between steps
    budget.observe(50e-3, caught=False)
    assert budget.bound() == 1e-3


def test_a_worker_whose_steps_come_4_ms_apart_spins_hardly_longer_than_one_that_blocks(cores):
    """The gap outlasts the cap: the worker spins 30 µs for each command, not 1 ms, then blocks.

    Its CPU is compared with a worker that never spins, stepped in turns with it, so that
    whatever else runs on the machine weighs on both.
    """
    cores(2)
    actions = np.zeros(4, dtype=np.int64)
    with (
        ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as adaptive,
        ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2, spin_us=0) as blocking,
    ):
        assert adaptive.learner_info["spin"] == "adaptive"
        turns = [(envs, envs.worker_info[0]["pid"]) for envs in (adaptive, blocking)]
        used = [0.0, 0.0]
        for round_ in range(5):
            for i, (envs, pid) in enumerate(turns):
                if round_ == 0:
                    envs.reset(seed=0)
                before = cpu_s(pid)
                for _ in range(25):
                    envs.step(actions)
                    time.sleep(4e-3)
                if round_ > 0:  # the first round is the adaptive worker's to learn the gap
                    used[i] += cpu_s(pid) - before
    extra = (used[0] - used[1]) / 100
    assert extra < 150e-6, f"the adaptive worker used {extra * 1e6:.0f} µs more CPU per step than a blocking one"


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
