"""With ``on_worker_failure="rehome"`` a lost worker's envs move to the surviving processes.

No process is started in its place: the local launcher is never asked for one. Every test
loses 2 of 8 workers (2 envs each) and checks that each env's trajectory is exact up to
its flagged cut, that no step is lost, and that nothing is left behind.
"""

from __future__ import annotations

import functools
import glob
import os
import signal
import tempfile
import threading
import time
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv, PolicyRunner, WorkerLostError
from clusterenv.launch.launchers import LocalLauncher
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import assert_same, child_pids, kill_mid_step, pid_alive, wait_until
from tests.envs import SlowCartPole
from tests.policies import linear_policy
from tests.test_remote import FAST as REMOTE_FAST
from tests.test_remote import SECRET, free_address, spawn, worker_command  # noqa: F401 (fixture)

FAST = Heartbeat(interval=0.1, liveness=10)  # a silent worker is lost after 1 s
NUM_ENVS, NUM_WORKERS = 16, 8
LOST = (2, 5)
# The envs of the lost workers: worker w steps envs 2w and 2w + 1.
MOVED = np.isin(np.arange(NUM_ENVS), [2 * w + k for w in LOST for k in (0, 1)])
# Alternating pushes keep CartPole balanced for well over 20 steps, so no episode ends by itself.
ACTIONS = [np.array([t % 2] * NUM_ENVS) for t in range(40)]
CARTPOLE = [functools.partial(gym.make, "CartPole-v1")] * NUM_ENVS


class NoReplacements(LocalLauncher):
    """The local launcher, forbidden to start a process once the workers are up."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        assert not self.started, f"asked to start workers {worker_ids} again"
        self.started = True
        super().start(worker_ids, address, key)


def rehoming(fns, **kwargs) -> ClusterEnv:
    kwargs.setdefault("heartbeat", FAST)
    return ClusterEnv(fns, num_workers=NUM_WORKERS, on_worker_failure="rehome", launcher=NoReplacements(), **kwargs)


def kill(envs: ClusterEnv, worker_ids=LOST) -> list[int]:
    pids = [envs.worker_info[w]["pid"] for w in worker_ids]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


def scratch_dirs() -> set[str]:
    """This learner's scratch directories (their names carry its pid, see clusterenv/wire/cleanup.py)."""
    found = set()
    for base in {tempfile.gettempdir(), "/dev/shm"}:
        found |= set(glob.glob(os.path.join(base, f"clusterenv-*{os.getpid()}-*")))
    return found


def assert_moved_evenly(envs: ClusterEnv, lost_pids: list[int]) -> None:
    """The lost processes are reported lost; each env is served once, by a survivor; none carries two extra slices."""
    info = {i["worker_id"]: i for i in envs.worker_info}
    assert [w for w, i in info.items() if i["state"] == "lost"] == list(LOST)
    assert all("exited with code -9" in info[w]["lost_because"] for w in LOST)
    served = sorted(e for i in info.values() for e in i["env_ids"])
    assert served == list(range(NUM_ENVS))
    assert max(len(i["env_ids"]) for i in info.values()) == 4
    assert all(not pid_alive(pid) for pid in lost_pids)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_two_of_eight_workers_killed_mid_step_move_their_envs_and_the_rest_stay_exact(mode):
    before = scratch_dirs()
    with (
        rehoming([functools.partial(SlowCartPole, 0.05)] * NUM_ENVS, autoreset_mode=mode) as envs,
        closing(SyncVectorEnv(CARTPOLE, autoreset_mode=mode)) as reference,
    ):
        workers = child_pids()
        assert_same(envs.reset(seed=3)[0], reference.reset(seed=3)[0])
        for t in range(4):
            obs, *_ = envs.step(ACTIONS[t])
            assert_same(obs, reference.step(ACTIONS[t])[0])
        last_obs = obs.copy()

        lost_pids = kill_mid_step(envs, ACTIONS[4], LOST)
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        ref_obs, ref_rewards, ref_terminations, ref_truncations, _ = reference.step(ACTIONS[4])

        kept = ~MOVED
        got_all, want_all = (
            (obs, rewards, terminations, truncations),
            (ref_obs, ref_rewards, ref_terminations, ref_truncations),
        )
        for got, want in zip(got_all, want_all, strict=True):
            assert_same(got[kept], want[kept])
        # The moved envs: the interrupted episode ends as a truncation, flagged, as a restart reports it.
        assert (rewards[MOVED] == 0).all() and not terminations[MOVED].any() and truncations[MOVED].all()
        assert infos["worker_restarted"].tolist() == MOVED.tolist()
        if mode is AutoresetMode.SAME_STEP:
            assert_same(list(infos["final_obs"][MOVED]), list(last_obs[MOVED]))
        else:
            assert_same(obs[MOVED], last_obs[MOVED])
        assert child_pids() == workers - set(lost_pids)  # no process started in their place
        assert_moved_evenly(envs, lost_pids)

        if mode is AutoresetMode.DISABLED:
            obs, _ = envs.reset(options={"reset_mask": MOVED})
            assert_same(obs[kept], ref_obs[kept])
        for t in range(5, 12):  # training goes on: the kept envs untouched, the moved ones in new episodes
            obs, rewards, terminations, truncations, infos = envs.step(ACTIONS[t])
            ref_obs, ref_rewards, *_ = reference.step(ACTIONS[t])
            assert_same(obs[kept], ref_obs[kept])
            assert_same(rewards[kept], ref_rewards[kept])
            assert "worker_restarted" not in infos
            assert envs.single_observation_space.contains(obs[MOVED][0].astype(np.float32))
            if t > 5 or mode is not AutoresetMode.NEXT_STEP:  # NEXT_STEP: the step after the cut is the reset
                assert (rewards[MOVED] == 1).all()
        assert envs.get_attr("spec")[4].id == "CartPole-v1"  # calls reach the moved envs too
    assert wait_until(lambda: not (scratch_dirs() - before), timeout=5)


