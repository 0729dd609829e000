"""Bad input gets a specific error before anything reaches a worker; env failures come back with context."""

from __future__ import annotations

import functools
import pickle
import re
import threading
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded
from gymnasium.vector import SyncVectorEnv

import clusterenv
from clusterenv import ClusterEnv, RemoteEnvError
from tests.conftest import assert_same, child_pids, pid_alive, wait_until
from tests.envs import BrokenInitEnv, FailingEnv, FailingResetEnv, OneStepEnv, RichSpacesEnv, WrongShapeObsEnv

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


@pytest.fixture(scope="module")
def cartpole():
    """Three CartPoles on two workers (envs 0-1 and 2), shared by the tests that only send bad input."""
    with ClusterEnv([CARTPOLE] * 3, num_workers=2) as envs:
        envs.reset(seed=0)
        yield envs


@pytest.fixture(scope="module")
def rich():
    """Two RichSpacesEnvs on one worker, per action kind (all started up front: the leak check is per test)."""
    kinds = ["multidiscrete", "multibinary", "box", "dict", "tuple"]
    opened = {kind: ClusterEnv([functools.partial(RichSpacesEnv, kind)] * 2, num_workers=1) for kind in kinds}
    try:
        for envs in opened.values():
            envs.reset(seed=0)
        yield opened.__getitem__
    finally:
        for envs in opened.values():
            envs.close()


@pytest.fixture(autouse=True)
def _module_envs_stay_usable(request):
    """A rejected call must leave the shared envs open and idle (nothing was sent)."""
    yield
    if "cartpole" in request.fixturenames:
        envs = request.getfixturevalue("cartpole")
        assert not envs.closed, "bad input must not close the env"
        envs.step(np.zeros(3, dtype=np.int64))


# -- actions ---------------------------------------------------------------------------------
BAD_CARTPOLE_ACTIONS = {
    "strings": (
        np.array(["a", "b", "c"]),
        TypeError,
        "Actions must be numeric for action space Discrete(2), got dtype <U1.",
    ),
    "objects": (
        np.array([0, None, 1], dtype=object),
        TypeError,
        "Actions must be numeric for action space Discrete(2), got dtype object.",
    ),
    "batch too small": (
        np.zeros(2, dtype=np.int64),
        ValueError,
        "Actions must have shape (3,) (num_envs=3, then the single action shape ()) for action space "
        "Discrete(2), got shape (2,).",
    ),
    "one unbatched action": (
        np.int64(1),
        TypeError,
        "Actions must be a batch with one action per env (num_envs=3) for action space Discrete(2), got the scalar",
    ),
    "extra dimension": (
        np.zeros((3, 1), dtype=np.int64),
        ValueError,
        "Actions must have shape (3,) (num_envs=3, then the single action shape ()) for action space "
        "Discrete(2), got shape (3, 1).",
    ),
}


@pytest.mark.parametrize(("actions", "error", "message"), BAD_CARTPOLE_ACTIONS.values(), ids=BAD_CARTPOLE_ACTIONS)
def test_bad_actions_are_rejected_before_sending(cartpole, actions, error, message):
    with pytest.raises(error, match=re.escape(message)):
        cartpole.step(actions)


BAD_RICH_ACTIONS = {
    "MultiDiscrete wrong shape": (
        "multidiscrete",
        np.zeros((2, 3), dtype=np.int64),
        ValueError,
        "Actions must have shape (2, 2) (num_envs=2, then the single action shape (2,)) for action space "
        "MultiDiscrete([2 4]), got shape (2, 3).",
    ),
    "Box of strings": (
        "box",
        np.full((2, 2), "x"),
        TypeError,
        "Actions must be numeric for action space Box(-2.0, 2.0, (2,), float32), got dtype <U1.",
    ),
    "Dict missing a key": (
        "dict",
        {"move": np.array([0, 1])},
        ValueError,
        "Actions do not match the action space Dict('force': Box(0.0, 1.0, (2,), float64), 'move': Discrete(4)) "
        "(batched for 2 envs): KeyError: 'force'",
    ),
    "Dict given an array": (
        "dict",
        np.zeros(2, dtype=np.int64),
        ValueError,
        "Actions do not match the action space Dict('force': Box(0.0, 1.0, (2,), float64), 'move': Discrete(4)) "
        "(batched for 2 envs): IndexError:",
    ),
    "Tuple too short": (
        "tuple",
        (np.array([0, 1]),),
        ValueError,
        "Actions do not match the action space Tuple(Discrete(2), Box(-1.0, 1.0, (1,), float32)) "
        "(batched for 2 envs): ValueError: zip() argument 2 is shorter than argument 1",
    ),
}


