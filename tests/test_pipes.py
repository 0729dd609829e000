"""Local workers on pipes: the same results as on the ZeroMQ socket, large messages both ways, and no hang."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq
from gymnasium.vector import SyncVectorEnv
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterenv import ClusterEnv, WorkerLostError, WorkerTimeoutError
from clusterenv.launch.launchers import LocalLauncher
from clusterenv.wire.pipes import LearnerPipes, Pipe, PipeClosed, pipe_pair
from tests.conftest import assert_same, child_pids
from tests.envs import SpriteEnv

MB = 1 << 20


def run_both(envs, reference, steps: int) -> None:
    assert_same(envs.reset(seed=3), reference.reset(seed=3))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        actions = rng.integers(0, 4, envs.num_envs)
        assert_same(envs.step(actions), reference.step(actions))


@pytest.mark.parametrize("pipes", [True, False], ids=["pipes", "zmq"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared", "frames"])
def test_local_workers_give_what_sync_gives_on_pipes_and_on_the_socket(pipes, shared_memory):
    """Replies of ~1 MB per worker (64x 96x96x3 frames without shared memory) outgrow the pipe's buffer."""
    fns = [functools.partial(SpriteEnv, 96)] * 8
    with ClusterEnv(fns, num_workers=2, launcher=LocalLauncher(pipes=pipes), shared_memory=shared_memory) as envs:
        assert bool(envs.pool._channel.pipes) is pipes
        run_both(envs, SyncVectorEnv(fns), 40)


def test_a_large_command_and_a_large_reply_crossing_do_not_wait_on_each_other():
    """The learner's end never blocks: what the kernel does not take waits until the learner reads."""
    ours, theirs = pipe_pair()
    context = zmq.Context()
    learner = LearnerPipes(context.socket(zmq.PULL), lambda: None, 64 * MB)  # no ZeroMQ peer: only the pipe speaks
    learner.add(ours)
    worker = Pipe(theirs, 64 * MB, blocking=True)
    worker.write([b"worker-0"])  # its routing id
    command, reply = np.arange(4 * MB, dtype=np.uint64), np.arange(3 * MB, dtype=np.uint32)
    received = {}

    def worker_side() -> None:
        worker.write([b"header", memoryview(reply)])  # blocks until the learner reads it
        received["command"] = worker.read(10_000)

    assert learner.recv(200) is None  # takes the routing id, which is no message
    thread = threading.Thread(target=worker_side, daemon=True)
    thread.start()
    learner.send(b"worker-0", [b"header", memoryview(command)])  # returns at once, most of it queued
    identity, frames = learner.recv(10_000)
    assert identity == b"worker-0" and bytes(frames[0]) == b"header"
    assert np.array_equal(np.frombuffer(frames[1], np.uint32), reply)
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        learner.recv(50)  # flushes the queued command while waiting
    thread.join(1)
    assert not thread.is_alive(), "the worker never received the learner's command"
    assert np.array_equal(np.frombuffer(received["command"][1], np.uint64), command)
    learner.close()
    worker.close()
    context.destroy(linger=0)


def test_a_record_announcing_more_than_the_limit_closes_the_pipe_before_allocating():
    ours, theirs = pipe_pair()
    reader = Pipe(ours, max_record_bytes=MB, blocking=True)
    theirs.sendall(np.array([1], "<u4").tobytes() + np.array([1 << 40], "<u8").tobytes())
    with pytest.raises(PipeClosed, match="announced"):
        reader.read(5_000)
    theirs.close()


def test_a_worker_whose_learner_is_gone_reads_a_closed_pipe():
    ours, theirs = pipe_pair()
    worker = Pipe(theirs, MB, blocking=True)
    ours.close()
    with pytest.raises(PipeClosed):
        worker.read(5_000)


def test_a_frozen_worker_cannot_hang_the_learner_with_a_large_command():
    """The command waits in the learner's queue; the step times out as on the socket."""
    fns = [functools.partial(SpriteEnv, 96)] * 2
    with ClusterEnv(fns, num_workers=2, timeout=2.0) as envs:
        envs.reset(seed=0)
        frozen = envs.worker_info[1]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises((WorkerTimeoutError, WorkerLostError)):
                envs.call("set_wrapper_attr", "payload", np.zeros(16 * MB, np.uint8))  # ~16 MB to each worker
            assert time.monotonic() - started < 30
        finally:
            with contextlib.suppress(ProcessLookupError):  # closing after the error killed it
                os.kill(frozen, signal.SIGCONT)


def test_pipe_ends_are_not_inherited_by_processes_env_code_starts():
    """The launcher passes the child its end explicitly; nothing else, and no grandchild, gets either end."""
    ours, theirs = pipe_pair()
    assert not os.get_inheritable(ours.fileno()) and not os.get_inheritable(theirs.fileno())
    ours.close()
    theirs.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("batch_scheduling", [True, False])
def test_local_workers_and_their_env_processes_are_batch_scheduled_unless_asked_otherwise(batch_scheduling):
    launcher = LocalLauncher(batch_scheduling=batch_scheduling)
    with ClusterEnv(
        [functools.partial(SpriteEnv, 16)] * 4, num_workers=2, procs_per_worker=2, launcher=launcher
    ) as envs:
        workers = [info["pid"] for info in envs.worker_info]
        env_processes = [pid for worker in workers for pid in child_pids(worker)]
        assert len(env_processes) == 4
        expected = os.SCHED_BATCH if batch_scheduling else os.SCHED_OTHER
        assert [os.sched_getscheduler(pid) for pid in workers + env_processes] == [expected] * 6


