"""``worker_info`` shows what each worker process the learner started uses: CPU seconds and resident memory."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from clusterenv import ClusterEnv
from tests.envs import BusyEnv, LeakyCartPole

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