ENV_JUDGED_ACTIONS = {
    "floats for Discrete": np.zeros(3),
    "bools for Discrete": np.ones(3, dtype=bool),
    "above Discrete range": np.array([0, 1, 2]),
    "below Discrete range": np.array([0, -1, 0]),
}


@pytest.mark.parametrize("actions", ENV_JUDGED_ACTIONS.values(), ids=ENV_JUDGED_ACTIONS)
def test_action_values_are_the_envs_business_as_with_sync(actions):
    """Whatever SyncVectorEnv hands its envs, ClusterEnv hands them too: the env raises, with its own type."""
    reference = SyncVectorEnv([CARTPOLE] * 3)
    reference.reset(seed=0)
    with pytest.raises(AssertionError) as expected:
        reference.step(actions)
    reference.close()
    with ClusterEnv([CARTPOLE] * 3, num_workers=2) as envs:
        envs.reset(seed=0)
        with pytest.raises(AssertionError, match=re.escape(str(expected.value))) as raised:
            envs.step(actions)
        assert isinstance(raised.value, RemoteEnvError) and raised.value.env_index is not None


def test_an_action_an_autoresetting_env_ignores_is_passed_on():
    """Under NEXT_STEP an env in its autoreset step ignores its action: out of range or not, Sync steps."""
    reference = SyncVectorEnv([OneStepEnv] * 2)
    with ClusterEnv([OneStepEnv] * 2, num_workers=2) as envs:
        assert_same(reference.reset(seed=0), envs.reset(seed=0))
        assert_same(reference.step(np.array([1, 2])), envs.step(np.array([1, 2])))
        assert_same(reference.step(np.array([4, 9])), envs.step(np.array([4, 9])))  # both autoreset
    reference.close()


@pytest.mark.parametrize(("kind", "actions", "error", "message"), BAD_RICH_ACTIONS.values(), ids=BAD_RICH_ACTIONS)
def test_bad_structured_actions_are_rejected_before_sending(rich, kind, actions, error, message):
    envs = rich(kind)
    with pytest.raises(error, match=re.escape(message)):
        envs.step(actions)
    assert not envs.closed
    envs.step(envs.action_space.sample())


def test_rejected_input_leaves_the_envs_untouched():
    """Nothing was sent: after the rejected calls the envs are exactly where SyncVectorEnv's are."""
    reference = SyncVectorEnv([CARTPOLE] * 3)
    with ClusterEnv([CARTPOLE] * 3, num_workers=2) as envs:
        assert_same(reference.reset(seed=3), envs.reset(seed=3))
        for bad in (np.zeros(2, dtype=np.int64), np.int64(1), np.array(["a", "b", "c"])):
            with pytest.raises((TypeError, ValueError)):
                envs.step(bad)
        with pytest.raises(ValueError):
            envs.reset(seed=[1, 2])
        actions = np.array([1, 0, 1])
        assert_same(reference.step(actions), envs.step(actions))
    reference.close()


@pytest.fixture(scope="module")
def lockstep():
    """A ClusterEnv (envs 0-1 on worker 0, env 2 on worker 1) and a SyncVectorEnv, to run side by side."""
    with ClusterEnv([CARTPOLE] * 3, num_workers=2) as envs, closing(SyncVectorEnv([CARTPOLE] * 3)) as reference:
        yield envs, reference


