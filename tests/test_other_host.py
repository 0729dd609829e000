"""A worker on another host (a network namespace with its own hostname) gives exactly what a local one gives.

Its observations cross a veth link as frames, compressed or not, where a local worker's go
through shared memory; the results are bit-identical to ``SyncVectorEnv`` either way.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import subprocess
from collections.abc import Iterator
from contextlib import closing

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, EveryUpdate, PolicyRunner
from tests import netns
from tests.envs import SpriteEnv
from tests.test_remote import FAST, SECRET, child_env, run_lockstep, worker_command

pytestmark = pytest.mark.skipif(bool(reason := netns.unavailable()), reason=f"no other host here: {reason}")

# 3 envs per worker of 27 KB frames: a local worker's slice (83 KB) goes through shared memory.
ENV_FNS = [functools.partial(SpriteEnv, size=96)] * 6
STEPS = 60


@contextlib.contextmanager
def one_worker_here_one_there() -> Iterator[tuple[netns.OtherHost, str]]:
    """Worker 0 on this host, worker 1 on the other; yields the other host and the address to bind. Both end at exit."""
    with netns.other_host() as host:
        address = f"tcp://{host.learner_ip}:{netns.free_port(host.learner_ip)}"
        workers = [
            subprocess.Popen(worker_command(address, "--worker-id", "0"), env=child_env()),
            host.popen(worker_command(address, "--worker-id", "1"), env=child_env()),
        ]
        try:
            yield host, address
        finally:
            for worker in workers:
                worker.kill()
                worker.wait(timeout=10)


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_a_worker_on_another_host_gives_what_a_local_one_gives(compression):
    with one_worker_here_one_there() as (host, address):
        with (
            ClusterEnv(
                ENV_FNS,
                num_workers=2,
                bind=address,
                secret=SECRET,
                launcher="external",
                heartbeat=FAST,
                compression=compression,
            ) as envs,
            closing(SyncVectorEnv(ENV_FNS)) as reference,
        ):
            assert [info["host"] for info in envs.worker_info] == [socket.gethostname(), host.hostname]
            received = host.rx_bytes()
            run_lockstep(envs, reference, steps=STEPS)
            received = host.rx_bytes() - received
    frames = (STEPS + 1) * 3 * 96 * 96 * 3  # what the remote worker's observations weigh, uncompressed
    if compression is None:
        assert received > frames
    else:
        assert received < frames / 5


def test_by_default_pulls_are_lossless_deltas_to_another_host_and_full_copies_on_this_one():
    with one_worker_here_one_there() as (host, address):
        cartpoles = [functools.partial(gym.make, "CartPole-v1")] * 4
        with ClusterEnv(
            cartpoles, num_workers=2, bind=address, secret=SECRET, launcher="external", heartbeat=FAST
        ) as envs:
            actor = torch.nn.Linear(4, 2)
            runner = PolicyRunner(envs, actor, EveryUpdate(), seed=0)
            for _ in range(4):
                runner.rollout(4)
                with torch.no_grad():
                    actor.weight.add_(0.01)
                runner.publish()
            local, remote = runner.telemetry.workers
    assert local.full_pulls == local.pulls == 3 and local.delta_pulls == 0
    assert remote.delta_pulls == remote.pulls == 3 and remote.full_pulls == 0
