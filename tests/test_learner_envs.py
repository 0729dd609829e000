"""``ClusterEnv(learner_envs=k)``: the learner steps envs ``0..k-1`` itself, exactly as ``SyncVectorEnv`` would.

Everything a user does with the envs reaches those too (resets with seeds, options and masks,
attribute calls); what needs every env in a worker (first-ready batches, a ``PolicyRunner``)
is refused with a clear error. And an env behaves the same wherever it runs: its errors, its
warnings, what its attribute calls return and a Ctrl-C in its step are compared here between
env 0 in a worker (``learner_envs=0``) and env 0 in the learner.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import clusterenv
from clusterenv import ClusterEnv, PolicyRunner
from clusterenv.errors import remote_error_type
from tests.conftest import assert_same, kill_mid_step
from tests.envs import BoxInfoEnv, BrokenInitEnv, FailingEnv, FailingResetEnv, SparseInfoRichEnv, WarningEnv
from tests.test_equivalence import MODES, run_lockstep
from tests.test_interrupts import interrupt_at

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
LAYOUTS = {
    "1 worker, shared memory": {"num_workers": 1},
    "2 workers, messages": {"num_workers": 2, "shared_memory": False},
    "1 worker, 2 env processes": {"num_workers": 1, "procs_per_worker": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_learners_own_envs_step_bit_identically_to_sync_vector_env(mode, layout):
    """Dict/Tuple observations, infos that come and go: the learner's envs and the workers' merge as Sync's."""
    env_fns = [functools.partial(SparseInfoRichEnv, "dict")] * 6
    with (
        ClusterEnv(env_fns, learner_envs=3, autoreset_mode=mode, **layout) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert envs.learner_info["learner_envs"] == 3
        assert [w["env_ids"] for w in envs.worker_info][0][0] == 3  # the workers' envs follow the learner's
        assert run_lockstep(reference, envs, steps=120, seed=5) >= 10


def test_resets_with_options_masks_and_seeds_reach_the_learners_envs():
    with (
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert_same(reference.reset(seed=[1, 8, 3, 4]), envs.reset(seed=[1, 8, 3, 4]))
        for t in range(5):
            assert_same(reference.step(np.array([t % 2, 1, 0, 1])), envs.step(np.array([t % 2, 1, 0, 1])))
        mask = {"reset_mask": np.array([True, False, False, True])}
        assert_same(reference.reset(seed=9, options=dict(mask)), envs.reset(seed=9, options=dict(mask)))
        only_workers = {"reset_mask": np.array([False, False, True, False])}
        assert_same(reference.reset(options=dict(only_workers)), envs.reset(options=dict(only_workers)))
        assert_same(reference.step(np.array([1, 1, 1, 1])), envs.step(np.array([1, 1, 1, 1])))


def test_attribute_calls_reach_the_learners_envs_in_env_order():
    with ClusterEnv([CARTPOLE] * 5, learner_envs=2, num_workers=2) as envs:
        envs.reset(seed=0)
        assert envs.get_attr("np_random_seed") == (0, 1, 2, 3, 4)
        assert envs.get_attr("np_random_seed", indices=[4, 0, 2, 1]) == (4, 0, 2, 1)
        envs.set_attr("tag", ["a", "b", "c", "d", "e"])
        assert envs.get_attr("tag", indices=[1, 3]) == ("b", "d")
        envs.set_attr("tag", ["x", "y"], indices=[0, 4])
        assert envs.call("get_wrapper_attr", "tag") == ("x", "b", "c", "d", "y")
        assert envs.apply(lambda env: env.spec.id, indices=[1]) == ("CartPole-v1",)


def test_under_on_env_error_reset_an_error_of_theirs_ends_only_its_episode_as_in_a_worker():
    fns = [functools.partial(FailingEnv, 3)] * 2
    runs = []
    for learner_envs in (0, 1):
        with ClusterEnv(fns, learner_envs=learner_envs, num_workers=1, on_env_error="reset") as envs:
            envs.reset(seed=0)
            steps = [envs.step(np.zeros(2, dtype=np.int64)) for _ in range(4)]
            runs.append([(s[3].tolist(), sorted(k for k in s[4] if not k.startswith("_"))) for s in steps])
    assert runs[0] == runs[1]
    assert runs[0][2][0] == [True, True]  # each env's third step raised: its episode ended truncated


def test_a_lost_worker_is_replaced_while_the_learners_envs_go_on_exactly():
    with (
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1, on_worker_failure="restart") as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert_same(reference.reset(seed=7)[0], envs.reset(seed=7)[0])
        kill_mid_step(envs, np.array([0, 1, 0, 1]), [0])
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        expected = reference.step(np.array([0, 1, 0, 1]))
        assert_same(obs[:2], expected[0][:2]) and assert_same(rewards[:2], expected[1][:2])
        assert infos["worker_restarted"].tolist() == [False, False, True, True]


def test_make_vec_passes_learner_envs_through():
    with clusterenv.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"learner_envs": 2, "num_workers": 1}) as envs:
        assert envs.learner_envs == 2 and envs.num_workers == 1
        assert "learner_envs=2" in repr(envs)