REJECTED_COMMANDS = {
    "negative seed": (
        lambda envs: envs.reset(seed=-1),
        ValueError,
        "`seed` must be a non-negative integer (Gymnasium's `np_random` requires it), got -1.",
    ),
    "negative numpy seed": (
        lambda envs: envs.reset(seed=np.int64(-3)),
        ValueError,
        "`seed` must be a non-negative integer (Gymnasium's `np_random` requires it), got -3.",
    ),
    "seed + 2 beyond the wire": (
        lambda envs: envs.reset(seed=2**64 - 2),
        ValueError,
        "`seed` must be at most 2**64 - 3 = 18446744073709551613 for 3 envs (env i gets `seed + i`, and no seed "
        "above 2**64 - 1 can be sent to a worker), got 18446744073709551614.",
    ),
    "negative seed in a list": (
        lambda envs: envs.reset(seed=[0, 1, -5]),
        ValueError,
        "`seed[2]` must be between 0 (Gymnasium's `np_random` requires it) and 2**64 - 1 (the largest seed that "
        "can be sent to a worker), got -5.",
    ),
    "list seed beyond the wire": (
        lambda envs: envs.reset(seed=[0, 1, 2**64]),
        ValueError,
        "`seed[2]` must be between 0 (Gymnasium's `np_random` requires it) and 2**64 - 1 (the largest seed that "
        "can be sent to a worker), got 18446744073709551616.",
    ),
    "seed list too short": (
        lambda envs: envs.reset(seed=[1, 2]),
        ValueError,
        "If seeds are passed as a list the length must match num_envs=3 but got length=2.",
    ),
    "options not a dict": (
        lambda envs: envs.reset(options="fast"),
        TypeError,
        "`options` must be a dict, a list of one dict per env, or None, got str ('fast').",
    ),
    "unpicklable options": (
        lambda envs: envs.reset(options={"lock": threading.Lock()}),
        TypeError,
        "The `options` of reset cannot be pickled to send to workers: cannot pickle '_thread.lock' object",
    ),
    "reset_mask of the wrong length": (
        lambda envs: envs.reset(options={"reset_mask": np.array([True, False])}),
        ValueError,
        "`options['reset_mask']` must have shape `(3,)`, got (2,)",
    ),
    "call of a name that is not a string": (
        lambda envs: envs.call(7),
        TypeError,
        "The attribute name must be a string, got int (7).",
    ),
    "unpicklable call arguments": (
        lambda envs: envs.call("render", threading.Lock()),
        TypeError,
        "The arguments of call('render') cannot be pickled to send to workers: cannot pickle '_thread.lock' object",
    ),
    "set_attr of a name that is not a string": (
        lambda envs: envs.set_attr(b"marker", 1),
        TypeError,
        "The attribute name must be a string, got bytes (b'marker').",
    ),
    "set_attr value for worker 1 that cannot travel": (
        lambda envs: envs.set_attr("marker", [1, 1, threading.Lock()]),
        TypeError,
        "The values of set_attr('marker') cannot be pickled to send to workers: cannot pickle '_thread.lock' object",
    ),
}


@pytest.mark.parametrize(("command", "error", "message"), REJECTED_COMMANDS.values(), ids=REJECTED_COMMANDS)
def test_rejected_command_reaches_no_worker(lockstep, command, error, message):
    """Everything is checked and encoded before the first send: envs stay open, exactly where SyncVectorEnv's are."""
    envs, reference = lockstep
    assert not envs.closed, "an earlier rejected command closed the env"
    for vector_env in (envs, reference):
        vector_env.set_attr("marker", 0)
    assert_same(envs.reset(seed=3), reference.reset(seed=3))
    assert_same(envs.step(np.array([1, 0, 1])), reference.step(np.array([1, 0, 1])))
    with pytest.raises(error, match=re.escape(message)):
        command(envs)
    assert not envs.closed
    assert envs.get_attr("marker") == (0, 0, 0)
    for t in range(3):
        actions = np.array([t % 2, 1, 0])
        assert_same(envs.step(actions), reference.step(actions))
    assert_same(envs.reset(seed=5), reference.reset(seed=5))


