"""Workers the learner starts on its own host step through shared memory: exactly, chosen per worker, recovered.

A plain step of such a worker is its actions written into a shared region and one wake-up
byte each way (``clusterenv.wire.step_region``); everything else keeps the message path.
"""

from __future__ import annotations

import _thread
import functools
import os
import signal
import threading
import time
from contextlib import closing
from types import SimpleNamespace
from unittest import mock

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterenv import ClusterEnv, ProtocolError
from clusterenv.launch.launchers import LocalLauncher
from clusterenv.learner import lockstep
from clusterenv.learner.membership import Membership
from clusterenv.learner.recycling import Recycle
from clusterenv.learner.shared_steps import NOT_YET, SharedSteps
from clusterenv.wire import step_region
from clusterenv.wire.carriers import PipeCarrier
from clusterenv.wire.infos import merge_infos, pack_infos
from clusterenv.wire.liveness import Heartbeat
from clusterenv.wire.pipes import WOKEN, Pipe, pipe_pair
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.step_region import (
    DONE,
    INFO_BYTES,
    MESSAGE,
    STEPPING,
    WORKER_WAITS,
    StepRegion,
    attach_rows,
    check_layout,
    info_layout,
    read_infos,
    scalar_infos,
    write_infos,
)
from clusterenv.wire.transport import WAKE_UP
from tests.conftest import assert_same, counting_step_messages, kill_mid_step, pid_alive, wait_until
from tests.envs import (
    CountingEnv,
    NestedInfoCartPole,
    ScalarInfoCartPole,
    SlowCartPole,
    SparseInfoRichEnv,
    StallingCountingEnv,
    TextObsEnv,
)
from tests.test_equivalence import MODES, run_lockstep
from tests.test_first_ready import alone, env_obs, env_row

CARTPOLES = [functools.partial(gym.make, "CartPole-v1")] * 4
ACTION_KINDS = ["discrete", "box", "multidiscrete", "multibinary", "tuple", "dict"]


def step_paths(envs: ClusterEnv) -> list[str]:
    return [worker["step_path"] for worker in envs.worker_info]


# -- which workers -------------------------------------------------------------------------------
def test_workers_the_learner_starts_on_its_host_step_through_shared_memory():
    with ClusterEnv(CARTPOLES, num_workers=2) as envs:
        assert step_paths(envs) == ["shared memory", "shared memory"]