def test_what_needs_every_env_in_a_worker_is_refused_clearly():
    with ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1) as envs:
        with pytest.raises(ValueError, match=r"First-ready batches \(async_reset/send/recv\): every env must be in a"):
            envs.async_reset(seed=0)
        envs.reset(seed=0)
        with pytest.raises(ValueError, match=r"the learner steps 2 envs itself \(`learner_envs=2`\): use `learner_"):
            PolicyRunner(envs, torch_policy(), clusterenv.Never())


@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            4,
            ValueError,
            "`learner_envs` must be between 0 and num_envs - 1 (3): the workers step at least one env, got 4.",
        ),
        (-1, ValueError, "got -1"),
        (1.5, TypeError, "`learner_envs` must be an integer, got float (1.5)."),
    ],
)
def test_bad_learner_envs_are_refused(value, error, match):
    with pytest.raises(error, match=re_escape(match)):
        ClusterEnv([CARTPOLE] * 4, learner_envs=value)


def test_batch_size_needs_learner_envs_zero():
    with pytest.raises(ValueError, match="need `learner_envs=0`"):
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, batch_size=2)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def torch_policy():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 2))


def test_the_learner_steps_single_envs_only():
    """A unit (a vector env) among the learner's entries is refused, naming the entry."""
    unit = functools.partial(gym.vector.SyncVectorEnv, [CARTPOLE] * 2)
    with pytest.raises(ValueError, match=r"entries \[1\] of `env_fns` make vector envs"):
        ClusterEnv([CARTPOLE, unit, CARTPOLE], learner_envs=2, num_workers=1)