# -- reset -------------------------------------------------------------------------------------
BAD_RESETS = {
    "seed list too short": (
        {"seed": [1, 2]},
        ValueError,
        "If seeds are passed as a list the length must match num_envs=3 but got length=2.",
    ),
    "seed list too long": (
        {"seed": [1, 2, 3, 4]},
        ValueError,
        "If seeds are passed as a list the length must match num_envs=3 but got length=4.",
    ),
    "float seed": (
        {"seed": 1.5},
        TypeError,
        "`seed` must be an int, a list of int or None (one per env), or None, got float.",
    ),
    "string seed": (
        {"seed": "abc"},
        TypeError,
        "`seed` must be an int, a list of int or None (one per env), or None, got str.",
    ),
    "bool seed": (
        {"seed": True},
        TypeError,
        "`seed` must be an int, a list of int or None (one per env), or None, got bool.",
    ),
    "string in seed list": (
        {"seed": [1, "2", 3]},
        TypeError,
        "`seed[1]` must be an int or None, got str ('2').",
    ),
    "reset_mask not an array": (
        {"options": {"reset_mask": [True, False, True]}},
        TypeError,
        "`options['reset_mask']` must be a numpy array, got <class 'list'>",
    ),
    "reset_mask wrong shape": (
        {"options": {"reset_mask": np.array([True, False])}},
        ValueError,
        "`options['reset_mask']` must have shape `(3,)`, got (2,)",
    ),
    "reset_mask not bool": (
        {"options": {"reset_mask": np.array([1, 0, 1])}},
        TypeError,
        "`options['reset_mask']` must have `dtype=np.bool_`, got int64",
    ),
    "reset_mask all False": (
        {"options": {"reset_mask": np.zeros(3, dtype=bool)}},
        ValueError,
        "`options['reset_mask']` must contain a boolean array with at least one True value, "
        "got reset_mask=[False False False]",
    ),
}


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_RESETS.values(), ids=BAD_RESETS)
def test_bad_reset_arguments_are_rejected_before_sending(cartpole, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        cartpole.reset(**kwargs)


def test_unpicklable_reset_options_are_rejected(cartpole):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "The `options` of reset cannot be pickled to send to workers: cannot pickle '_thread.lock' object"
        ),
    ):
        cartpole.reset(options={"lock": threading.Lock()})


def test_seed_as_numpy_array_or_numpy_ints_is_accepted(cartpole):
    expected = cartpole.reset(seed=[4, 5, 6])
    assert_same(cartpole.reset(seed=np.array([4, 5, 6])), expected)
    assert_same(cartpole.reset(seed=np.int64(4)), expected)


# -- call order --------------------------------------------------------------------------------
def test_step_before_reset_raises_reset_needed():
    with ClusterEnv([CARTPOLE] * 2, num_workers=1) as envs:
        with pytest.raises(
            ResetNeeded, match=re.escape("Cannot call `step` before `reset`: the environments have not been reset yet.")
        ):
            envs.step(np.zeros(2, dtype=np.int64))
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("method", ["step_wait", "reset_wait", "call_wait"])
def test_wait_without_async_call_raises_no_async_call_error(cartpole, method):
    start = method.replace("_wait", "_async")
    with pytest.raises(NoAsyncCallError, match=re.escape(f"Calling `{method}` without any prior call to `{start}`.")):
        getattr(cartpole, method)()


SECOND_CALLS = {
    "step_async": lambda envs: envs.step_async(np.zeros(3, dtype=np.int64)),
    "step": lambda envs: envs.step(np.zeros(3, dtype=np.int64)),
    "reset": lambda envs: envs.reset(),
    "call": lambda envs: envs.call("spec"),
    "set_attr": lambda envs: envs.set_attr("gravity", 1.0),
}
# The method named in the error, as AsyncVectorEnv names it.
SECOND_CALL_STATES = {
    "step_async": "step_async",
    "step": "step_async",
    "reset": "reset_async",
    "call": "call_async",
    "set_attr": "set_attr",
}


@pytest.mark.parametrize("second", SECOND_CALLS.values(), ids=SECOND_CALLS)
def test_call_while_a_step_is_pending_raises_already_pending(cartpole, second, request):
    name = request.node.callspec.id
    cartpole.step_async(np.zeros(3, dtype=np.int64))
    try:
        with pytest.raises(
            AlreadyPendingCallError,
            match=re.escape(
                f"Calling `{SECOND_CALL_STATES[name]}` while waiting for a pending call to `step` to complete."
            ),
        ):
            second(cartpole)
    finally:
        cartpole.step_wait()