def test_workers_lost_in_first_ready_mode_move_and_recv_reports_their_cut_episodes():
    with rehoming([functools.partial(SlowCartPole, 0.05)] * NUM_ENVS, batch_size=4) as envs:
        envs.async_reset(seed=0)
        for _ in range(NUM_WORKERS // 2):
            _, _, _, _, _, env_ids = envs.recv()
            envs.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
        lost_pids = kill(envs)
        steps = dict.fromkeys(range(NUM_ENVS), 0)
        cut = set()
        deadline = time.monotonic() + 30
        # Until every env has come back and each moved env's cut was reported: none is lost.
        while (cut != set(np.flatnonzero(MOVED).tolist()) or min(steps.values()) < 1) and time.monotonic() < deadline:
            obs, rewards, terminations, truncations, infos, env_ids = envs.recv()
            assert obs.shape == (4, 4)
            for row, env in enumerate(env_ids.tolist()):
                steps[env] += 1
                if "worker_restarted" in infos and infos["worker_restarted"][row]:
                    assert truncations[row] and rewards[row] == 0
                    cut.add(env)
            envs.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)
        assert cut == set(np.flatnonzero(MOVED).tolist())
        assert min(steps.values()) >= 1
        assert_moved_evenly(envs, lost_pids)


def rollouts(count: int, prefetch: int, lose_at: int | None) -> list:
    """``count`` rollouts of 20 steps; with ``lose_at``, 2 workers are killed 50 ms into that rollout.

    The policy is never updated and each env has its own generator, so lockstep and prefetched
    runners act alike: one run without losses is the reference for both.
    """
    envs = rehoming([functools.partial(SlowCartPole, 0.002)] * NUM_ENVS)
    try:
        envs.reset(seed=11)
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=prefetch)
        batches = []
        for i in range(count):
            if i == lose_at:
                timer = threading.Timer(0.05, kill, (envs,))
                timer.start()
            batches.append(runner.rollout(20))
            if i == lose_at:
                timer.join()
        if lose_at is not None:
            assert wait_until(lambda: len([w for w in envs.worker_info if w["state"] == "lost"]) == 2, timeout=5)
            batches.append(runner.rollout(20))
            assert_moved_evenly(envs, [])
        runner.stop()
        return batches
    finally:
        envs.close()


@functools.cache
def rollouts_without_losses() -> list:
    return rollouts(5, prefetch=0, lose_at=None)


