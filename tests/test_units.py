"""Units: an entry of ``env_fns`` may make a vector env, which fills as many slots as it has envs.

A ``ClusterEnv`` of units returns exactly what stepping the same units in one process and
concatenating their results returns (infos split per env and merged the Gymnasium way), in
every autoreset mode the units support; a unit is always stepped whole by one worker.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import signal
from contextlib import closing
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.wrappers.vector import DictInfoToList

from clusterenv import ClusterEnv
from clusterenv.errors import RemoteEnvError
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import assert_same, counting_step_messages, pid_alive, wait_until
from tests.envs import NestedInfoCartPole

# EnvPool's classic-control spaces are made from float64 bounds, and Gymnasium warns as it casts them.
pytestmark = pytest.mark.filterwarnings("ignore:.*precision lowered by casting to float32:UserWarning")

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
FAST = Heartbeat(interval=0.1, liveness=5)


def cartpoles(count: int, mode: AutoresetMode = AutoresetMode.NEXT_STEP) -> SyncVectorEnv:
    return SyncVectorEnv([functools.partial(gym.make, "CartPole-v1")] * count, autoreset_mode=mode)


needs_envpool = pytest.mark.skipif(importlib.util.find_spec("envpool") is None, reason="EnvPool is not installed")


def envpool_make(*args: Any, **kwargs: Any) -> VectorEnv:
    return importlib.import_module("envpool").make(*args, **kwargs)


def envpool_cartpoles(count: int, seed: int) -> VectorEnv:
    return envpool_make("CartPole-v1", env_type="gymnasium", num_envs=count, seed=seed)


class Concatenated:
    """The reference: the same units stepped in this process, their results concatenated in slot order.

    Each unit's infos are split per env by Gymnasium's own ``DictInfoToList`` and merged with
    Gymnasium's own ``VectorEnv._add_info`` at the envs' slot indices; flags are read as booleans
    and rewards as float64, as a ``VectorEnv`` batch holds them.
    """

    def __init__(self, units: list[VectorEnv]) -> None:
        self.units = [DictInfoToList(unit) for unit in units]
        self.sizes = [unit.num_envs for unit in units]
        self.merger = SyncVectorEnv([lambda: gym.make("CartPole-v1")])  # only for its _add_info
        self.merger.num_envs = sum(self.sizes)

    def _merge(self, per_unit_infos: list[list[dict[str, Any]]]) -> dict[str, Any]:
        infos: dict[str, Any] = {}
        offset = 0
        for unit_infos, size in zip(per_unit_infos, self.sizes, strict=True):
            for i, info in enumerate(unit_infos):
                if info:
                    infos = self.merger._add_info(infos, info, offset + i)
            offset += size
        return infos

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        results, offset = [], 0
        mask = None if options is None else options.get("reset_mask")
        for unit, size in zip(self.units, self.sizes, strict=True):
            mine = None if mask is None else mask[offset : offset + size]
            if mine is not None and not mine.any():  # its observations stay those of its last step
                results.append((self._last[len(results)], [{}] * size))
            else:
                unit_options = None if mine is None or mine.all() else {"reset_mask": mine}
                results.append(unit.reset(seed=None if seed is None else seed + offset, options=unit_options))
            offset += size
        self._last = [obs for obs, _ in results]
        return np.concatenate(self._last), self._merge([infos for _, infos in results])

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        results, offset = [], 0
        for unit, size in zip(self.units, self.sizes, strict=True):
            results.append(unit.step(actions[offset : offset + size]))
            offset += size
        self._last = [r[0] for r in results]
        return (
            np.concatenate([r[0] for r in results]),
            np.concatenate([r[1] for r in results]).astype(np.float64),
            np.concatenate([r[2] for r in results]).astype(np.bool_),
            np.concatenate([r[3] for r in results]).astype(np.bool_),
            self._merge([r[4] for r in results]),
        )

    def close(self) -> None:
        for unit in self.units:
            unit.close()


def run_lockstep(reference: Any, candidate: ClusterEnv, steps: int, seed: int | None, mode: AutoresetMode) -> int:
    """Drive both with the same actions, asserting equal results; how many episodes ended."""
    assert_same(reference.reset(seed=seed), candidate.reset(seed=seed))
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(steps):
        actions = rng.integers(0, candidate.single_action_space.n, candidate.num_envs)
        expected = reference.step(actions)
        assert_same(expected, candidate.step(actions))
        done = expected[2] | expected[3]
        episodes += int(done.sum())
        if mode is AutoresetMode.DISABLED and done.any():
            options = {"reset_mask": done}
            assert_same(reference.reset(options=dict(options)), candidate.reset(options=dict(options)))
    return episodes


# -- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_sync_vector_env_units_equal_the_units_concatenated(mode):
    sizes = [3, 2, 4]  # 3 + 2 on worker 0, 4 on worker 1: units of unequal sizes
    fns = [functools.partial(cartpoles, k, mode) for k in sizes]
    with ClusterEnv(fns, num_workers=2) as candidate, closing(Concatenated([fn() for fn in fns])) as reference:
        assert candidate.num_envs == 9
        assert candidate.metadata["autoreset_mode"] is mode and candidate.autoreset_mode is mode
        assert candidate.single_observation_space == cartpoles(1).single_observation_space
        assert candidate.observation_space == cartpoles(9).observation_space
        assert candidate.action_space == cartpoles(9).action_space
        assert [w["units"] for w in candidate.worker_info] == [[(0, 2), (3, 4)], [(5, 8)]]
        assert [w["step_path"] for w in candidate.worker_info] == ["shared memory"] * 2
        episodes = run_lockstep(reference, candidate, 300, seed=11, mode=mode)
    assert episodes >= 10, "the run must cross episode boundaries to test autoreset"


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_units_with_nested_numeric_infos_equal_the_units_concatenated_with_no_message_per_step(mode):
    # Worker 0 packs the infos of its two units from their per-env records, worker 1 its one unit's whole.
    fns = [functools.partial(SyncVectorEnv, [NestedInfoCartPole] * k, autoreset_mode=mode) for k in (3, 2, 4)]
    with (
        counting_step_messages() as messages,
        ClusterEnv(fns, num_workers=2) as candidate,
        closing(Concatenated([fn() for fn in fns])) as reference,
    ):
        assert [w["step_path"] for w in candidate.worker_info] == ["shared memory"] * 2
        episodes = run_lockstep(reference, candidate, 200, seed=11, mode=mode)
    assert episodes >= 10
    # In SAME_STEP mode a step that ends an episode carries ``final_obs``: a message. No other step needs one.
    assert messages.count <= messages.without_one_per_step(2) + (episodes if mode is AutoresetMode.SAME_STEP else 0)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared step path", "messages"])
def test_a_unit_at_slot_offset_k_is_seeded_s_plus_k_so_units_equal_one_sync_vector_env(shared_memory):
    # A SyncVectorEnv unit seeded s gives its envs s, s + 1, ...: the units side by side are
    # then exactly one SyncVectorEnv over all the envs.
    fns = [functools.partial(cartpoles, k) for k in (2, 3, 3)]
    with ClusterEnv(fns, num_workers=2, shared_memory=shared_memory) as candidate, closing(cartpoles(8)) as flat:
        assert run_lockstep(flat, candidate, 200, seed=5, mode=AutoresetMode.NEXT_STEP) >= 10


@needs_envpool
def test_envpool_units_equal_the_same_envpools_concatenated():
    # EnvPool takes its seed when it is made; reset(seed=...) is ignored by EnvPool (it warns, in
    # the worker): the envs are those of their construction seeds, whatever reset's seed is.
    fns = [functools.partial(envpool_cartpoles, 4, seed) for seed in (0, 4, 8)]
    with (
        counting_step_messages() as messages,
        ClusterEnv(fns, num_workers=2) as candidate,
        closing(Concatenated([fn() for fn in fns])) as reference,
    ):
        assert candidate.num_envs == 12
        assert candidate.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
        assert candidate.single_observation_space == reference.units[0].single_observation_space
        assert candidate.observation_space.shape == (12, 4)
        assert_same(reference.reset(), candidate.reset(seed=123))
        rng = np.random.default_rng(1)
        episodes = 0
        for _ in range(300):
            actions = rng.integers(0, 2, 12)
            expected = reference.step(actions)
            assert_same(expected, candidate.step(actions))
            episodes += int((expected[2] | expected[3]).sum())
    assert episodes >= 10
    # EnvPool's infos (``env_id``, ``players``: {``env_id``}, ``elapsed_step``) go in the region's info rows.
    assert messages.count <= messages.without_one_per_step(2)


@needs_envpool
def test_envpool_units_seeded_s_plus_k_equal_one_envpool():
    # The EnvPool recipe seeds the unit at slot k with s + k: together they are one EnvPool seeded s.
    with (
        ClusterEnv([functools.partial(envpool_cartpoles, 3, 7), functools.partial(envpool_cartpoles, 3, 10)]) as units,
        closing(envpool_cartpoles(6, 7)) as one,
    ):
        obs, _ = units.reset()
        np.testing.assert_array_equal(obs, one.reset()[0])
        for t in range(100):
            actions = np.full(6, t % 2)
            np.testing.assert_array_equal(units.step(actions)[0], one.step(actions)[0])


@needs_envpool
def test_envpool_pong_units_equal_the_same_envpools_concatenated():
    fns = [functools.partial(envpool_make, "Pong-v5", env_type="gymnasium", num_envs=2, seed=s) for s in (0, 2)]
    with (
        counting_step_messages() as messages,
        ClusterEnv(fns, num_workers=2) as candidate,
        closing(Concatenated([fn() for fn in fns])) as reference,
    ):
        assert candidate.observation_space.shape == (4, 4, 84, 84)
        assert_same(reference.reset(), candidate.reset())
        rng = np.random.default_rng(2)
        for _ in range(60):
            actions = rng.integers(0, 6, 4)
            assert_same(reference.step(actions), candidate.step(actions))
    # Atari's infos, 128 bytes of ``ram`` and a nested ``players`` among them, go in the info rows.
    assert messages.count <= messages.without_one_per_step(2)


def test_single_envs_and_units_mix_when_their_autoreset_modes_agree():
    fns = [
        functools.partial(gym.make, "CartPole-v1"),
        functools.partial(cartpoles, 3),
        functools.partial(gym.make, "CartPole-v1"),
    ]
    with ClusterEnv(fns, num_workers=2) as candidate, closing(cartpoles(5)) as flat:
        assert [w["units"] for w in candidate.worker_info] == [[(0, 0), (1, 3)], [(4, 4)]]
        run_lockstep(flat, candidate, 100, seed=3, mode=AutoresetMode.NEXT_STEP)


# -- what is refused --------------------------------------------------------------------------------
def test_units_with_different_autoreset_modes_are_refused_naming_the_entries():
    fns = [functools.partial(cartpoles, 2), functools.partial(cartpoles, 2, AutoresetMode.SAME_STEP)]
    with pytest.raises(ValueError, match=r"one autoreset mode .* NextStep for entries 0; SameStep for entries 1\."):
        ClusterEnv(fns, num_workers=2)
    with pytest.raises(ValueError, match=r"`autoreset_mode` is SameStep, but the vector envs of entries 0, 1"):
        ClusterEnv([functools.partial(cartpoles, 2)] * 2, num_workers=1, autoreset_mode="SameStep")
    single_and_unit = [
        functools.partial(gym.make, "CartPole-v1"),
        functools.partial(cartpoles, 2, AutoresetMode.SAME_STEP),
    ]
    with pytest.raises(ValueError, match=r"single envs of entries 0 autoreset in NextStep.*autoreset_mode='SameStep'"):
        ClusterEnv(single_and_unit, num_workers=1)


def acrobots(count: int) -> SyncVectorEnv:
    return SyncVectorEnv([functools.partial(gym.make, "Acrobot-v1")] * count)


def test_units_with_different_spaces_are_refused_naming_the_entries():
    fns = [functools.partial(cartpoles, 2), functools.partial(cartpoles, 2), functools.partial(acrobots, 2)]
    with pytest.raises(ValueError, match=r"same single observation space; entry 0 has Box.*entries 2 differ"):
        ClusterEnv(fns, num_workers=2)


class MislabelledUnit(VectorEnv):
    """Says its observations have 3 numbers; they have 4."""

    def __init__(self) -> None:
        self.num_envs = 2
        self.single_observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.observation_space = self.single_observation_space
        self.single_action_space = self.action_space = spaces.Discrete(2)
        self.metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return np.zeros((2, 4), dtype=np.float32), {}


def test_a_unit_whose_outputs_disagree_with_its_spaces_is_refused():
    with ClusterEnv([MislabelledUnit], num_workers=1) as envs:
        expected = (
            "`env_fns[0]` made a vector env whose reset returned observations of shape (2, 4) and dtype float32, "
            "but its single observation space Box(-1.0, 1.0, (3,), float32) and num_envs=2 expect shape (2, 3)"
        )
        with pytest.raises(ValueError, match=re.escape(expected)) as raised:
            envs.reset()
        assert isinstance(raised.value, RemoteEnvError)


class ShortRewardsUnit(MislabelledUnit):
    """Observations that fit its spaces, but one reward for its two envs."""

    def __init__(self) -> None:
        super().__init__()
        self.single_observation_space = self.observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)

    def step(self, actions: Any) -> tuple[Any, ...]:
        return np.zeros((2, 4), dtype=np.float32), np.zeros(1), np.zeros(2, bool), np.zeros(2, bool), {}


def test_a_unit_whose_step_returns_too_few_rewards_is_refused():
    with ClusterEnv([ShortRewardsUnit], num_workers=1) as envs:
        envs.reset()
        expected = (
            "`env_fns[0]` made a vector env of num_envs=2 whose step returned rewards of shape (1,), expected (2,)."
        )
        with pytest.raises(ValueError, match=re.escape(expected)):
            envs.step(np.zeros(2, dtype=np.int64))


def test_per_env_seeds_must_count_up_within_a_unit():
    with ClusterEnv([functools.partial(cartpoles, 2)] * 2, num_workers=2) as envs:
        envs.reset(seed=[1, 2, None, None])  # a run, and all None: fine
        with pytest.raises(ValueError, match=r"its envs were given the seeds \[1, 5\], expected \[1, 2\]"):
            envs.reset(seed=[1, 5, 3, 4])


def test_units_need_their_own_worker_process_and_errors_that_raise():
    with pytest.raises(TypeError, match=r"made a vector env \(SyncVectorEnv\).*procs_per_worker=1"):
        ClusterEnv([functools.partial(cartpoles, 2)] * 2, num_workers=1, procs_per_worker=2)
    with pytest.raises(ValueError, match=r"include vector envs, which on_env_error='reset' cannot rebuild"):
        ClusterEnv([functools.partial(cartpoles, 2)] * 2, num_workers=1, on_env_error="reset")


def test_first_ready_needs_equal_units_per_worker():
    with pytest.raises(ValueError, match=r"the vector envs in `env_fns` give the workers \[3, 5\] envs"):
        ClusterEnv([functools.partial(cartpoles, 3), functools.partial(cartpoles, 5)], num_workers=2, batch_size=4)


# -- everything else, for units ------------------------------------------------------------------
def test_first_ready_recv_returns_whole_units():
    fns = [functools.partial(cartpoles, 3)] * 4  # two units of 3 per worker
    with ClusterEnv(fns, num_workers=2, batch_size=6) as envs, closing(cartpoles(12)) as flat:
        flat_obs, _ = flat.reset(seed=0)
        envs.async_reset(seed=0)
        for _ in range(20):
            obs, rewards, terminations, truncations, infos, env_ids = envs.recv()
            assert sorted(env_ids.tolist()) in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
            envs.send(np.zeros(6, dtype=np.int64), env_ids)
        envs.recv()
        envs.recv()


def test_a_lost_worker_rebuilds_its_units_whole_and_flags_their_envs_cut_once():
    fns = [functools.partial(cartpoles, 2), functools.partial(cartpoles, 3)]
    with ClusterEnv(fns, num_workers=2, on_worker_failure="restart", heartbeat=FAST) as envs:
        envs.reset(seed=1)
        envs.step(np.zeros(5, dtype=np.int64))
        old = envs.worker_info[1]["pid"]
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(old), timeout=5)
        obs, rewards, terminations, truncations, infos = envs.step(np.zeros(5, dtype=np.int64))
        assert truncations.tolist() == [False, False, True, True, True]
        assert infos["worker_restarted"].tolist() == [False, False, True, True, True]
        assert envs.worker_info[1]["pid"] != old and envs.worker_info[1]["units"] == [(2, 4)]
        obs, rewards, *_, infos = envs.step(np.zeros(5, dtype=np.int64))  # NEXT_STEP: the units' reset step
        assert "worker_restarted" not in infos
        assert rewards[2:].tolist() == [0.0, 0.0, 0.0]
        assert np.all(np.abs(obs[2:]) <= 0.05)  # CartPole's first observations


def test_a_rehomed_worker_takes_its_units_whole_to_a_survivor():
    fns = [functools.partial(cartpoles, 2), functools.partial(cartpoles, 3)]
    with ClusterEnv(fns, num_workers=2, on_worker_failure="rehome", heartbeat=FAST) as envs:
        envs.reset(seed=1)
        old = envs.worker_info[1]["pid"]
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(old), timeout=5)
        obs, rewards, terminations, truncations, infos = envs.step(np.zeros(5, dtype=np.int64))
        assert infos["worker_restarted"].tolist() == [False, False, True, True, True]
        survivor = next(w for w in envs.worker_info if w["state"] == "active")
        assert survivor["units"] == [(0, 1), (2, 4)] and survivor["env_ids"] == [0, 1, 2, 3, 4]
        obs, rewards, *_, infos = envs.step(np.zeros(5, dtype=np.int64))
        assert "worker_restarted" not in infos and rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_policy_runner_acts_on_units_as_on_the_same_single_envs():
    torch = pytest.importorskip("torch")
    from clusterenv import PolicyRunner
    from clusterenv.policy.strategies import EveryUpdate

    batches = []
    for fns in (
        [functools.partial(cartpoles, 2), functools.partial(cartpoles, 3)],
        [functools.partial(gym.make, "CartPole-v1")] * 5,
    ):
        with ClusterEnv(fns, num_workers=2) as envs:
            envs.reset(seed=3)
            torch.manual_seed(0)
            runner = PolicyRunner(envs, torch.nn.Linear(4, 2), EveryUpdate(), seed=0)
            batches.append([dataclasses.asdict(runner.rollout(30)) for _ in range(2)])
    assert_same(batches[0], batches[1])


# -- EnvPool on every host -----------------------------------------------------------------------
@needs_envpool
def test_envpool_recipe_builds_one_envpool_per_worker_equal_to_one_envpool():
    from clusterenv.cores import usable_cores

    vector_kwargs = {"units": "envpool", "num_workers": 2}
    with clusterenv_make_vec("CartPole-v1", 9, vector_kwargs, seed=3) as envs, closing(envpool_cartpoles(9, 3)) as one:
        assert [w["units"] for w in envs.worker_info] == [[(0, 4)], [(5, 8)]]
        # Local workers share this host's cores: each EnvPool takes half (at most one thread per env).
        threads = envs.apply(lambda pool: pool.config["num_threads"])
        assert threads == (min(max(1, usable_cores() // 2), 5),) * 5 + (min(max(1, usable_cores() // 2), 4),) * 4
        assert_same(envs.reset()[0], one.reset()[0])
        for t in range(200):
            actions = np.full(9, t % 2)
            got, expected = envs.step(actions), one.step(actions)
            assert_same(got[:4], (expected[0], expected[1].astype(np.float64), expected[2], expected[3]))


def test_envpool_recipe_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match=r"`vector_kwargs\['units'\]` must be 'envpool', got 'ray'"):
        clusterenv_make_vec("CartPole-v1", 4, {"units": "ray"})
    with pytest.raises(ValueError, match=r"`wrappers` cannot be applied"):
        clusterenv_make_vec("CartPole-v1", 4, {"units": "envpool"}, wrappers=[gym.wrappers.RecordEpisodeStatistics])
    with pytest.raises(ValueError, match=r"`num_workers` must be an int between 1 and num_envs=4, got 5"):
        clusterenv_make_vec("CartPole-v1", 4, {"units": "envpool", "num_workers": 5})


def clusterenv_make_vec(*args: Any, **kwargs: Any) -> ClusterEnv:
    import clusterenv

    return clusterenv.make_vec(*args, **kwargs)


@needs_envpool
def test_envpool_recipe_on_another_host_uses_that_hosts_cores():
    from tests import netns
    from tests.test_remote import FAST as REMOTE_FAST
    from tests.test_remote import SECRET

    if reason := netns.unavailable():
        pytest.skip(f"no other host here: {reason}")
    from clusterenv.cores import usable_cores

    with netns.other_host() as host, netns.external_workers(host, 2, SECRET) as address:
        vector_kwargs = {
            "units": "envpool",
            "num_workers": 2,
            "bind": address,
            "secret": SECRET,
            "launcher": "external",
            "heartbeat": REMOTE_FAST,
        }
        with (
            clusterenv_make_vec("CartPole-v1", 8, vector_kwargs, seed=5) as envs,
            closing(envpool_cartpoles(8, 5)) as one,
        ):
            assert [w["host"] for w in envs.worker_info] == [host.hostname] * 2
            # One worker per host: each EnvPool takes every core of its host (at most one thread per env).
            assert envs.apply(lambda pool: pool.config["num_threads"]) == (min(usable_cores(), 4),) * 8
            assert_same(envs.reset()[0], one.reset()[0])
            for t in range(100):
                actions = np.full(8, t % 2)
                np.testing.assert_array_equal(envs.step(actions)[0], one.step(actions)[0])


# -- a unit's infos, packed whole -----------------------------------------------------------------
def _masked(*rows: int) -> np.ndarray:
    return np.array([i in rows for i in range(6)])


UNIT_INFOS = {
    "EnvPool's (no masks, nested)": {
        "env_id": np.arange(6, dtype=np.int32),
        "players": {"env_id": np.arange(6, dtype=np.int32)},
        "elapsed_step": np.zeros(6, dtype=np.int32),
    },
    "masks, a key first seen late": {
        "late": np.arange(6.0),
        "_late": _masked(3, 4),
        "early": np.arange(6, dtype=np.int64),
        "_early": _masked(0, 5),
    },
    "nested masks inside a mask": {
        "outer": {"x": np.ones((6, 2), dtype=np.float32), "_x": _masked(1, 2, 3)},
        "_outer": _masked(2, 3, 4),
    },
    "no env has an info": {"x": np.zeros(6), "_x": _masked()},
    "objects and booleans (records)": {"name": np.array(["a"] * 6, dtype=object), "ok": np.ones(6, dtype=bool)},
    "a list per env (SuperSuit's)": [{"a": 1}, {}, {"a": 2, "b": "x"}, {}, {}, {}],
}


@pytest.mark.parametrize("infos", UNIT_INFOS.values(), ids=UNIT_INFOS.keys())
def test_a_units_infos_pack_to_what_their_per_env_records_pack_to(infos):
    from clusterenv.wire.infos import BatchedInfoLog, pack_infos, split_infos

    log = BatchedInfoLog()
    log.add(0, 6, infos)
    records = [(i, info) for i, info in enumerate(split_infos(infos, 6)) if info]
    assert_same(list(log), records)
    assert bool(log) == bool(records)
    # Gymnasium infos of numbers pack array by array; anything else packs from its records.
    packs_whole = isinstance(infos, dict) and "ok" not in infos
    assert (log.columns(6) is not None) == packs_whole
    assert_same(pack_infos(log, 6), pack_infos(records, 6))
    assert_same(pack_infos(log, 6, min_envs=1), pack_infos(records, 6, min_envs=1))


EVERY_ENV_INFOS = {
    "EnvPool's": UNIT_INFOS["EnvPool's (no masks, nested)"],
    "Gymnasium's, masks all set": {
        "outer": {"x": np.ones((6, 2), dtype=np.float32), "_x": _masked(*range(6))},
        "_outer": _masked(*range(6)),
        "t": np.arange(6),
        "_t": _masked(*range(6)),
    },
}


@pytest.mark.parametrize("infos", EVERY_ENV_INFOS.values(), ids=EVERY_ENV_INFOS.keys())
def test_a_units_numeric_infos_that_every_env_reports_go_in_the_info_rows(infos):
    from clusterenv.wire.infos import BatchedInfoLog, pack_infos
    from clusterenv.wire.step_region import INFO_BYTES, info_layout, read_infos, write_infos

    log = BatchedInfoLog()
    log.add(0, 6, infos)
    payload = pack_infos(log, 6, min_envs=1)
    layout = info_layout(payload)
    assert layout is not None
    rows = np.zeros((6, INFO_BYTES), np.uint8)
    write_infos(rows, payload)  # type: ignore[arg-type]
    assert read_infos(rows, layout) == payload