def test_encrypted_learners_keep_local_workers_on_the_encrypted_socket():
    with ClusterEnv([functools.partial(SpriteEnv, 16)] * 2, num_workers=2, encrypt=True) as envs:
        assert envs.pool._channel.pipes is None
        run_both(envs, SyncVectorEnv([functools.partial(SpriteEnv, 16)] * 2), 5)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.binary(max_size=3000), min_size=1, max_size=5), min_size=1, max_size=6))
def test_records_arrive_whole_and_in_order(records):
    ours, theirs = pipe_pair()
    writer, reader = Pipe(ours, MB, blocking=True), Pipe(theirs, MB, blocking=True)
    try:
        for frames in records:
            writer.write(frames)
        assert [[bytes(f) for f in reader.read(5_000)] for _ in records] == records
        assert reader.read(0) is None
    finally:
        writer.close()
        reader.close()


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_garbage_on_a_pipe_is_refused_or_waited_for_never_misread(garbage):
    """A record is returned only when its table adds up; anything else closes the pipe or waits for more."""
    ours, theirs = pipe_pair()
    reader = Pipe(theirs, 4096, blocking=True)
    try:
        ours.sendall(garbage)
        try:
            record = reader.read(0)
        except PipeClosed:
            return
        if record is not None:
            assert sum(len(frame) for frame in record) + 12 + 8 * len(record) <= len(garbage)
    finally:
        ours.close()
        reader.close()


def test_a_read_without_waiting_takes_what_has_arrived():
    """A worker polls for new weights between the steps of a rollout: a record already sent must be returned."""
    ours, theirs = pipe_pair()
    writer, reader = Pipe(ours, MB, blocking=True), Pipe(theirs, MB, blocking=True)
    try:
        assert reader.read(0) is None
        writer.write([b"weights"])
        time.sleep(0.05)
        assert [bytes(f) for f in reader.read(0)] == [b"weights"]
    finally:
        writer.close()
        reader.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/fdinfo"), reason="reads /proc")
def test_a_worker_marks_its_end_close_on_exec_so_env_code_cannot_pass_it_on():
    with ClusterEnv([functools.partial(SpriteEnv, 16)] * 2, num_workers=2) as envs:
        for worker in envs.worker_info:
            with open(f"/proc/{worker['pid']}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            fd = int(argv[argv.index(b"--connect") + 1].decode().removeprefix("pipe://"))
            with open(f"/proc/{worker['pid']}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            assert flags & os.O_CLOEXEC


def test_wake_ups_and_a_record_larger_than_one_read_arrive_in_order():
    """The learner's wake-ups (records of no frames) keep their place around a record read in several chunks."""
    ours, theirs = pipe_pair()
    writer, reader = Pipe(ours, MB, blocking=False), Pipe(theirs, MB, blocking=True)
    large = bytes(range(256)) * 2400  # 600 KB: more than one read's chunk
    try:
        writer.write_wake()
        writer.write([b"head", large])
        writer.write_wake()
        received = []
        deadline = time.monotonic() + 10
        while len(received) < 3 and time.monotonic() < deadline:
            writer.flush()  # a non-blocking end sends what the kernel takes, as the learner's poll does
            record = reader.read(20)
            if record is not None:
                received.append([bytes(frame) for frame in record])
        assert received == [[], [b"head", large], []]
        assert not writer.pending
    finally:
        writer.close()
        reader.close()


@pytest.fixture
def worker_end():
    """A learner's non-blocking end writing to a worker's blocking end."""
    ours, theirs = pipe_pair()
    writer, reader = Pipe(ours, MB, blocking=False), Pipe(theirs, MB, blocking=True)
    yield writer, reader
    writer.close()
    reader.close()


def test_a_worker_between_steps_takes_wake_ups_alone_and_leaves_nothing_behind(worker_end):
    writer, reader = worker_end
    writer.write_wake()
    writer.write_wake()
    time.sleep(0.05)
    assert reader.await_wakes(1000) is True
    assert reader.read(0) is None


@pytest.mark.parametrize("wake_first", [True, False], ids=["a wake-up, then a record", "a record alone"])
def test_a_record_that_comes_while_a_worker_waits_for_wake_ups_is_read_whole_and_in_order(worker_end, wake_first):
    writer, reader = worker_end
    if wake_first:
        writer.write_wake()
    writer.write([b"close"])
    writer.write_wake()
    time.sleep(0.05)
    assert reader.await_wakes(1000) is False
    expected = [[], [b"close"], []] if wake_first else [[b"close"], []]
    assert [[bytes(f) for f in reader.read(0)] for _ in expected] == expected
    assert reader.await_wakes(0) is None  # nothing left: the wait times out


def test_a_worker_waiting_for_wake_ups_leaves_the_end_of_the_stream_to_its_read(worker_end):
    writer, reader = worker_end
    writer.close()
    assert reader.await_wakes(1000) is False
    with pytest.raises(PipeClosed):
        reader.read(0)