CLOSED_CALLS = {
    "step": lambda envs: envs.step(np.zeros(2, dtype=np.int64)),
    "step_async": lambda envs: envs.step_async(np.zeros(2, dtype=np.int64)),
    "step_wait": lambda envs: envs.step_wait(),
    "reset": lambda envs: envs.reset(),
    "call": lambda envs: envs.call("spec"),
    "get_attr": lambda envs: envs.get_attr("spec"),
    "set_attr": lambda envs: envs.set_attr("gravity", 1.0),
    "render": lambda envs: envs.render(),
}


@pytest.fixture(scope="module")
def closed():
    envs = ClusterEnv([CARTPOLE] * 2, num_workers=1)
    envs.reset(seed=0)
    envs.close()
    return envs


@pytest.mark.parametrize("use", CLOSED_CALLS.values(), ids=CLOSED_CALLS)
def test_any_use_after_close_raises_closed_environment_error(closed, use):
    with pytest.raises(
        ClosedEnvironmentError, match=re.escape("Trying to operate on `ClusterEnv`, after a call to `close()`.")
    ):
        use(closed)


def test_set_attr_with_wrong_number_of_values(cartpole):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Values must be a list or tuple with length equal to the number of environments. "
            "Got `2` values for 3 environments."
        ),
    ):
        cartpole.set_attr("gravity", [1.0, 2.0])


def test_unpicklable_call_arguments_are_rejected(cartpole):
    with pytest.raises(
        TypeError,
        match=re.escape(
            "The arguments of call('render') cannot be pickled to send to workers: cannot pickle '_thread.lock' object"
        ),
    ):
        cartpole.call("render", threading.Lock())