@pytest.mark.parametrize("prefetch", [0, 1], ids=["lockstep", "prefetch"])
def test_workers_killed_mid_rollout_move_with_the_policy_and_the_other_envs_stay_exact(prefetch):
    baseline = rollouts_without_losses()
    batches = rollouts(4, prefetch, lose_at=2)
    cut_in = {}  # env -> the batch that reports its cut (the two workers' may differ: a prefetched
    # rollout that was complete before the kill is still delivered, and only the next one runs afresh)
    for i, batch in enumerate(batches):
        for t, info in enumerate(batch.infos):
            if "worker_restarted" in info:
                assert t == 0, "a cut is reported at the start of a batch"
                for env in np.flatnonzero(info["worker_restarted"]).tolist():
                    assert env not in cut_in, f"env {env}'s cut reported twice"
                    cut_in[env] = i
    assert sorted(cut_in) == np.flatnonzero(MOVED).tolist()  # every moved env's cut, and no other
    assert len(batches) == len(baseline) == 5
    for i, (got, want) in enumerate(zip(batches, baseline, strict=True)):
        exact = [env for env in range(NUM_ENVS) if env not in cut_in or i < cut_in[env]]  # up to each env's cut
        for name in ("obs", "actions", "rewards", "terminations", "truncations", "logprobs"):
            assert_same(getattr(got, name)[:, exact], getattr(want, name)[:, exact])
    assert all(b.obs.shape == (20, NUM_ENVS, 4) for b in batches)  # no step lost
    assert all((b.policy_versions == 0).all() for b in batches)  # the moved envs act with the current policy


def test_a_loss_that_leaves_fewer_than_min_workers_raises_naming_who_was_lost():
    with rehoming(CARTPOLE, min_workers=7) as envs:
        envs.reset(seed=0)
        kill(envs, [LOST[0]])
        envs.step(ACTIONS[0])  # 7 survive: the run goes on
        kill(envs, [LOST[1]])
        with pytest.raises(WorkerLostError, match=r"worker 5.*envs 10\.\.11.*exited with code -9.*min_workers=7"):
            envs.step(ACTIONS[1])
        assert envs.closed


def test_min_workers_must_be_between_one_and_num_workers():
    with pytest.raises(ValueError, match=r"`min_workers` must be between 1 and `num_workers` \(2\), got 3"):
        ClusterEnv(CARTPOLE[:4], num_workers=2, on_worker_failure="rehome", min_workers=3)


def test_two_workers_that_join_mid_run_take_envs_and_every_env_stays_exact_up_to_its_cut(spawn):  # noqa: F811 (the fixture)
    """Start with 4 worker processes for 6 workers' envs; 2 more connect; rebalance() spreads the load."""
    address = free_address()
    fns = [functools.partial(gym.make, "CartPole-v1")] * 12  # 6 workers of 2 envs
    first = [spawn(worker_command(address, "--worker-id", str(w))) for w in range(4)]
    with (
        ClusterEnv(
            fns,
            num_workers=6,
            bind=address,
            secret=SECRET,
            launcher="external",
            on_worker_failure="rehome",
            min_workers=4,
            start_timeout=8,  # the 4 started first join within it (under load too); the 2 others never do
            heartbeat=REMOTE_FAST,
        ) as envs,
        closing(SyncVectorEnv(fns)) as reference,
    ):
        started = {w["worker_id"]: w for w in envs.worker_info}
        assert sorted(started) == [0, 1, 2, 3] and [started[w]["serves"] for w in (0, 1)] == [[0, 4], [1, 5]]
        assert_same(envs.reset(seed=8), reference.reset(seed=8))
        for t in range(3):
            assert_same(envs.step(ACTIONS[t][:12]), reference.step(ACTIONS[t][:12]))
        last_obs = envs.step(ACTIONS[3][:12])[0]
        reference.step(ACTIONS[3][:12])

        late = [spawn(worker_command(address, "--worker-id", "4"))]
        moved: list[int] = []
        assert wait_until(lambda: moved.extend(envs.rebalance(wait=1.0)) or moved, timeout=30)
        assert moved == [4]  # the joiner that asked for id 4 takes worker 4's envs back
        late.append(spawn(worker_command(address)))  # one without an id: it takes the most loaded's guest
        assert wait_until(lambda: moved.extend(envs.rebalance(wait=1.0)) or len(moved) == 2, timeout=30), moved
        assert moved == [4, 5]
        described = {w["worker_id"]: w for w in envs.worker_info}
        assert all(w["state"] == "active" and len(w["env_ids"]) == 2 for w in described.values()), described
        assert {described[w]["pid"] for w in described} == {p.pid for p in first + late}
        assert described[4]["serves"] == [4]  # the joiner that asked for id 4 got worker 4's envs back

        cut = np.isin(np.arange(12), [8, 9, 10, 11])
        obs, rewards, terminations, truncations, infos = envs.step(ACTIONS[4][:12])
        ref_obs, ref_rewards, *_ = reference.step(ACTIONS[4][:12])
        assert_same(obs[~cut], ref_obs[~cut]) and assert_same(rewards[~cut], ref_rewards[~cut])
        assert truncations[cut].all() and (rewards[cut] == 0).all() and not terminations[cut].any()
        assert infos["worker_restarted"].tolist() == cut.tolist()
        assert_same(obs[cut], last_obs[cut])  # NEXT_STEP: the last observation received; the next step resets
        for t in range(5, 10):
            obs, rewards, _, _, infos = envs.step(ACTIONS[t][:12])
            ref_obs, ref_rewards, *_ = reference.step(ACTIONS[t][:12])
            assert_same(obs[~cut], ref_obs[~cut])
            assert "worker_restarted" not in infos and (rewards[cut] == (0 if t == 5 else 1)).all()
    assert all(p.wait(timeout=10) == 0 for p in first + late)