def test_units_after_the_learners_envs_step_exactly():
    unit = functools.partial(gym.vector.SyncVectorEnv, [CARTPOLE] * 2)
    with (
        ClusterEnv([CARTPOLE, CARTPOLE, unit], learner_envs=2, num_workers=1) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert envs.num_envs == 4 and envs.worker_info[0]["units"] == [(2, 3)]
        assert run_lockstep(reference, envs, steps=100, seed=2) >= 3


# -- the same env wherever it runs: env 0 in a worker, or in the learner -------------------------
SIDES = {"env 0 in a worker": 0, "env 0 in the learner": 1}  # learner_envs
# (learner_envs, what the env's errors say of where it ran, its worker_id)
WHERE = {"env 0 in a worker": (0, "on worker 0", 0), "env 0 in the learner": (1, "in the learner", None)}
ZEROS = np.zeros(3, dtype=np.int64)


def fail_stepping(envs: ClusterEnv) -> None:
    envs.reset(seed=0)
    envs.step(ZEROS)
    envs.step(ZEROS)  # env 0's second step raises


def fail_resetting(envs: ClusterEnv) -> None:
    envs.reset(seed=0)
    envs.reset(seed=1)  # env 0's second reset raises


def fail_building(envs: ClusterEnv) -> None:
    pytest.fail("env 0's constructor raises: ClusterEnv() should have raised")


# (what fails, env 0's factory, what raises it, its type, its message, what the envs were doing)
ENV_ERRORS = {
    "step": (functools.partial(FailingEnv, 2), fail_stepping, ValueError, "deliberate failure at step 2", "stepping"),
    "reset": (
        functools.partial(FailingResetEnv, 2),
        fail_resetting,
        KeyError,
        "'deliberate reset failure 2'",
        "resetting",
    ),
    "constructor": (BrokenInitEnv, fail_building, RuntimeError, "cannot build this env", "building envs"),
}


@pytest.mark.parametrize("learner_envs, where, worker_id", WHERE.values(), ids=WHERE)
@pytest.mark.parametrize("factory, fail, exc_type, message, doing", ENV_ERRORS.values(), ids=ENV_ERRORS)
def test_an_env_error_is_the_same_remote_env_error_wherever_the_env_runs(
    factory, fail, exc_type, message, doing, learner_envs, where, worker_id
):
    """Its own type and ``RemoteEnvError`` both, the same index, message, traceback and cause; the env closes."""
    env_fns = [factory, functools.partial(FailingEnv, 9), functools.partial(FailingEnv, 9)]
    with pytest.raises(exc_type) as caught:
        with ClusterEnv(env_fns, learner_envs=learner_envs, num_workers=1) as envs:
            fail(envs)
            pytest.fail("the env closed without an error")
    if fail is not fail_building:
        assert envs.closed  # by the error: the envs' state is unknown
    error = caught.value
    assert type(error) is remote_error_type(exc_type)
    assert (error.env_index, error.worker_id, error.exc_type) == (0, worker_id, exc_type.__name__)
    assert str(error).startswith(
        f"env 0 {where} raised {exc_type.__name__} while {doing}: {message}\n\n"
        "Remote traceback:\nTraceback (most recent call last):\n"
    )
    assert error.remote_traceback.endswith(f"{exc_type.__name__}: {message}\n")
    assert "tests/envs.py" in error.remote_traceback
    assert type(error.__cause__) is exc_type and str(error.__cause__) == message


def set_seed_property(envs: ClusterEnv) -> None:
    envs.set_attr("np_random_seed", [1], indices=[0])  # a property without a setter


ATTRIBUTE_ERRORS = {
    "get_attr": (lambda envs: envs.get_attr("no_such_attribute", indices=[0]), "calling"),
    "call": (lambda envs: envs.call("no_such_method"), "calling"),
    "apply": (lambda envs: envs.apply(lambda env: env.no_such_attribute, indices=[0]), "calling"),
    "set_attr": (set_seed_property, "setting attributes"),
}


@pytest.mark.parametrize("learner_envs, where, worker_id", WHERE.values(), ids=WHERE)
@pytest.mark.parametrize("ask, doing", ATTRIBUTE_ERRORS.values(), ids=ATTRIBUTE_ERRORS)
def test_an_attribute_error_is_the_same_remote_env_error_wherever_the_env_runs(
    ask, doing, learner_envs, where, worker_id
):
    """Caught by ``except AttributeError`` (Stable-Baselines3's ``has_attr``) either way; the envs stay open."""
    with ClusterEnv([functools.partial(FailingEnv, 9)] * 3, learner_envs=learner_envs, num_workers=1) as envs:
        envs.reset(seed=0)
        with pytest.raises(AttributeError) as caught:
            ask(envs)
        envs.step(ZEROS)  # still open
    error = caught.value
    assert type(error) is remote_error_type(AttributeError)
    assert (error.env_index, error.worker_id, error.exc_type) == (0, worker_id, "AttributeError")
    assert str(error).startswith(f"env 0 {where} raised AttributeError while {doing}: ")
    assert type(error.__cause__) is AttributeError and str(error.__cause__) in str(error)


@pytest.mark.parametrize("learner_envs", SIDES.values(), ids=SIDES)
def test_an_envs_warnings_are_shown_once_and_never_raised_into_the_training_loop(learner_envs, capfd):
    """As in a worker process (Python's default filters): shown once per location, whatever the learner's filters.

    A worker shows them on its stderr; the learner, as it shows warnings (here: to the recorder).
    """
    env_fns = [WarningEnv, functools.partial(WarningEnv, loud=False), functools.partial(WarningEnv, loud=False)]
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("error")  # the training process's filters: -W error, pytest's filterwarnings
        filters = warnings.filters
        with ClusterEnv(env_fns, learner_envs=learner_envs, num_workers=1) as envs:
            envs.reset(seed=0)
            for _ in range(3):
                envs.step(ZEROS)
            for _ in range(2):
                assert envs.apply(lambda env: env.shout(), indices=[0]) == ("shouted",)
        assert warnings.filters is filters
        with pytest.raises(UserWarning):  # the training loop's own warnings still raise
            warnings.warn("the training loop's own", UserWarning, stacklevel=1)
    shown = [f"{w.category.__name__}: {w.message}" for w in recorded] + capfd.readouterr().err.splitlines()
    for text in [
        "UserWarning: \x1b[33mWARN: Box low's precision lowered by casting to float32, current low.dtype=float64",
        "UserWarning: WarningEnv stepped",
        "RuntimeWarning: WarningEnv called",
    ]:
        assert sum(text in line for line in shown) == 1, (text, shown)


@pytest.mark.parametrize("learner_envs", SIDES.values(), ids=SIDES)
def test_what_attribute_calls_return_and_are_given_is_a_copy_wherever_the_env_runs(learner_envs):
    """A worker's results and arguments travel pickled: the caller and the env never share an object."""
    with ClusterEnv([CARTPOLE] * 3, learner_envs=learner_envs, num_workers=1) as envs:
        envs.reset(seed=0)
        generator = envs.np_random[0]
        state = generator.bit_generator.state
        generator.random()  # draws from the copy ...
        assert envs.np_random[0].bit_generator.state == state  # ... not from the env's own generator
        tag = {"seen": []}
        envs.set_attr("tag", [tag], indices=[0])
        tag["seen"].append("by the caller")
        got = envs.get_attr("tag", indices=[0])[0]
        got["seen"].append("by the caller again")
        assert envs.get_attr("tag", indices=[0]) == ({"seen": []},)
        reached: list[str] = []
        assert envs.apply(lambda env: reached.append(env.spec.id), indices=[0]) == (None,)
        assert reached == []  # the function ran on a copy of what it captured


def test_a_reset_after_a_ctrl_c_inside_the_learners_envs_step_returns_what_sync_vector_env_returns():
    """Ctrl-C after env 0 stepped (its info recorded), in env 1's step: the reset that step_wait asks for is clean."""
    env_fns = [BoxInfoEnv] * 4
    actions = np.array([0, 1, 2, 1])
    with (
        ClusterEnv(env_fns, learner_envs=2, num_workers=1) as envs,
        closing(SyncVectorEnv(env_fns)) as reference,
    ):
        assert_same(reference.reset(seed=3), envs.reset(seed=3))
        for vector_env in (reference, envs):
            with interrupt_at(BoxInfoEnv, "step", 2, after=True), pytest.raises(KeyboardInterrupt):
                vector_env.step(actions)
        with pytest.raises(RuntimeError, match=re_escape("interrupted in the middle of a reset or step")):
            envs.step_wait()
        assert_same(reference.reset(seed=4), envs.reset(seed=4))
        for _ in range(5):
            assert_same(reference.step(actions), envs.step(actions))
