"""A worker the learner did not start cannot run code in the learner: its pickles may hold data only."""

from __future__ import annotations

import collections
import functools
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from clusterenv import ClusterEnv, RemoteEnvError, UntrustedPickleError
from clusterenv.wire.safe_pickle import loader
from tests.conftest import assert_same
from tests.test_remote import SECRET, free_address, spawn, worker_command  # noqa: F401 (spawn is a fixture)
from tests.test_security import Marker


@dataclass
class Point:
    """A user's info class: plain data, but not on the allow-list."""

    x: float
    y: float


def sampled(space: spaces.Space) -> spaces.Space:
    space.seed(0)
    space.sample()  # the space now holds a numpy Generator, which travels with it
    return space


DATA = {
    "containers": [{"a": (1, 2.5, None, True)}, {3, 4}, frozenset({5}), bytearray(b"x"), b"y", "z", 1j, range(3)],
    "ordered": collections.OrderedDict(b=1, a=2),
    "deque": collections.deque([1, 2]),
    "arrays": [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 2), np.int64), np.array([1, "a"], object)],
    "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.dtype("<u2"), np.float64],
    "generators": [np.random.default_rng(7), np.random.RandomState(7)],
    "spaces": [
        sampled(spaces.Box(0, 1, (3,))),
        sampled(spaces.Dict({"a": spaces.Discrete(3), "b": spaces.MultiDiscrete([2, 3])})),
        spaces.Tuple([spaces.MultiBinary(3), spaces.Text(5)]),
        sampled(spaces.Graph(spaces.Box(0, 1, (2,)), spaces.Discrete(2))),
        spaces.Sequence(spaces.Discrete(2)),
        spaces.OneOf([spaces.Discrete(2), spaces.Box(0, 1)]),
    ],
    "spec": gym.spec("CartPole-v1"),
    "exceptions": [ValueError("bad", 3), KeyError("k"), FileNotFoundError(2, "gone"), gym.error.ResetNeeded("r")],
}


@pytest.mark.parametrize("name", list(DATA))
@pytest.mark.parametrize(
    "dumps", [functools.partial(pickle.dumps, protocol=5), cloudpickle.dumps], ids=["pickle", "cloudpickle"]
)
def test_data_loads_as_with_plain_pickle(name, dumps):
    data = dumps(DATA[name])
    expected, loaded = pickle.loads(data), loader((), restricted=True)(data)
    assert pickle.dumps(loaded, protocol=5) == pickle.dumps(expected, protocol=5)  # same type, same state


EVIL = [
    "posix.system",
    "builtins.eval",
    "builtins.getattr",
    "builtins.__import__",
    "subprocess.Popen",
    "pathlib.Path.touch",
    "functools.partial",
    "numpy.load",
    "numpy._core.multiarray.fromfile",  # a module some of whose names are allowed
    "gymnasium.spaces.utils.flatten",  # a function in gymnasium.spaces, not a space
    "gymnasium.error.os",  # not an exception class
]


@pytest.mark.parametrize("name", EVIL)
def test_anything_else_is_refused_naming_the_class_and_the_option(name):
    module, _, attribute = name.rpartition(".")
    if attribute == "touch":
        module, attribute = "pathlib", "Path.touch"
    data = f"c{module}\n{attribute}\n(S'never'\ntR.".encode()  # protocol 0: call module.attribute('never')
    with pytest.raises(UntrustedPickleError, match=re.escape(f"`{name}`") + ".*" + re.escape("trusted_classes=")):
        loader((), restricted=True)(data)


def test_modules_off_the_allow_list_are_not_even_imported():
    data = b"cnonexistent_mod\nPoint\n)R."  # protocol 0: nonexistent_mod.Point()
    with pytest.raises(UntrustedPickleError, match="`nonexistent_mod.Point`"):  # not ModuleNotFoundError
        loader((), restricted=True)(data)


POINT = f"{Point.__module__}.Point"  # as pytest imported this module


@pytest.mark.parametrize("trusted", [Point, POINT], ids=["class", "string"])
def test_trusted_classes_load(trusted):
    assert loader([trusted], restricted=True)(pickle.dumps([Point(1, 2)])) == [Point(1, 2)]


def test_workers_the_learner_started_are_not_restricted():
    assert loader((), restricted=False) is pickle.loads


def test_trusted_classes_are_checked():
    with pytest.raises(ValueError, match=re.escape("'module.Name' strings, got 'Point'")):
        loader(["Point"], restricted=True)
    with pytest.raises(TypeError, match="got int"):
        loader([3], restricted=True)  # type: ignore[list-item]


# -- end to end: a worker that sends more than data --------------------------------------------
class Poisoned(gym.Wrapper):
    """CartPole that slips a payload into one of the things a worker sends the learner.

    The payload is a :class:`Marker` for ``path`` (built in the worker: unpickling it there
    would run it there), else ``data``.
    """

    def __init__(self, where: str, path: str | None = None, data: object = None) -> None:
        super().__init__(gym.make("CartPole-v1"))
        payload = data if path is None else Marker(Path(path))
        self.where, self.payload = where, payload
        if where == "metadata":
            self.metadata = {**self.env.metadata, "payload": payload}

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, ({"payload": self.payload} if self.where == "info" else info)

    def step(self, action):
        if self.where == "error":
            raise ValueError(self.payload)
        return self.env.step(action)


def external(spawn, env_fns, **kwargs) -> ClusterEnv:  # noqa: F811
    address = free_address()
    spawn(worker_command(address))
    return ClusterEnv(env_fns, num_workers=1, bind=address, secret=SECRET, launcher="external", **kwargs)


@pytest.mark.parametrize("where", ["metadata", "info", "call", "error"])
def test_a_remote_worker_cannot_run_code_in_the_learner(where, tmp_path, spawn):  # noqa: F811
    marker = tmp_path / "learner-executed"
    env_fns = [functools.partial(Poisoned, where, str(marker))]
    refused = pytest.raises(UntrustedPickleError, match=re.escape("`pathlib.Path.touch`"))
    if where == "metadata":  # the READY that describes the spaces
        with refused:
            external(spawn, env_fns)
    else:
        with external(spawn, env_fns) as envs:
            if where == "info":
                with refused:
                    envs.reset(seed=0)
            elif where == "call":
                with refused:
                    envs.get_attr("payload")
            else:
                envs.reset(seed=0)
                with pytest.raises(RemoteEnvError, match="raised ValueError") as error:
                    envs.step(envs.action_space.sample())
                assert error.value.__cause__ is None  # the message and traceback arrive; the pickle does not
    assert not marker.exists()


def test_trusted_classes_reach_the_learner_from_a_remote_worker(spawn):  # noqa: F811
    env_fns = [functools.partial(Poisoned, "info", data=Point(1, 2))]
    with external(spawn, env_fns, trusted_classes=[POINT]) as envs:
        _, infos = envs.reset(seed=0)
        assert_same(infos["payload"], np.array([Point(1, 2)], dtype=object))
    with ClusterEnv(env_fns, num_workers=1) as envs:  # a local worker needs no trust
        _, infos = envs.reset(seed=0)
        assert infos["payload"][0] == Point(1, 2)


def test_classes_sent_by_value_are_refused_with_advice():
    class Local:  # as a class defined in __main__ or a notebook travels: by value
        pass

    with pytest.raises(UntrustedPickleError, match="by value .*Define it in an importable module"):
        loader((), restricted=True)(cloudpickle.dumps(Local()))
