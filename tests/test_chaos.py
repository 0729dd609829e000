"""A chaos run: 20,000 batch steps while workers are killed, frozen and their sockets flooded."""

from __future__ import annotations

import glob
import os
import random
import signal
import tempfile
import threading

import gymnasium as gym
import numpy as np
import pytest
import zmq

from clusterenv import ClusterEnv
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import child_pids, wait_until

pytestmark = pytest.mark.slow

NUM_ENVS, NUM_WORKERS, BATCH_STEPS = 8, 4, 20_000
FAST = Heartbeat(interval=0.05, liveness=10)  # a frozen worker is lost after 0.5 s


def leftovers() -> set[str]:
    """The scratch directories of this learner process (ipc sockets, shared observations).

    Their names carry the owner's pid (see clusterenv/cleanup.py), so other processes on a
    shared machine cannot disturb the count.
    """
    found = set()
    for base in {tempfile.gettempdir(), "/dev/shm"}:
        for kind in ("clusterenv-", "clusterenv-obs-"):
            found |= set(glob.glob(os.path.join(base, f"{kind}{os.getpid()}-*")))
    return found


def flood(endpoint: str, stop: threading.Event) -> None:
    """An unauthenticated peer sending garbage and oversized frames to an endpoint until ``stop``."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 10)
    socket.connect(endpoint)
    rng = random.Random(0)
    junk = [b"", b"\x00" * 64, os.urandom(300), b"\x92\x01\x02", os.urandom(1 << 20)]
    while not stop.wait(0.01):
        try:
            socket.send_multipart([rng.choice(junk) for _ in range(rng.randint(1, 4))], zmq.NOBLOCK)
        except zmq.Again:
            pass
    socket.close()
    context.term()


def step_hitting(envs: ClusterEnv, actions: np.ndarray, pid: int, how: str):
    """One step during which worker process ``pid`` gets ``how``: SIGKILL or SIGSTOP, before the step or mid-step."""
    sig = signal.SIGKILL if how.startswith("SIGKILL") else signal.SIGSTOP
    if how.endswith("mid-step"):
        envs.step_async(actions)
        os.kill(pid, sig)
        return envs.step_wait()
    os.kill(pid, sig)
    return envs.step(actions)


@pytest.mark.timeout(900)
def test_twenty_thousand_steps_through_kills_freezes_and_floods():
    rng = random.Random(1)
    fds_before, dirs_before = len(os.listdir("/proc/self/fd")), leftovers()
    fns = [lambda: gym.make("CartPole-v1")] * NUM_ENVS
    stop = threading.Event()
    with ClusterEnv(fns, num_workers=NUM_WORKERS, on_worker_failure="restart", heartbeat=FAST, timeout=60) as envs:
        floods = [
            threading.Thread(target=flood, args=(endpoint, stop), daemon=True)
            for endpoint in (envs.address, envs.pool.heartbeat_endpoint)
        ]
        for thread in floods:
            thread.start()
        envs.reset(seed=0)
        per_worker = NUM_ENVS // NUM_WORKERS
        hit: dict[int, str] = {}  # worker -> what was done to it, until its restart is reported
        reported = []
        for t in range(BATCH_STEPS):
            actions = np.array([rng.randrange(2) for _ in range(NUM_ENVS)])
            if not hit and t % 1600 == 800:  # at most one casualty at a time; 12 in all
                victim = rng.randrange(NUM_WORKERS)
                how = rng.choice(["SIGKILL", "SIGKILL mid-step", "SIGSTOP", "SIGSTOP mid-step"])
                result = step_hitting(envs, actions, envs.worker_info[victim]["pid"], how)
                hit[victim] = how
            else:
                result = envs.step(actions)
            obs, rewards, terminations, truncations, infos = result
            assert obs.shape == (NUM_ENVS, 4) and rewards.shape == terminations.shape == truncations.shape == (
                NUM_ENVS,
            )
            if "worker_restarted" in infos:
                restarted = np.flatnonzero(infos["worker_restarted"])
                workers = sorted({int(i) // per_worker for i in restarted})
                assert workers == sorted(hit), f"step {t}: restarts of {workers}, but {hit} were hit"
                for w in workers:  # every env of a replaced worker reports its episode as cut
                    envs_of_w = range(w * per_worker, (w + 1) * per_worker)
                    assert set(restarted) >= set(envs_of_w) and truncations[list(envs_of_w)].all()
                    reported.append(hit.pop(w))
        assert not hit, f"{hit} were hit but their restart was never reported"
        assert len(reported) >= 10, reported
        stop.set()
        for thread in floods:
            thread.join(timeout=10)
    assert wait_until(lambda: not child_pids(), timeout=10), f"workers left: {child_pids()}"
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds_before, timeout=10)
    assert leftovers() <= dirs_before, (dirs_before, leftovers())


@pytest.mark.timeout(600)
def test_the_run_goes_on_with_fewer_workers_when_three_of_eight_are_lost_for_good():
    """Under ``rehome``: 2 of 8 workers killed (one mid-step) and one frozen; the survivors carry all envs.

    ``benchmarks/elastic.py`` runs the same for 20,000 steps and measures the throughput.
    """
    num_envs, num_workers = 16, 8
    per_worker = num_envs // num_workers
    fds_before, dirs_before = len(os.listdir("/proc/self/fd")), leftovers()
    fns = [lambda: gym.make("CartPole-v1")] * num_envs
    rng = np.random.default_rng(0)
    # step -> (worker, how); the frozen worker is lost after the heartbeat window and then ended.
    casualties = {1000: (1, "SIGKILL"), 2000: (4, "SIGKILL mid-step"), 3000: (6, "SIGSTOP")}
    with ClusterEnv(fns, num_workers=num_workers, on_worker_failure="rehome", heartbeat=FAST, timeout=60) as envs:
        envs.reset(seed=0)
        hit: dict[int, str] = {}
        cuts = 0
        for t in range(5000):
            actions = rng.integers(0, 2, num_envs)
            if t in casualties:
                victim, how = casualties[t]
                result = step_hitting(envs, actions, envs.worker_info[victim]["pid"], how)
                hit[victim] = how
            else:
                result = envs.step(actions)
            obs, rewards, terminations, truncations, infos = result
            assert obs.shape == (num_envs, 4) and rewards.shape == (num_envs,)
            if "worker_restarted" in infos:
                cut = np.flatnonzero(infos["worker_restarted"])
                workers = sorted({int(i) // per_worker for i in cut})
                assert workers == sorted(hit), f"step {t}: cuts of {workers}, but {hit} were hit"
                assert truncations[cut].all() and not terminations[cut].any() and (rewards[cut] == 0).all()
                for w in workers:
                    assert set(cut) >= set(range(w * per_worker, (w + 1) * per_worker))
                    hit.pop(w)
                cuts += len(workers)
        assert not hit and cuts == len(casualties)
        described = envs.worker_info
        assert sorted(w["worker_id"] for w in described if w["state"] == "lost") == [1, 4, 6]
        assert sorted(e for w in described for e in w["env_ids"]) == list(range(num_envs))
    assert wait_until(lambda: not child_pids(), timeout=10), f"workers left: {child_pids()}"
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= fds_before, timeout=10)
    assert leftovers() <= dirs_before, (dirs_before, leftovers())
