"""Workers that the learner does not start itself: by hand or ``srun`` (external), and Ray actors."""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from contextlib import closing

import gymnasium as gym
import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, WorkerStartError
from clusterenv.wire.liveness import LEARNER_LOST_EXIT_CODE, Heartbeat
from clusterenv.wire.transport import SECRET_ENV_VAR
from tests.conftest import assert_same, child_pids, pid_alive, wait_until

SECRET = "a shared secret for these tests"
FAST = Heartbeat(interval=0.1, liveness=10, reconnect_initial=0.1, reconnect_max=0.2, max_reconnects=1)
ENV_FNS = [functools.partial(gym.make, "CartPole-v1")] * 4


def free_address() -> str:
    """A loopback address whose port and the next one (the heartbeat port) are both free now."""
    while True:
        with closing(socket.socket()) as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with closing(socket.socket()) as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return f"tcp://127.0.0.1:{port}"


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, SECRET_ENV_VAR: SECRET, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


@pytest.fixture
def spawn():
    """Start processes as a user would start them; every one is killed at the end."""
    processes: list[subprocess.Popen] = []

    def start(command: list[str], **extra_env: str) -> subprocess.Popen:
        process = subprocess.Popen(
            command, env=child_env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()
        process.communicate()


def worker_command(address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "clusterenv.worker", "--connect", address, *args]


def run_lockstep(envs, reference, steps: int) -> None:
    assert_same(envs.reset(seed=5), reference.reset(seed=5))
    reference.action_space.seed(5)
    for _ in range(steps):
        actions = reference.action_space.sample()
        assert_same(envs.step(actions), reference.step(actions))


def test_external_workers_join_and_ids_come_from_slurm_or_the_learner(spawn):
    address = free_address()
    by_slurm = spawn(worker_command(address), SLURM_PROCID="1")
    anonymous = spawn(worker_command(address))
    with (
        ClusterEnv(ENV_FNS, num_workers=2, bind=address, secret=SECRET, launcher="external", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(ENV_FNS)) as reference,
    ):
        assert [info["pid"] for info in envs.worker_info] == [anonymous.pid, by_slurm.pid]
        run_lockstep(envs, reference, steps=30)
    assert by_slurm.wait(timeout=10) == 0 and anonymous.wait(timeout=10) == 0


def test_learner_says_how_many_external_workers_joined(spawn):
    address = free_address()
    joined = spawn(worker_command(address, "--worker-id", "0"))
    expected = f"1 of 2 workers joined {address} within start_timeout=3.0 s; worker ids [1] are missing."
    with pytest.raises(WorkerStartError, match=re.escape(expected) + ".*clusterenv-worker --connect"):
        ClusterEnv(ENV_FNS, num_workers=2, bind=address, secret=SECRET, launcher="external", start_timeout=3)
    assert joined.wait(timeout=10) == 0  # told to close, although it never got work


LEARNER = textwrap.dedent(
    """
    import sys, time
    import gymnasium as gym
    from clusterenv import ClusterEnv
    from clusterenv.wire.liveness import Heartbeat
    envs = ClusterEnv([lambda: gym.make("CartPole-v1")], num_workers=1, bind=sys.argv[1], launcher="external",
                      heartbeat=Heartbeat(**eval(sys.argv[2])))
    envs.reset(seed=0)
    print("ready", flush=True)
    time.sleep(300)
    """
)


def start_learner_and_worker(spawn, attempts: int = 3):
    """A learner process of ``LEARNER`` with its external worker, once it printed "ready".

    The port ``free_address`` found free may be taken before the learner binds it (another
    test's connection takes an ephemeral port): then both start again on another address.
    Any other way the learner ends early fails with its stderr.
    """
    for _ in range(attempts):
        address = free_address()
        learner = spawn([sys.executable, "-c", LEARNER, address, repr(FAST.to_meta())])
        worker = spawn(worker_command(address))
        line = learner.stdout.readline().strip()
        if line == "ready":
            return learner, worker
        learner.kill()
        worker.kill()
        _, errors = learner.communicate(timeout=10)
        assert "Address already in use" in errors, f"the learner ended before it was ready: {errors}"
    raise AssertionError(f"no free address in {attempts} attempts")


LEARNER_GONE = {
    # Its end of the connection closes: lost after interval * liveness, about 1 s.
    "killed": (signal.SIGKILL, "has been silent for 1.0 s and its end of the connection is closed"),
    # Frozen: it accepts connections (its kernel does) but answers no ZMTP heartbeat. The connection
    # drops after interval * liveness, stays down as long, one reconnect fails as long: about 3.2 s.
    "stopped": (signal.SIGSTOP, "has not answered heartbeats after 1 reconnects"),
}


@pytest.mark.parametrize(("sig", "reason"), LEARNER_GONE.values(), ids=LEARNER_GONE)
def test_external_worker_exits_when_its_learner_dies(spawn, sig, reason):
    learner, worker = start_learner_and_worker(spawn)
    learner.send_signal(sig)
    assert worker.wait(timeout=20) == LEARNER_LOST_EXIT_CODE
    assert reason in worker.stderr.read()


# -- Ray ------------------------------------------------------------------------------------
def descendants(pid: int) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for parent in frontier for child in child_pids(parent)} - found
        found |= frontier
    return found


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance for the module; all of its processes must be gone afterwards."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    spawned = descendants(os.getpid())
    ray.shutdown()
    assert wait_until(lambda: not any(pid_alive(pid) for pid in spawned), timeout=30), "Ray processes outlived shutdown"


@pytest.mark.xdist_group("ray")
def test_ray_actors_serve_the_envs_and_are_replaced_when_killed(ray_cluster):
    from clusterenv.launch.ray import RayLauncher

    launcher = RayLauncher(num_cpus_per_worker=1)
    with (
        ClusterEnv(ENV_FNS, num_workers=2, launcher=launcher, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(ENV_FNS)) as reference,
    ):
        assert envs.address.startswith("tcp://127.0.0.1:")
        pids = [info["pid"] for info in envs.worker_info]
        assert not set(pids) & child_pids()  # Ray's processes, not ours
        run_lockstep(envs, reference, steps=20)

        os.kill(pids[1], signal.SIGKILL)
        *_, truncations, infos = envs.step(reference.action_space.sample())
        assert truncations[2:].all() and infos["worker_restarted"].tolist() == [False, False, True, True]
        replacement = envs.worker_info[1]["pid"]
        assert replacement not in pids
        envs.step(reference.action_space.sample())
    assert wait_until(lambda: not any(pid_alive(pid) for pid in [pids[0], replacement]), timeout=30)


def test_external_worker_is_replaced_by_whoever_joins_next(spawn):
    address = free_address()
    first, second = spawn(worker_command(address)), spawn(worker_command(address))
    with ClusterEnv(
        ENV_FNS,
        num_workers=2,
        bind=address,
        secret=SECRET,
        launcher="external",
        on_worker_failure="restart",
        heartbeat=FAST,
    ) as envs:
        envs.reset(seed=0)
        lost = envs.worker_info[1]["pid"]
        os.kill(lost, signal.SIGKILL)
        replacement = spawn(worker_command(address))  # e.g. a supervising loop around `srun`
        *_, truncations, infos = envs.step(envs.action_space.sample())
        assert infos["worker_restarted"].tolist() == [False, False, True, True] and truncations[2:].all()
        assert envs.worker_info[1]["pid"] == replacement.pid
        envs.step(envs.action_space.sample())
    assert {first.wait(timeout=10), second.wait(timeout=10), replacement.wait(timeout=10)} == {0, -signal.SIGKILL}
