"""A local worker that misbehaves cannot kill or hang its learner through the shared step path.

It holds the step region's file and one end of a wake socket (``clusterenv.wire.step_region``):
the file is sealed against resizing, so that no holder can pull pages from under the learner's
mapping (``SIGBUS``), and the learner's wake-ups never wait for a worker that does not read them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import zmq
from gymnasium import spaces

from clusterenv import ClusterEnv, ProtocolError
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.wire.pipes import LearnerPipes, Pipe, pipe_pair, wake_pair
from clusterenv.wire.protocol import Kind
from clusterenv.wire.step_region import WORKER_WAITS, StepRegion
from tests.conftest import wait_until

CARTPOLES = [functools.partial(gym.make, "CartPole-v1")] * 4
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1: no new writable mappings (not in Python's fcntl)
FULL = "its wake channel is full (it has not read the wake-ups sent to it"


def region() -> StepRegion:
    return StepRegion(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2), [slice(0, 2), slice(2, 4)])


# -- the region's size is sealed ---------------------------------------------------------------------
def test_no_holder_of_the_regions_file_can_resize_it():
    """Its own descriptor, or the file opened anew through /proc (as a worker can open its learner's)."""
    sealed = region()
    reopened = os.open(f"/proc/self/fd/{sealed.fd}", os.O_RDWR)
    try:
        for fd in (sealed.fd, reopened):
            for size in (0, sealed.size - 1, sealed.size + 1, 1 << 30):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            with pytest.raises(PermissionError):  # nor lift the seals, or add one that stops the learner writing
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        assert sealed.sealed and os.fstat(sealed.fd).st_size == sealed.size
        sealed.workers[1].observations[0][:] = 0.5  # the learner's mapping is whole: its pages are all there
        assert sealed.observations[2:].tolist() == [[0.5] * 3] * 2
    finally:
        os.close(reopened)
        sealed.close()


def test_a_worker_that_tries_to_resize_the_region_is_refused_and_the_learner_steps_on(tmp_path):
    """The envs' code of each worker tries it through /proc/<learner>/fd; the learner runs in a process of its own,
    so that a region that could be truncated kills that process (SIGBUS), not the test runner."""
    log = tmp_path / "attempts"
    learner = textwrap.dedent(
        """
        import functools, sys
        import gymnasium as gym
        import numpy as np
        from gymnasium.vector import SyncVectorEnv
        from clusterenv import ClusterEnv
        from tests.conftest import wait_until, assert_same
        from tests.envs import ResizingCartPole

        cartpoles = [functools.partial(gym.make, "CartPole-v1")] * 4
        with ClusterEnv([functools.partial(ResizingCartPole, sys.argv[1])] * 4, num_workers=2) as envs:
            reference = SyncVectorEnv(cartpoles)
            assert_same(reference.reset(seed=7), envs.reset(seed=7))
            for t in range(60):
                actions = np.array([t % 2, (t // 2) % 2, 1, 0])
                assert_same(reference.step(actions), envs.step(actions))
            print([worker["step_path"] for worker in envs.worker_info])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", learner, str(log)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"the learner exited with {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "['shared memory', 'shared memory']"
    attempts = log.read_text().splitlines()  # per env, per descriptor of the learner's (its mmap holds one too)
    assert len(attempts) >= 8 and set(attempts) == {f"{1 << 30} refused (EPERM)", "0 refused (EPERM)"}


# -- the learner's wake-ups never wait -----------------------------------------------------------------
def wake_until_refused(wake) -> tuple[BaseException | None, bool]:
    """Call ``wake()`` until it raises, in a thread given 10 s; what it raised, and whether it returned at all."""
    raised: list[BaseException] = []

    def keep_waking() -> None:
        try:
            for _ in range(10_000_000):
                wake()
        except BaseException as exc:  # noqa: BLE001 (whatever it is, the test reports it)
            raised.append(exc)

    thread = threading.Thread(target=keep_waking, daemon=True)
    thread.start()
    thread.join(10)
    return (raised[0] if raised else None), not thread.is_alive()


@pytest.fixture
def learner_pipes():
    """The learner's pipes with one worker, ``b"worker-0"``, whose wake socket nobody reads; and that socket."""
    ours, theirs = pipe_pair()
    wake_ours, wake_theirs = wake_pair()
    context = zmq.Context()
    pipes = LearnerPipes(context.socket(zmq.PULL), lambda: None, 1 << 20)
    pipes.add(ours, wake_ours)
    worker = Pipe(theirs, 1 << 20, blocking=True)
    worker.write([b"worker-0"])  # its routing id
    assert pipes.recv(200) is None  # takes the routing id, which is no message
    yield pipes, wake_theirs
    wake_theirs.close()  # a send that blocked (the defect) fails now, and its thread ends
    worker.close()
    pipes.close()
    context.destroy(linger=0)


def test_a_full_wake_channel_is_a_protocol_error_not_a_hang(learner_pipes):
    pipes, _ = learner_pipes
    error, returned = wake_until_refused(pipes.waker(b"worker-0"))
    assert returned, "the learner blocked on a wake socket its worker does not read"
    assert isinstance(error, ProtocolError) and FULL in str(error)
    error, returned = wake_until_refused(lambda: pipes.pass_fd(b"worker-0", 0))  # the region's file too
    assert returned and isinstance(error, ProtocolError) and FULL in str(error)
    assert pipes.has_wake(b"worker-0")  # a misbehaving worker is not a gone one: the caller decides


def test_a_full_wake_channel_names_the_worker(learner_pipes):
    pipes, _ = learner_pipes
    channel = SimpleNamespace(can_wake=pipes.has_wake, pass_fd=lambda fd, to: pipes.pass_fd(to, fd), waker=pipes.waker)
    members = SimpleNamespace(identities={0: b"w0", 1: b"worker-0"}, serving={0: 0, 1: 1})
    path = SharedSteps(region(), channel, members, timeout=1.0)  # type: ignore[arg-type]
    assert path.offer(1) is not None
    path.joined(1, SimpleNamespace(kind=Kind.VALUE, meta={"attached": True}))  # type: ignore[arg-type]
    path.region.workers[1].reply[WORKER_WAITS] = 1  # it says it sleeps, so each command wakes it; it never reads
    error, returned = wake_until_refused(lambda: path.send(1, [np.array([0, 1])], call=1))
    assert returned and isinstance(error, ProtocolError)
    assert str(error).startswith(f"Worker 1 cannot be woken: {FULL}")
    path.close()


def test_a_frozen_worker_whose_wake_channel_fills_fails_the_step_instead_of_hanging_it():
    """Worker 1 is stopped while the learner writes it wake-ups; the next step raises and closes the env."""
    with ClusterEnv(CARTPOLES, num_workers=2, timeout=10) as envs:
        envs.reset(seed=0)
        frozen = envs.worker_info[1]["pid"]
        # Blocked, having asked to be woken (a worker is woken only then): frozen so, it never reads its wake-ups.
        rows = envs.pool.step_path.region.workers[1]
        assert wait_until(lambda: rows.reply[WORKER_WAITS] == 1, timeout=10)
        os.kill(frozen, signal.SIGSTOP)
        try:
            error, returned = wake_until_refused(lambda: envs.pool.step_path.send(1, [np.array([0, 1])], call=0))
            assert returned and isinstance(error, ProtocolError) and str(error).startswith("Worker 1 cannot be woken")
            with pytest.raises(ProtocolError, match=r"^Worker 1 cannot be woken: its wake channel is full"):
                envs.step(np.array([0, 1, 0, 1]))
            assert envs.closed
        finally:
            with contextlib.suppress(ProcessLookupError):  # closing after the error killed it
                os.kill(frozen, signal.SIGCONT)
