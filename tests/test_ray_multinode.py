"""Workers spread over a three-node Ray cluster, emulated on this machine with ``ray.cluster_utils``."""

from __future__ import annotations

import os
from contextlib import closing

import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv
from tests.conftest import pid_alive, wait_until
from tests.test_remote import ENV_FNS, FAST, descendants, run_lockstep

# One Ray instance at a time: under pytest-xdist both Ray test files run on the same worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def three_nodes():
    """A head and two more nodes, two CPUs each: room for a replacement when a node goes."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    saved = dict(os.environ)  # ray.init(address=...) exports RAY_ADDRESS: a later local ray.init must not see it
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield ray, cluster
    spawned = descendants(os.getpid())
    ray.shutdown()
    cluster.shutdown()
    os.environ.clear()
    os.environ.update(saved)
    assert wait_until(lambda: not any(pid_alive(pid) for pid in spawned), timeout=30), "Ray processes outlived shutdown"


def spread_then_lose_a_node(cluster, launcher, envs, reference) -> tuple[list[str], int]:
    """Check one worker per node and exact steps, remove a worker's node (not the head), and step until the
    loss is reported; the nodes the workers started on, and the lost worker."""
    nodes = [launcher.node_id(w) for w in range(3)]
    assert len(set(nodes)) == 3, f"workers were not spread over the nodes: {nodes}"
    run_lockstep(envs, reference, steps=10)
    # Take away a whole node (not the head, which holds Ray's own services).
    head = cluster.head_node.node_id
    lost = next(w for w in range(3) if nodes[w] != head)
    cluster.remove_node(next(node for node in cluster.list_all_nodes() if node.node_id == nodes[lost]))
    rows = [lost * 2, lost * 2 + 1]
    for _ in range(3):  # the loss is noticed within a few steps (heartbeats, or the actor's death)
        *_, truncations, infos = envs.step(reference.action_space.sample())
        if "worker_restarted" in infos:
            break
    assert infos["worker_restarted"].nonzero()[0].tolist() == rows and truncations[rows].all()
    return nodes, lost


def test_workers_spread_over_three_nodes_step_exactly_and_survive_losing_a_node(three_nodes):
    from clusterenv.launch.ray import RayLauncher

    ray, cluster = three_nodes
    assert len([node for node in ray.nodes() if node["Alive"]]) == 3
    launcher = RayLauncher(num_cpus_per_worker=1)  # SPREAD scheduling: one worker per node
    fns = ENV_FNS + ENV_FNS[:2]  # 6 envs, 2 per worker
    with (
        ClusterEnv(fns, num_workers=3, launcher=launcher, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(fns)) as reference,
    ):
        nodes, lost = spread_then_lose_a_node(cluster, launcher, envs, reference)
        assert launcher.node_id(lost) in set(nodes) - {nodes[lost]}, "the replacement runs on a surviving node"
        for _ in range(5):
            envs.step(reference.action_space.sample())


def test_a_node_that_never_comes_back_has_its_envs_moved_to_the_surviving_actors(three_nodes):
    from clusterenv.launch.ray import RayLauncher

    ray, cluster = three_nodes
    added = []
    while len([node for node in ray.nodes() if node["Alive"]]) < 3:  # the test above took one away
        added.append(cluster.add_node(num_cpus=2))
        cluster.wait_for_nodes()
    try:
        launcher = RayLauncher(num_cpus_per_worker=1)
        fns = ENV_FNS + ENV_FNS[:2]
        with (
            ClusterEnv(fns, num_workers=3, launcher=launcher, on_worker_failure="rehome", heartbeat=FAST) as envs,
            closing(SyncVectorEnv(fns)) as reference,
        ):
            nodes, lost = spread_then_lose_a_node(cluster, launcher, envs, reference)
            described = {w["worker_id"]: w for w in envs.worker_info}
            assert described[lost]["state"] == "lost"
            survivors = [w for w in range(3) if w != lost]
            assert sorted(e for w in survivors for e in described[w]["env_ids"]) == list(range(6))
            assert [launcher.node_id(w) for w in survivors] == [nodes[w] for w in survivors], "no actor was started"
            for _ in range(5):
                envs.step(reference.action_space.sample())
    finally:  # the fixture's cluster is as this test found it
        for node in added:
            if node in cluster.list_all_nodes():
                cluster.remove_node(node)
