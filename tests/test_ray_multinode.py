"""Workers spread over a three-node Ray cluster, emulated on this machine with ``ray.cluster_utils``."""

from __future__ import annotations

import os
import signal
from contextlib import closing

import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv
from tests.conftest import pid_alive, wait_until
from tests.test_remote import ENV_FNS, FAST, descendants, run_lockstep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_nodes():
    """A head and two more nodes, one CPU each, so that three one-CPU workers land one per node."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield ray
    spawned = descendants(os.getpid())
    ray.shutdown()
    cluster.shutdown()
    assert wait_until(lambda: not any(pid_alive(pid) for pid in spawned), timeout=30), "Ray processes outlived shutdown"


def test_workers_on_three_nodes_step_exactly_and_a_lost_node_worker_is_replaced(three_nodes):
    from clusterenv.ray_launcher import RayLauncher

    assert len([node for node in three_nodes.nodes() if node["Alive"]]) == 3
    launcher = RayLauncher(num_cpus_per_worker=1)
    fns = ENV_FNS + ENV_FNS[:2]  # 6 envs, 2 per worker
    with (
        ClusterEnv(fns, num_workers=3, launcher=launcher, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(fns)) as reference,
    ):
        nodes = [launcher.node_id(w) for w in range(3)]
        assert len(set(nodes)) == 3, f"workers were not spread over the nodes: {nodes}"
        run_lockstep(envs, reference, steps=20)

        os.kill(envs.worker_info[2]["pid"], signal.SIGKILL)
        *_, truncations, infos = envs.step(reference.action_space.sample())
        assert truncations[4:].all() and infos["worker_restarted"].tolist() == [False] * 4 + [True] * 2
        # The replacement needs a free CPU: the lost worker's node is the only one with one.
        assert launcher.node_id(2) == nodes[2]
        envs.step(reference.action_space.sample())
