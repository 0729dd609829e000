"""Where the time and memory go.

Each local worker's CPU and memory (``worker_info``), the learner's busy and waiting time (``learner_info``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from clusterenv import ClusterEnv
from clusterenv.wire.messages import usage_report
from tests.envs import BusyEnv, LeakyCartPole, SlowEnv
from tests.test_remote import FAST, SECRET, free_address, worker_command
from tests.test_remote import spawn as spawn  # a fixture

pytestmark = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="read from /proc")


def usage(envs, key: str) -> list[float]:
    return [worker[key] for worker in sorted(envs.worker_info, key=lambda w: w["worker_id"])]


@pytest.mark.parametrize("procs", [1, 2])
def test_cpu_seconds_count_the_work_done_in_the_worker_and_its_env_processes(procs):
    """Two envs per worker, each step 10 ms of CPU: 100 batch steps are about 2 s of CPU per worker.

    Fewer in fact: CartPole's episodes end every ten steps or so, and an autoreset step burns nothing.
    """
    with ClusterEnv(
        [functools.partial(BusyEnv, 0.01, "cpu")] * 4, num_workers=2, procs_per_worker=procs, timeout=120
    ) as envs:
        envs.reset(seed=0)
        before = usage(envs, "cpu_s")
        for _ in range(100):
            envs.step(np.zeros(4, np.int64))
        used = np.subtract(usage(envs, "cpu_s"), before)
        assert (used >= 1.5).all(), used
        assert (used < 60).all(), used


@pytest.mark.parametrize("procs", [1, 2])
def test_resident_memory_shows_the_worker_whose_env_leaks(procs):
    fns = [functools.partial(LeakyCartPole, 2.0)] * 2 + [functools.partial(LeakyCartPole, 0.0)] * 2
    with ClusterEnv(fns, num_workers=2, procs_per_worker=procs, autoreset_mode="SameStep") as envs:
        envs.reset(seed=0)
        before = usage(envs, "rss_mb")
        for _ in range(50):
            envs.step(np.zeros(4, np.int64))
        grown = np.subtract(usage(envs, "rss_mb"), before)
        assert grown[0] >= 190, grown  # 2 envs x 50 steps x 2 MB
        assert grown[1] < 50, grown


def test_an_env_bound_run_shows_the_learner_waiting_for_most_of_each_step():
    """Each step waits at least 20 ms for the workers' envs; the learner's own part is what is left."""
    with ClusterEnv([functools.partial(SlowEnv, 0.02)] * 2, num_workers=2) as envs:
        info = envs.learner_info
        assert {key: info[key] for key in ("batch_steps", "busy_ms", "waiting_ms")} == {
            "batch_steps": 0,
            "busy_ms": None,
            "waiting_ms": None,
        }
        assert info["learner_envs"] == 0 and info["spin"] in ("adaptive", "never")
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(2, np.int64))
        info = envs.learner_info
        assert info["batch_steps"] == 20  # reset() is not a batch step
        assert info["waiting_ms"]["p50"] >= 19.0
        assert 0.0 <= info["busy_ms"]["p50"] < info["waiting_ms"]["p50"]


def test_first_ready_batch_steps_run_from_send_to_recv():
    with ClusterEnv([functools.partial(SlowEnv, 0.01)] * 4, num_workers=4, batch_size=2) as envs:
        envs.async_reset(seed=0)
        for _ in range(10):
            *_, env_ids = envs.recv()
            envs.send(np.zeros(len(env_ids), np.int64), env_ids)
        info = envs.learner_info
        assert info["batch_steps"] == 9  # the first recv() answered async_reset, which sent no STEP
        assert info["waiting_ms"]["p50"] >= 0.0 and info["busy_ms"]["p50"] >= 0.0
        for _ in range(2):
            envs.recv()


@pytest.mark.parametrize("procs", [1, 2])
def test_env_step_times_are_measured_where_the_envs_step(procs):
    """Each step burns 5 ms of the env's CPU, so no env step can take less wall time than that."""
    fns = [functools.partial(BusyEnv, 0.005, "cpu")] * 4
    with ClusterEnv(fns, num_workers=2, procs_per_worker=procs, autoreset_mode="SameStep") as envs:
        assert [w["env_step_ms"] for w in envs.worker_info] == [None, None]
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.zeros(4, np.int64))
        for worker in envs.worker_info:
            times = worker["env_step_ms"]
            assert times["samples"] >= 1 and 5.0 <= times["p50"] <= times["p95"], times


def test_workers_started_elsewhere_report_their_own_cpu_memory_and_step_times(spawn):
    """An external worker's /proc is not the learner's to read: the worker sends its figures, once a second."""
    address = free_address()
    spawn(worker_command(address, "--worker-id", "0"))
    fns = [functools.partial(BusyEnv, 0.005, "cpu")] * 2
    with ClusterEnv(fns, num_workers=1, bind=address, secret=SECRET, launcher="external", heartbeat=FAST) as envs:
        assert envs.worker_info[0]["cpu_s"] is None and envs.worker_info[0]["rss_mb"] is None
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros(2, np.int64))
        worker = envs.worker_info[0]
        assert worker["rss_mb"] > 10 and worker["cpu_s"] > 0
        assert worker["env_step_ms"]["p50"] >= 5.0


@pytest.mark.parametrize(
    "report",
    [
        "not a dict",
        {"env_step_ms": [1.0, 2.0], "cpu_s": 1.0, "rss_mb": 2.0},
        {"env_step_ms": [1.0, "x", 3.0], "cpu_s": 1.0, "rss_mb": 2.0},
        {"env_step_ms": None, "cpu_s": float("nan"), "rss_mb": 2.0},
        {"env_step_ms": None, "cpu_s": 1.0, "rss_mb": 2.0, "extra": 1},
        {"env_step_ms": None, "cpu_s": True, "rss_mb": 2.0},
    ],
)
def test_a_malformed_usage_report_is_ignored_not_shown(report):
    assert usage_report(report) is None
    assert usage_report({"env_step_ms": [1.0, 2.0, 30.0], "cpu_s": 1.0, "rss_mb": None}) is not None