# -- construction ------------------------------------------------------------------------------
class _Unpicklable:
    """A callable env factory holding a lock, which no pickler can send."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self) -> gym.Env:
        return gym.make("CartPole-v1")


BAD_CONSTRUCTIONS = {
    "num_workers 0": (
        {"env_fns": [CARTPOLE] * 3, "num_workers": 0},
        ValueError,
        "`num_workers` must be between 1 and the number of envs (3), got 0.",
    ),
    "num_workers above num_envs": (
        {"env_fns": [CARTPOLE] * 3, "num_workers": 4},
        ValueError,
        "`num_workers` must be between 1 and the number of envs (3), got 4.",
    ),
    "num_workers float": (
        {"env_fns": [CARTPOLE] * 3, "num_workers": 1.5},
        TypeError,
        "`num_workers` must be an integer, got float (1.5).",
    ),
    "num_workers bool": (
        {"env_fns": [CARTPOLE] * 3, "num_workers": True},
        TypeError,
        "`num_workers` must be an integer, got bool (True).",
    ),
    "env_fns a string": (
        {"env_fns": "CartPole-v1"},
        TypeError,
        "`env_fns` must be a sequence of callables, got str.",
    ),
    "env_fns a single callable": (
        {"env_fns": CARTPOLE},
        TypeError,
        "`env_fns` must be a sequence of callables, got partial.",
    ),
    "env_fns a generator": (
        {"env_fns": (fn for fn in [CARTPOLE])},
        TypeError,
        "`env_fns` must be a sequence of callables, got generator.",
    ),
    "env_fns empty": (
        {"env_fns": []},
        ValueError,
        "`env_fns` must contain at least one environment factory, got an empty sequence.",
    ),
    "env_fns with a non-callable": (
        {"env_fns": [CARTPOLE, "CartPole-v1"]},
        TypeError,
        "`env_fns[1]` must be a zero-argument callable, got str.",
    ),
    "procs_per_worker zero": (
        {"env_fns": [CARTPOLE], "procs_per_worker": 0},
        ValueError,
        "`procs_per_worker` must be an integer of at least 1, got int (0).",
    ),
    "procs_per_worker a float": (
        {"env_fns": [CARTPOLE], "procs_per_worker": 2.0},
        ValueError,
        "`procs_per_worker` must be an integer of at least 1, got float (2.0).",
    ),
    "procs_per_worker a string": (
        {"env_fns": [CARTPOLE], "procs_per_worker": "4"},
        ValueError,
        "`procs_per_worker` must be an integer of at least 1, got str ('4').",
    ),
    "procs_per_worker a bool": (
        {"env_fns": [CARTPOLE], "procs_per_worker": True},
        ValueError,
        "`procs_per_worker` must be an integer of at least 1, got bool (True).",
    ),
    "timeout negative": (
        {"env_fns": [CARTPOLE], "timeout": -1},
        ValueError,
        "`timeout` must be a positive number of seconds, got -1.",
    ),
    "timeout a string": (
        {"env_fns": [CARTPOLE], "timeout": "10"},
        TypeError,
        "`timeout` must be a positive number of seconds or None, got str ('10').",
    ),
    "start_timeout None": (
        {"env_fns": [CARTPOLE], "start_timeout": None},
        TypeError,
        "`start_timeout` must be a positive number of seconds, got NoneType (None).",
    ),
    "unknown autoreset_mode": (
        {"env_fns": [CARTPOLE], "autoreset_mode": "Sometimes"},
        ValueError,
        "`autoreset_mode` must be one of ['NextStep', 'SameStep', 'Disabled'], got 'Sometimes'.",
    ),
    "unknown observation_mode": (
        {"env_fns": [CARTPOLE], "observation_mode": "mixed"},
        ValueError,
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and batch observation "
        "space, actual got mixed",
    ),
    "public bind without secret": (
        {"env_fns": [CARTPOLE], "bind": "tcp://0.0.0.0:0"},
        ValueError,
        "Refusing to bind 'tcp://0.0.0.0:0' without a shared secret",
    ),
}


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_CONSTRUCTIONS.values(), ids=BAD_CONSTRUCTIONS)
def test_bad_constructor_arguments_start_no_worker(kwargs, error, message, monkeypatch):
    monkeypatch.delenv("CLUSTERENV_SECRET", raising=False)
    before = child_pids()
    with pytest.raises(error, match=re.escape(message)):
        ClusterEnv(**kwargs)
    assert child_pids() == before


def test_unpicklable_env_fn_is_named_with_the_reason():
    before = child_pids()
    with pytest.raises(TypeError) as caught:
        ClusterEnv([CARTPOLE, CARTPOLE, _Unpicklable()])
    message = str(caught.value)
    assert re.match(r"`env_fns\[2\]` \(<[\w.]*_Unpicklable object at 0x[0-9a-f]+>\) ", message), message
    assert message.endswith(
        "cannot be pickled with cloudpickle, so it cannot be sent to a worker: "
        "TypeError: cannot pickle '_thread.lock' object"
    )
    assert isinstance(caught.value.__cause__, TypeError)
    assert child_pids() == before


def test_constructor_that_raises_in_the_worker_names_the_env_and_leaks_nothing():
    before = child_pids()
    with pytest.raises(RemoteEnvError) as caught:
        ClusterEnv([CARTPOLE, CARTPOLE, BrokenInitEnv], num_workers=2)
    error = caught.value
    assert (error.env_index, error.worker_id, error.exc_type) == (2, 1, "RuntimeError")
    assert str(error).startswith("env 2 on worker 1 raised RuntimeError while building envs: cannot build this env")
    assert 'raise RuntimeError("cannot build this env")' in error.remote_traceback
    assert isinstance(error.__cause__, RuntimeError)
    assert wait_until(lambda: child_pids() == before, timeout=10)


# -- errors inside envs ------------------------------------------------------------------------
FAILURES = {
    "step, env 1 on worker 0": ([5, 2, 5], "step", 1, 0),
    "step, env 1 on worker 0, its step timed": ([5, 1, 5], "step", 1, 0),  # a worker times its first batch step
    "step, env 2 on worker 1": ([5, 5, 2], "step", 2, 1),
    "reset, env 0 on worker 0": ([2, 5, 5], "reset", 0, 0),
}


@pytest.mark.parametrize(("fail_at", "where", "env_index", "worker_id"), FAILURES.values(), ids=FAILURES)
def test_env_exception_is_reraised_with_index_worker_and_traceback(fail_at, where, env_index, worker_id):
    env_cls = FailingEnv if where == "step" else FailingResetEnv
    before = child_pids()
    envs = ClusterEnv([functools.partial(env_cls, n) for n in fail_at], num_workers=2)
    pids = child_pids() - before
    envs.reset(seed=0)
    with pytest.raises(RemoteEnvError) as caught:
        for _ in range(3):
            if where == "step":
                envs.step(np.zeros(3, dtype=np.int64))
            else:
                envs.reset()
    error = caught.value
    exc_type, text = (
        ("ValueError", f"deliberate failure at step {fail_at[env_index]}")
        if where == "step"
        else ("KeyError", "deliberate reset failure 2")
    )
    doing = "stepping" if where == "step" else "resetting"
    assert (error.env_index, error.worker_id, error.exc_type) == (env_index, worker_id, exc_type)
    assert str(error).startswith(f"env {env_index} on worker {worker_id} raised {exc_type} while {doing}: ")
    assert text in str(error)
    assert "Remote traceback:\nTraceback (most recent call last):" in str(error)
    assert f"in {where}" in error.remote_traceback and "tests/envs.py" in error.remote_traceback
    assert type(error.__cause__).__name__ == exc_type and text in str(error.__cause__)
    # Every worker is shut down, and the env says so.
    assert envs.closed
    assert wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=10)
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.zeros(3, dtype=np.int64))
    envs.close()


WRONG_SHAPES = {
    "step, env 0 of 2": ("step", 0),
    "step, env 1 of 2": ("step", 1),
    "reset, env 0 of 2": ("reset", 0),
}


@pytest.mark.parametrize(("where", "bad_env"), WRONG_SHAPES.values(), ids=WRONG_SHAPES)
def test_observation_of_the_wrong_shape_is_blamed_on_the_env_that_returned_it(where, bad_env):
    env_fns = [functools.partial(WrongShapeObsEnv, where if i == bad_env else None) for i in range(2)]
    with ClusterEnv(env_fns, num_workers=1) as envs:
        with pytest.raises(RemoteEnvError) as caught:
            envs.reset(seed=0)
            envs.step(np.zeros(2, dtype=np.int64))
    doing = "stepping" if where == "step" else "resetting"
    assert caught.value.env_index == bad_env
    assert str(caught.value).startswith(f"env {bad_env} on worker 0 raised ValueError while {doing}: ")


def test_remote_env_error_survives_pickling():
    """So that it can cross process boundaries again (pytest-xdist, Ray tasks, multiprocessing)."""
    error = RemoteEnvError("env 3 raised", env_index=3, worker_id=1, exc_type="ValueError", remote_traceback="tb")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RemoteEnvError and str(copy) == "env 3 raised"
    assert (copy.env_index, copy.worker_id, copy.exc_type, copy.remote_traceback) == (3, 1, "ValueError", "tb")


def test_missing_attribute_is_a_remote_error_naming_the_env():
    with ClusterEnv([CARTPOLE] * 3, num_workers=2) as envs:
        with pytest.raises(RemoteEnvError) as caught:
            envs.get_attr("no_such_attribute")
    assert caught.value.env_index in (0, 2)  # the first worker to answer
    assert caught.value.exc_type == "AttributeError"
    assert isinstance(caught.value.__cause__, AttributeError)
    assert "no_such_attribute" in str(caught.value)


# -- make_vec ----------------------------------------------------------------------------------
def test_make_vec_unknown_id_is_gymnasiums_error():
    with pytest.raises(gym.error.NameNotFound, match=re.escape("Environment `NoSuchEnv` doesn't exist.")):
        clusterenv.make_vec("NoSuchEnv-v0", num_envs=2)


@pytest.mark.parametrize(
    ("num_envs", "error", "message"),
    [
        (0, ValueError, "`num_envs` must be at least 1, got 0."),
        (-3, ValueError, "`num_envs` must be at least 1, got -3."),
        (2.0, TypeError, "`num_envs` must be an integer, got float (2.0)."),
    ],
    ids=["0", "negative", "float"],
)
def test_make_vec_bad_num_envs(num_envs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        clusterenv.make_vec("CartPole-v1", num_envs=num_envs)


def test_make_vec_bad_id_type():
    with pytest.raises(gym.error.Error, match=re.escape("Invalid id type: <class 'int'>. Expected `str` or `EnvSpec`")):
        clusterenv.make_vec(3)  # type: ignore[arg-type]


def test_make_vec_unknown_vector_kwarg():
    with pytest.raises(TypeError, match=re.escape("unexpected keyword argument 'no_such_argument'")):
        clusterenv.make_vec("CartPole-v1", num_envs=2, vector_kwargs={"no_such_argument": True})