def test_rebalance_needs_rehome_and_no_call_in_flight():
    with ClusterEnv(CARTPOLE[:4], num_workers=2) as envs:
        with pytest.raises(ValueError, match="needs on_worker_failure='rehome', got 'raise'"):
            envs.rebalance()
    with rehoming(CARTPOLE, batch_size=8) as envs:
        assert envs.rebalance() == []  # nobody joined, and the load is even
        envs.async_reset(seed=0)
        with pytest.raises(AlreadyPendingCallError, match="Calling `rebalance` while 8 workers' envs are in flight"):
            envs.rebalance()


def test_hosts_that_come_back_take_their_envs_back_between_first_ready_batches(spawn):  # noqa: F811 (the fixture)
    address = free_address()
    with rehoming(CARTPOLE, batch_size=4, bind=address, secret=SECRET) as envs:
        envs.async_reset(seed=0)
        for _ in range(NUM_WORKERS // 2):
            envs.recv()
        for ids in np.arange(NUM_ENVS).reshape(-1, 4):
            envs.send(np.zeros(4, dtype=np.int64), ids)
        kill(envs)  # mid-step: their envs come back from recv() cut
        cut: set[int] = set()

        def cycle_until_cut() -> None:
            """recv/send until the moved envs' cut episodes are reported (each once); the other envs go on."""
            deadline = time.monotonic() + 30
            while cut != set(np.flatnonzero(MOVED).tolist()) and time.monotonic() < deadline:
                obs, rewards, _, truncations, infos, env_ids = envs.recv()
                if "worker_restarted" in infos:
                    assert truncations[infos["worker_restarted"]].all()
                    newly = env_ids[infos["worker_restarted"]].tolist()
                    assert not cut.intersection(newly)
                    cut.update(newly)
                envs.send(np.zeros(len(env_ids), dtype=np.int64), env_ids)

        cycle_until_cut()
        assert cut == set(np.flatnonzero(MOVED).tolist())  # moved to survivors, reported once
        back = [spawn(worker_command(address, "--worker-id", str(w))) for w in LOST]
        for _ in range(NUM_WORKERS // 2):  # nothing in flight: rebalance() runs between batches
            envs.recv()
        moved: list[int] = []
        assert wait_until(lambda: moved.extend(envs.rebalance(wait=1.0)) or len(moved) == 2, timeout=30), moved
        assert sorted(moved) == list(LOST)
        assert {w["worker_id"]: w["pid"] for w in envs.worker_info if w["worker_id"] in LOST} == {
            w: p.pid for w, p in zip(LOST, back, strict=True)
        }
        cut.clear()
        for ids in np.arange(NUM_ENVS).reshape(-1, 4):
            envs.send(np.zeros(4, dtype=np.int64), ids)
        cycle_until_cut()
        assert cut == set(np.flatnonzero(MOVED).tolist())  # moved home, reported once more
    assert all(p.wait(timeout=10) == 0 for p in back)


def test_a_rollout_after_rebalance_reports_the_moved_envs_cut_once(spawn):  # noqa: F811 (the fixture)
    address = free_address()
    fns = CARTPOLE[:4]
    with ClusterEnv(
        fns, num_workers=2, on_worker_failure="rehome", bind=address, secret=SECRET, heartbeat=FAST
    ) as envs:
        envs.reset(seed=0)
        kill(envs, [1])
        assert envs.step(ACTIONS[0][:4])[4]["worker_restarted"].tolist() == [False, False, True, True]
        back = spawn(worker_command(address, "--worker-id", "1"))
        moved: list[int] = []
        assert wait_until(lambda: moved.extend(envs.rebalance(wait=1.0)) or moved, timeout=30)
        assert moved == [1] and envs.worker_info[1]["pid"] == back.pid
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0)
        first, second = runner.rollout(5), runner.rollout(5)
        assert first.infos[0]["worker_restarted"].tolist() == [False, False, True, True]
        assert "worker_restarted" not in second.infos[0]
        assert "worker_restarted" not in envs.step(ACTIONS[1][:4])[4]  # the rollout reported the cut
    assert back.wait(timeout=10) == 0