@pytest.mark.parametrize(
    "options",
    [
        {"shared_memory": False},
        {"procs_per_worker": 2},
        {"launcher": LocalLauncher(pipes=False)},
        {"encrypt": True},
    ],
    ids=["shared_memory=False", "env processes", "no pipes", "encrypted"],
)
def test_other_workers_keep_the_message_path_and_stay_exact(options):
    with (
        ClusterEnv(CARTPOLES, num_workers=2, **options) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert step_paths(envs) == ["messages", "messages"]
        run_lockstep(reference, envs, steps=60, seed=3)


def test_a_cpu_that_may_reorder_memory_keeps_every_worker_on_the_message_path(monkeypatch):
    """The words rely on x86's memory order: elsewhere (ARM) nobody steps through the region, and results stay exact."""
    monkeypatch.setattr(step_region, "ORDERED_MEMORY", False)
    with (
        ClusterEnv(CARTPOLES, num_workers=2) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert step_paths(envs) == ["messages", "messages"]
        run_lockstep(reference, envs, steps=30, seed=4)


def test_spaces_without_an_array_form_keep_the_message_path():
    with ClusterEnv([TextObsEnv] * 2, num_workers=2) as envs:
        assert step_paths(envs) == ["messages", "messages"]


# -- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("action_kind", ACTION_KINDS)
def test_steps_through_shared_memory_are_bit_identical_to_sync_vector_env(mode, action_kind):
    """Dict/Tuple observations of every leaf kind, every action kind, steps with and without infos."""
    env_fns = [functools.partial(SparseInfoRichEnv, action_kind)] * 5  # uneven: 3 and 2 envs
    with (
        ClusterEnv(env_fns, num_workers=2, autoreset_mode=mode) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert step_paths(envs) == ["shared memory", "shared memory"]
        episodes = run_lockstep(reference, envs, steps=120, seed=11)
    assert episodes >= 10, "the run must cross episode boundaries to test autoreset"


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_cartpole_through_shared_memory_is_bit_identical_to_sync_vector_env(mode):
    with (
        ClusterEnv(CARTPOLES, num_workers=2, autoreset_mode=mode) as envs,
        closing(SyncVectorEnv(CARTPOLES, autoreset_mode=mode)) as reference,
    ):
        assert run_lockstep(reference, envs, steps=300, seed=2) >= 10


def test_step_async_and_step_wait_take_the_same_path():
    with (
        ClusterEnv(CARTPOLES, num_workers=2) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=4), envs.reset(seed=4))
        for t in range(40):
            actions = np.array([t % 2, 1, 0, (t // 3) % 2])
            envs.step_async(actions)
            assert_same(reference.step(actions), envs.step_wait())


def record_batch(records: list[list], batch: tuple) -> np.ndarray:
    """Append each row of a first-ready batch to its env's records; the batch's env ids."""
    obs, rewards, terminations, truncations, infos, env_ids = batch
    for row, i in enumerate(env_ids):
        records[i].append(
            (
                env_obs(obs, row),
                float(rewards[row]),
                bool(terminations[row]),
                bool(truncations[row]),
                env_row(infos, row),
            )
        )
    return env_ids


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_first_ready_batches_through_shared_memory_are_exact(mode):
    env_fn = functools.partial(SparseInfoRichEnv, "discrete")
    num_envs, seed = 6, 9
    records: list[list] = [[] for _ in range(num_envs)]
    actions: list[list] = [[] for _ in range(num_envs)]
    with ClusterEnv([env_fn] * num_envs, num_workers=3, autoreset_mode=mode, batch_size=2) as envs:
        assert step_paths(envs) == ["shared memory"] * 3
        envs.async_reset(seed=seed)
        for round_ in range(45):
            env_ids = record_batch(records, envs.recv())
            chosen = np.array([(round_ + int(i)) % 3 for i in env_ids])
            for row, i in enumerate(env_ids):
                actions[i].append(int(chosen[row]))
            envs.send(chosen, env_ids)
        for _ in range(3):  # what is still in flight: one worker's envs per batch
            record_batch(records, envs.recv())
    for i in range(num_envs):
        expected = alone(env_fn, seed + i, actions[i], mode)
        for t, (got, want) in enumerate(zip(records[i], expected, strict=True)):
            assert_same(want, got, f"env {i}, step {t}")


def test_what_step_returns_does_not_change_when_the_next_step_writes_the_region():
    with ClusterEnv(CARTPOLES, num_workers=2) as envs:
        envs.reset(seed=0)
        first = envs.step(np.array([0, 1, 0, 1]))
        kept = [np.array(part, copy=True) for part in first[:4]]
        second = envs.step(np.array([1, 0, 1, 0]))
        for part, copy in zip(first[:4], kept, strict=True):
            assert_same(part, copy)
        assert not np.array_equal(first[0], second[0])


def test_copy_false_returns_the_batch_in_the_region_itself():
    with ClusterEnv(CARTPOLES, num_workers=2, copy=False) as envs:
        envs.reset(seed=0)
        first = envs.step(np.array([0, 1, 0, 1]))[0]
        second = envs.step(np.array([1, 0, 1, 0]))[0]
        assert first is second  # one buffer, written by the workers at each step


def test_a_step_interrupted_by_ctrl_c_is_finished_by_step_wait():
    slow = [functools.partial(SlowCartPole, 0.3)] * 2
    with (
        ClusterEnv(slow, num_workers=2) as envs,
        closing(SyncVectorEnv(slow)) as reference,
    ):
        assert_same(reference.reset(seed=1), envs.reset(seed=1))
        pids = [w["pid"] for w in envs.worker_info]
        timer = threading.Timer(0.1, _thread.interrupt_main)
        try:
            for pid in pids:  # frozen, so that the step is surely still in flight when Ctrl-C comes
                os.kill(pid, signal.SIGSTOP)
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.array([0, 1]))
            timer.join()
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        with pytest.raises(AlreadyPendingCallError):
            envs.reset()
        assert_same(reference.step(np.array([0, 1])), envs.step_wait())
        assert_same(reference.step(np.array([1, 1])), envs.step(np.array([1, 1])))


# -- faults --------------------------------------------------------------------------------------
def test_a_killed_worker_is_replaced_and_its_replacement_steps_through_shared_memory():
    with (
        ClusterEnv(CARTPOLES, num_workers=2, on_worker_failure="restart") as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=5)[0], envs.reset(seed=5)[0])
        for t in range(3):
            assert_same(reference.step(np.array([t % 2] * 4))[0], envs.step(np.array([t % 2] * 4))[0])
        [victim] = kill_mid_step(envs, np.array([1, 0, 1, 0]), [1])
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        ref_obs, ref_rewards, *_ = reference.step(np.array([1, 0, 1, 0]))
        assert_same(obs[:2], ref_obs[:2])
        assert truncations[2:].tolist() == [True, True] and rewards[2:].tolist() == [0.0, 0.0]
        assert infos["worker_restarted"].tolist() == [False, False, True, True]
        assert wait_until(lambda: not pid_alive(victim), timeout=5)
        assert step_paths(envs) == ["shared memory", "shared memory"]
        assert envs.worker_info[1]["pid"] != victim
        for t in range(5):  # worker 0's envs go on exactly; the replacement's fresh envs step
            obs, rewards, *_ = envs.step(np.array([t % 2] * 4))
            assert_same(obs[:2], reference.step(np.array([t % 2] * 4))[0][:2])
            assert envs.single_observation_space.contains(obs[3])


def test_a_recycled_worker_steps_through_shared_memory_again():
    with ClusterEnv(CARTPOLES, num_workers=2, recycle=Recycle(after_env_steps=10)) as envs:
        envs.reset(seed=0)
        pids = [w["pid"] for w in envs.worker_info]
        for t in range(8):
            envs.step(np.array([t % 2] * 4))
        assert [w["pid"] for w in envs.worker_info] != pids
        assert step_paths(envs) == ["shared memory", "shared memory"]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kill_at=st.integers(min_value=0, max_value=12),
    victim=st.integers(min_value=0, max_value=1),
    in_flight=st.booleans(),
)
def test_a_worker_killed_at_any_point_cuts_only_its_own_episodes(kill_at, victim, in_flight):
    """Against SyncVectorEnv: the survivor's envs are exact throughout; the victim's report one cut, then go on."""
    mine = slice(2 * victim, 2 * victim + 2)
    theirs = slice(2 - 2 * victim, 4 - 2 * victim)
    with (
        ClusterEnv(CARTPOLES, num_workers=2, on_worker_failure="restart") as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert_same(reference.reset(seed=kill_at)[0], envs.reset(seed=kill_at)[0])
        cuts = 0
        for t in range(16):
            actions = np.array([(t + i) % 2 for i in range(4)])
            pid = envs.worker_info[victim]["pid"]
            if t == kill_at and not in_flight:
                os.kill(pid, signal.SIGKILL)
                assert wait_until(lambda pid=pid: not pid_alive(pid), timeout=5)
            envs.step_async(actions)
            if t == kill_at and in_flight:
                os.kill(pid, signal.SIGKILL)
            obs, rewards, terminations, truncations, infos = envs.step_wait()
            expected = reference.step(actions)
            for got, want in zip((obs, rewards, terminations, truncations), expected[:4], strict=True):
                assert_same(got[theirs], want[theirs])
            if "worker_restarted" in infos:
                cuts += 1
                assert infos["_worker_restarted"][mine].all() and not infos["_worker_restarted"][theirs].any()
                assert truncations[mine].all()
        assert cuts == 1
        assert step_paths(envs) == ["shared memory", "shared memory"]


# -- the protocol, at the learner's seam ------------------------------------------------------------
class _Channel:
    """What SharedSteps needs of a channel: wake sockets that record what was sent."""

    def __init__(self) -> None:
        self.woken: list[bytes] = []
        self.passed: list[tuple[int, bytes]] = []

    def can_wake(self, peer):
        return peer is not None

    def pass_fd(self, fd, to):
        self.passed.append((fd, to))

    def waker(self, to):
        return lambda: self.woken.append(to)


def _path() -> tuple[SharedSteps, StepRegion, _Channel]:
    region = StepRegion(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2), [slice(0, 2), slice(2, 4)])
    members = SimpleNamespace(identities={0: b"w0", 1: b"w1"}, serving={0: 0, 1: 1})
    channel = _Channel()
    path = SharedSteps(region, channel, members, timeout=1.0)  # type: ignore[arg-type]
    for w in (0, 1):
        offer = path.offer(w)
        assert offer is not None and offer.kind is Kind.SHARE_STEP
        path.joined(w, SimpleNamespace(kind=Kind.VALUE, meta={"attached": True}))  # type: ignore[arg-type]
    return path, region, channel


def _reply(region: StepRegion, worker: int, counter: int, status: int) -> None:
    region.workers[worker].reply[1] = status
    region.workers[worker].reply[0] = counter


def test_a_command_wakes_its_worker_only_while_the_worker_sleeps():
    path, region, channel = _path()
    path.send(0, [np.array([1, 0])], call=7)
    assert channel.woken == [] and region.workers[0].actions[0].tolist() == [1, 0]  # a spinning worker reads it
    region.workers[1].reply[WORKER_WAITS] = 1  # worker 1 is about to block
    path.send(1, [np.array([0, 1])], call=7)
    assert channel.woken == [b"w1"]


def test_a_reply_is_read_only_when_its_counter_is_the_commands_and_its_status_is_final():
    path, region, _ = _path()
    path.send(0, [np.array([1, 0])], call=7)
    counter = int(region.workers[0].command[0])
    assert path.reply(0) is NOT_YET  # not begun
    _reply(region, 0, counter, STEPPING)
    assert path.reply(0) is NOT_YET  # begun: its previous observations are saved, no results yet
    _reply(region, 0, counter, DONE)
    reply = path.reply(0)
    assert reply is not NOT_YET and reply is not None
    assert reply.kind is Kind.RESULT and reply.meta == {"seq": 7}


def test_an_older_counter_is_a_reply_still_to_come():
    path, region, _ = _path()
    path.send(1, [np.array([0, 1])], call=3)
    _reply(region, 1, int(region.workers[1].command[0]) - 1, DONE)
    assert path.reply(1) is NOT_YET and path.woken(1) is None


class _StartingWorker:
    """A worker's reply words that start its next step (STEPPING, then its counter) the moment one word is read."""

    def __init__(self, words, counter: int, start_on: int) -> None:
        self.words, self.counter, self.start_on = words, counter, start_on

    def __getitem__(self, index: int) -> int:
        value = self.words[index]
        if index == self.start_on:  # as the worker writes them: its status, then its counter
            self.words[1], self.words[0] = STEPPING, self.counter
        return value


@pytest.mark.parametrize("first_read", [0, 1], ids=["counter read first", "status read first"])
def test_the_previous_steps_final_status_is_never_taken_for_the_step_in_flight(first_read):
    """The worker may start the step between the learner's two reads of its words: its last status is not this one's."""
    path, region, _ = _path()
    path.send(0, [np.array([1, 0])], call=3)
    _reply(region, 0, int(region.workers[0].command[0]), DONE)  # the first step answered
    path.all_taken()
    path.send(0, [np.array([0, 1])], call=4)
    rows = region.workers[0]
    with mock.patch.object(rows, "reply", _StartingWorker(rows.reply, int(rows.command[0]), start_on=first_read)):
        assert path.final_status(0) is None
    assert path.final_status(0) is None  # it is stepping
    _reply(region, 0, int(rows.command[0]), DONE)
    assert path.final_status(0) == DONE


@pytest.mark.parametrize(
    "counter_offset, status, what",
    [(1, DONE, "counter ahead"), (0, 0, "cleared status"), (0, 99, "unknown status")],
)
def test_a_reply_no_worker_of_ours_writes_is_a_protocol_error_naming_the_worker(counter_offset, status, what):
    path, region, _ = _path()
    path.send(1, [np.array([0, 1])], call=3)
    _reply(region, 1, int(region.workers[1].command[0]) + counter_offset, status)
    with pytest.raises(ProtocolError, match="Worker 1"):
        path.woken(1)


def test_a_wake_up_that_finds_no_reply_is_only_a_hint():
    path, region, _ = _path()
    _reply(region, 0, 0, DONE)
    assert path.woken(0) is None  # nothing in flight: a byte left over from a race
    path.send(0, [np.array([1, 1])], call=4)
    assert path.woken(0) is None  # in flight, not answered yet


def test_a_reply_message_completes_the_step_whether_it_or_the_status_comes_first():
    path, region, _ = _path()
    for status_first in (True, False):
        path.send(0, [np.array([1, 1])], call=5)
        counter = int(region.workers[0].command[0])
        if status_first:
            _reply(region, 0, counter, MESSAGE)
            assert path.woken(0) is None  # the message is the reply
        message = SimpleNamespace(kind=Kind.RESULT, meta={"seq": 5, "step": counter}, blobs=[b"infos"])
        result = path.completed(0, message)  # type: ignore[arg-type]
        assert result.blobs == [b"infos"]
        path.taken(0, result)
        assert not path.in_flight(0) and path.woken(0) is None
    message = SimpleNamespace(kind=Kind.RESULT, meta={"seq": 5, "step": 99}, blobs=[b""])
    with pytest.raises(ProtocolError, match="Worker 0 .*no step in flight"):
        path.completed(0, message)  # type: ignore[arg-type]
    assert WAKE_UP.kind is Kind.WAKE_UP


def test_a_replacement_starts_from_a_cleared_slot():
    path, region, channel = _path()
    path.send(0, [np.array([1, 1])], call=2)
    _reply(region, 0, int(region.workers[0].command[0]), DONE)
    assert path.offer(0) is not None  # a new process for worker 0
    assert region.workers[0].command.tolist() == [0, 0, 0, 0] and region.workers[0].reply.tolist() == [0, 0, 0]
    assert not path.in_flight(0) and 0 not in path.on_path
    assert channel.passed[-1] == (region.fd, b"w0")


@pytest.mark.parametrize("began", [True, False], ids=["began", "not begun"])
def test_a_worker_lost_mid_step_leaves_the_observations_it_last_answered_with(began):
    path, region, _ = _path()
    rows = region.workers[0]
    rows.observations[0][...] = 2.0  # the last observations the learner received
    path.send(0, [np.array([1, 1])], call=2)
    if began:  # the worker saved them and began; its envs wrote the next ones, then it died
        rows.save_observations()
        _reply(region, 0, int(rows.command[0]), STEPPING)
    rows.observations[0][...] = 3.0 if began else 2.0
    assert path.offer(0) is not None  # its replacement
    assert rows.observations[0].tolist() == [[2.0] * 3] * 2


def test_an_interrupted_command_is_finished_with_the_same_counter():
    path, region, channel = _path()
    region.workers[0].reply[WORKER_WAITS] = 1
    with mock.patch.object(SharedSteps, "_publish", side_effect=KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        path.send(0, [np.array([1, 0])], call=9)
    assert region.workers[0].command[0] == 0 and channel.woken == []  # recorded, never written
    assert path.resume(0, call=9)
    assert region.workers[0].command.tolist()[:2] == [1, 9] and channel.woken == [b"w0"]
    assert path.resume(0, call=9)  # again (a wake-up lost meanwhile): the same command, woken again
    assert region.workers[0].command[0] == 1 and channel.woken == [b"w0", b"w0"]
    assert not path.resume(1, call=9)  # never recorded: the caller sends it whole


def test_a_worker_maps_the_region_only_if_its_own_spaces_give_the_same_layout():
    path, region, _ = _path()
    meta = region.meta(1, spin_us=None)
    obs, act = region.observation_space, region.action_space
    assert attach_rows(os.dup(region.fd), meta, obs, act) is not None
    assert attach_rows(os.dup(region.fd), meta, spaces.Box(-1, 1, (4,), np.float32), act) is None
    assert attach_rows(os.dup(region.fd), meta, obs, spaces.Discrete(3, start=1)) is not None  # same int64 leaf
    assert attach_rows(os.dup(region.fd), {**meta, "token": "00" * 16}, obs, act) is None
    assert attach_rows(os.dup(region.fd), {**meta, "stop": 9}, obs, act) is None


def test_the_region_is_an_anonymous_file_that_nothing_can_leave_behind():
    _, region, _ = _path()
    assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:clusterenv-steps")
    assert os.fstat(region.fd).st_nlink == 0


# -- infos in the region ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_infos_every_env_reports_at_every_step_are_exact_through_the_region(mode):
    env_fns = [ScalarInfoCartPole] * 6
    with (
        ClusterEnv(env_fns, num_workers=2, autoreset_mode=mode) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert run_lockstep(reference, envs, steps=200, seed=8) >= 10


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared step path", "messages"])
def test_nested_numeric_infos_are_exact_and_go_through_the_region(mode, shared_memory):
    env_fns = [NestedInfoCartPole] * 5  # uneven: 3 and 2 envs
    with (
        counting_step_messages() as messages,
        ClusterEnv(env_fns, num_workers=2, autoreset_mode=mode, shared_memory=shared_memory) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        episodes = run_lockstep(reference, envs, steps=200, seed=4)
    assert episodes >= 10
    if shared_memory:
        # In SAME_STEP mode a step that ends an episode carries ``final_obs``: a message. No other step needs one.
        assert messages.count <= messages.without_one_per_step(2) + (episodes if mode is AutoresetMode.SAME_STEP else 0)


NESTED_RECORDS = [
    (
        i,
        {
            "x": float(i) / 3,
            "players": {"env_id": np.int32(i), "deep": {"ok": i % 2 == 0, "pos": np.arange(3.0) * i}},
            "ram": np.full(128, i, dtype=np.uint8),
            "c": np.complex128(1j * i),
            "empty": {},
        },
    )
    for i in range(3)
]


@pytest.mark.parametrize(
    "records",
    [
        [(i, {"x": float(i) / 3, "n": i, "f": np.float32(i), "ok": i % 2 == 0, "l": np.int64(-i)}) for i in range(3)],
        NESTED_RECORDS,
    ],
    ids=["numbers", "nested dicts and arrays"],
)
def test_packed_infos_come_back_from_the_info_rows_exactly(records):
    payload = pack_infos(records, 3, min_envs=1)
    layout = info_layout(payload)
    assert layout is not None
    assert check_layout(msgpack.unpackb(msgpack.packb(layout))) == layout  # as the learner reads a worker's
    rows = np.zeros((3, INFO_BYTES), np.uint8)
    write_infos(rows, payload)  # type: ignore[arg-type]
    assert read_infos(rows, layout) == payload
    assert_same(merge_infos({}, read_infos(rows, layout), 3, 0), merge_infos({}, list(records), 3, 0))


@pytest.mark.parametrize(
    "records",
    [
        [(0, {"s": "text"}), (1, {"s": "text"})],  # an object
        [(0, {"p": {"s": "text"}}), (1, {"p": {"s": "text"}})],  # a nested object
        [(0, {"x": 1.0}), (1, {})],  # not every env
        [(0, {"p": {"x": 1.0}}), (1, {"p": {}})],  # not every env, nested
        [(0, {"v": np.zeros(INFO_BYTES // 8 + 1)}), (1, {"v": np.zeros(INFO_BYTES // 8 + 1)})],
        [
            (0, {f"k{j}": 1.0 for j in range(INFO_BYTES // 8 + 1)}),
            (1, {f"k{j}": 1.0 for j in range(INFO_BYTES // 8 + 1)}),
        ],
    ],
    ids=["object", "nested object", "not every env", "not every env, nested", "too many bytes", "too many keys"],
)
def test_infos_that_fit_no_layout_travel_as_messages(records):
    assert info_layout(pack_infos(records, 2, min_envs=1)) is None


@pytest.mark.parametrize(
    "layout",
    [
        [["x", "object", "d", []]],
        [["x", "float", "O", []]],
        [["x", "float", "d", [2]]],  # a scalar with a shape
        [["x", "ndarray", "d", [-1]]],
        [["x", "ndarray", "d", [INFO_BYTES // 8 + 1]]],  # more than the rows hold
        [["p", "dict", [["x", "float", "O", []]]]],
        [["p", "dict", "x"]],
        [["x", "float", "d"]],
        "x",
    ],
)
def test_a_layout_a_worker_names_is_checked(layout):
    with pytest.raises(ValueError, match="Not an info layout"):
        check_layout(layout)


SCALAR_RECORDS = [
    (i, {"x": float(i) / 3, "n": i, "f": np.float32(i), "ok": i % 2 == 0, "l": np.int64(-i)}) for i in range(3)
]


def test_scalar_infos_go_into_the_rows_and_come_out_as_the_packed_path_gives_them():
    layout = info_layout(pack_infos(SCALAR_RECORDS, 3, min_envs=1))
    scalars = scalar_infos(layout)  # type: ignore[arg-type]
    assert scalars is not None
    packed, direct = np.zeros((3, INFO_BYTES), np.uint8), np.zeros((3, INFO_BYTES), np.uint8)
    write_infos(packed, pack_infos(SCALAR_RECORDS, 3, min_envs=1))  # type: ignore[arg-type]
    assert scalars.write(scalars.rows(direct), SCALAR_RECORDS)
    np.testing.assert_array_equal(direct, packed)
    assert_same(scalars.batch(scalars.rows(direct)), merge_infos({}, list(SCALAR_RECORDS), 3, 0))


def _changed(row: int, **changes) -> list:
    return [(i, {**info, **changes} if i == row else info) for i, info in SCALAR_RECORDS]


@pytest.mark.parametrize(
    "records",
    [
        SCALAR_RECORDS[:2],  # an env reported nothing
        [SCALAR_RECORDS[1], SCALAR_RECORDS[0], SCALAR_RECORDS[2]],  # not in env order
        [(i, dict(reversed(list(info.items())))) for i, info in SCALAR_RECORDS],  # the keys in another order
        _changed(1, x=np.float64(0.5)),  # a numpy float where the layout has a Python float
        _changed(2, n=True),  # a bool where the layout has an int
        _changed(0, extra=1.0),  # a key the layout does not have
        _changed(2, n=2**70),  # an int that int64 cannot hold
    ],
    ids=["an env missing", "env order", "key order", "numpy for Python", "bool for int", "extra key", "too large"],
)
def test_infos_that_are_not_the_layouts_scalars_are_left_to_the_packed_path(records):
    scalars = scalar_infos(info_layout(pack_infos(SCALAR_RECORDS, 3, min_envs=1)))  # type: ignore[arg-type]
    assert scalars is not None
    rows = scalars.rows(np.zeros((3, INFO_BYTES), np.uint8))
    assert not scalars.write(rows, records)


def test_layouts_with_arrays_or_nested_dicts_have_no_scalar_fields():
    assert scalar_infos(info_layout(pack_infos(NESTED_RECORDS, 3, min_envs=1))) is None  # type: ignore[arg-type]
    zero_d = [(i, {"x": np.array(float(i))}) for i in range(2)]  # a 0-d array is an array, not a scalar
    assert scalar_infos(info_layout(pack_infos(zero_d, 2, min_envs=1))) is None  # type: ignore[arg-type]


def test_scalar_infos_every_worker_writes_are_the_batch_without_merging_slices():
    env_fns = [ScalarInfoCartPole] * 6
    with (
        mock.patch.object(lockstep, "merge_infos", wraps=merge_infos) as merges,
        ClusterEnv(env_fns, num_workers=2) as envs,
        closing(SyncVectorEnv(env_fns)) as reference,
    ):
        assert run_lockstep(reference, envs, steps=200, seed=3) >= 10
    assert merges.call_count == 0


class _PositionInfo(gym.Wrapper):
    """CartPole reporting its position in an info, as the type it is given."""

    def __init__(self, as_type: type) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.as_type = as_type

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, reward, terminated, truncated, {"x": self.as_type(obs[0])}


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_workers_whose_scalars_differ_in_type_are_merged_as_sync_vector_env_batches_them(mode):
    env_fns = [functools.partial(_PositionInfo, t) for t in (float, float, np.float32, np.float32)]
    with (
        ClusterEnv(env_fns, num_workers=2, autoreset_mode=mode) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert run_lockstep(reference, envs, steps=150, seed=5) >= 5


def test_admitting_workers_keeps_the_shared_step_replies_it_reads_for_the_pool():
    """``rebalance()`` reads the channel for joins: a trailing wake-up or step message read there is the pool's."""
    wake_up, message = (b"w0", WAKE_UP), (b"w0", Message(Kind.RESULT, {"seq": 1, "step": 4}))
    stray = (b"w0", Message(Kind.VALUE, {"seq": 1}))
    arrivals = [wake_up, message, stray]
    channel = SimpleNamespace(recv=lambda timeout, routed: arrivals.pop(0) if arrivals else None)
    deferred: list = []
    members = Membership(
        1,
        [1],
        launcher=SimpleNamespace(),  # type: ignore[arg-type]
        channel=channel,  # type: ignore[arg-type]
        monitor=SimpleNamespace(),  # type: ignore[arg-type]
        heartbeat=Heartbeat(),
        defer=deferred.append,
    )
    members.peers[b"w0"] = 0
    members.admit(wait=0.01, seq=1)
    assert deferred == [wake_up, message]


def test_a_worker_takes_a_step_before_a_record_sent_after_it():
    """A CLOSE sent while a step is in flight comes after that step's wake-up: both travel on the pipe, in order."""
    learner, worker = pipe_pair()
    carrier = PipeCarrier(Pipe(worker, 1 << 20, blocking=True))
    try:
        ours = Pipe(learner, 1 << 20, blocking=False)
        ours.write_wake()
        ours.write([b"close"])
        assert carrier.recv(1000, routed=False) == (None, WOKEN)
        assert [bytes(frame) for frame in carrier.recv(1000, routed=False)[1]] == [b"close"]
    finally:
        carrier.close(0)
        learner.close()


def test_a_worker_waits_on_its_pipe_alone_within_the_bound_it_was_given():
    """Nothing sent: a wait of 0 returns at once, one of 200 ms returns after it; a wake-up then ends the next wait."""
    learner, worker = pipe_pair()
    carrier = PipeCarrier(Pipe(worker, 1 << 20, blocking=True))
    try:
        started = time.monotonic()
        assert carrier.recv(0, routed=False) is None
        assert carrier.recv(200, routed=False) is None
        assert 0.19 <= time.monotonic() - started < 5.0
        threading.Timer(0.05, Pipe(learner, 1 << 20, blocking=False).write_wake).start()
        assert carrier.recv(5000, routed=False) == (None, WOKEN)
    finally:
        carrier.close(0)
        learner.close()


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=["next_step", "same_step"])
def test_a_worker_killed_after_its_envs_wrote_the_next_observations_reports_the_last_received(mode):
    """The worker's envs wrote step 3's observations into the batch; it dies before replying: step 2's are reported."""
    env_fns = [functools.partial(StallingCountingEnv, 3)] * 2 + [CountingEnv] * 2
    with ClusterEnv(env_fns, num_workers=2, on_worker_failure="restart", autoreset_mode=mode) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            obs = envs.step(np.array([0, 0, 0, 0]))[0]
        assert obs[:, 0].tolist() == [2.0] * 4
        victim = envs.worker_info[0]["pid"]
        envs.step_async(np.array([0, 0, 0, 0]))
        time.sleep(1.0)  # worker 0 stalls pickling its infos, its observations written
        os.kill(victim, signal.SIGKILL)
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        assert infos["worker_restarted"].tolist() == [True, True, False, False]
        assert truncations[:2].all() and obs[2:, 0].tolist() == [3.0, 3.0]
        if mode is AutoresetMode.NEXT_STEP:
            assert obs[:2, 0].tolist() == [2.0, 2.0]  # the cut episodes end on the last observation received
        else:
            assert [final[0] for final in infos["final_obs"][:2]] == [2.0, 2.0]
            assert obs[:2, 0].tolist() == [0.0, 0.0]  # the replacement's new episodes
