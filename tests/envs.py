"""Small environments that exercise every space kind, info shape and failure mode."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class RichSpacesEnv(gym.Env):
    """Nested Dict/Tuple observations, a chosen action space, and infos that vary per step.

    Episodes end at random (terminated) or after ``max_len`` steps (truncated), so a
    1,000-step run crosses many boundaries. Infos mix scalars, arrays, nested dicts and
    keys that appear only sometimes, which is what exercises Gymnasium's info batching.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self,
        action_kind: str = "discrete",
        max_len: int = 17,
        render_mode: str | None = None,
        image_shape: tuple[int, ...] = (6, 5, 3),
    ) -> None:
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, image_shape, np.uint8),
                "state": spaces.Tuple((spaces.Box(-1.0, 1.0, (3,), np.float64), spaces.Discrete(7, start=-2))),
                "flags": spaces.MultiBinary(4),
                "grid": spaces.MultiDiscrete([3, 5]),
            }
        )
        self.action_space = {
            "discrete": spaces.Discrete(3),
            "box": spaces.Box(-2.0, 2.0, (2,), np.float32),
            "multidiscrete": spaces.MultiDiscrete([2, 4]),
            "multibinary": spaces.MultiBinary(3),
            "tuple": spaces.Tuple((spaces.Discrete(2), spaces.Box(-1, 1, (1,), np.float32))),
            "dict": spaces.Dict({"move": spaces.Discrete(4), "force": spaces.Box(0, 1, (2,), np.float64)}),
        }[action_kind]
        self.max_len = max_len
        self.render_mode = render_mode
        self.t = 0

    def _obs(self) -> dict[str, Any]:
        return self.observation_space.sample()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        info: dict[str, Any] = {"start": int(self.np_random.integers(100))}
        if options:
            info["options"] = dict(options)
        return self._obs(), info

    def step(self, action):
        self.t += 1
        flat = np.concatenate([np.ravel(np.asarray(a, dtype=np.float64)) for a in _leaves(action)])
        reward = float(self.np_random.normal() + flat.sum())
        terminated = bool(self.np_random.random() < 0.08)
        truncated = self.t >= self.max_len
        info: dict[str, Any] = {"t": self.t, "noise": np.float32(self.np_random.random())}
        if self.t % 3 == 0:
            info["vector"] = self.np_random.random(2)
        if self.t % 5 == 0:
            info["nested"] = {"depth": self.t, "label": f"step-{self.t}"}
        return self._obs(), reward, terminated, truncated, info

    def render(self):
        return np.full((4, 4, 3), self.t % 256, dtype=np.uint8)


def _leaves(value):
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


class TextObsEnv(gym.Env):
    """Text observations have no fixed array form: they exercise the pickled observation path."""

    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=8)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), float(action), self.t >= 4, False, {"len": self.t}


class FailingEnv(gym.Env):
    """Raises from ``step`` after ``fail_at`` steps, to test remote tracebacks."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, fail_at: int = 3) -> None:
        self.fail_at = fail_at
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t >= self.fail_at:
            raise ValueError(f"deliberate failure at step {self.t}")
        return np.zeros(2, np.float32), 0.0, False, False, {}


class SlowEnv(gym.Env):
    """Sleeps ``delay`` seconds per step, to test timeouts."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, delay: float = 1.0) -> None:
        self.delay = delay

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        time.sleep(self.delay)
        return np.zeros(2, np.float32), 0.0, False, False, {}


class StuckEnv(gym.Env):
    """Starts a helper process, as a simulator would, and never returns from ``step`` (well, after ``delay`` s).

    ``step`` first creates the file ``started``, so that a test knows the worker is inside it.
    """

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, delay: float = 600.0, started: str | None = None) -> None:
        self.delay, self.started = delay, started
        self.helper = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        self.helper_pid = self.helper.pid

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if self.started is not None:
            Path(self.started).touch()
        time.sleep(self.delay)
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def close(self) -> None:
        self.helper.kill()
        self.helper.wait()


def hold_gil(seconds: float) -> None:
    """One C call that keeps the GIL for ``seconds`` (``usleep`` through ``ctypes.PyDLL``), as a simulator might.

    No other thread of the process runs meanwhile: a heartbeat thread is starved for the whole time.
    """
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def spin(seconds: float) -> None:
    """Pure-Python busy work in a tight loop for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def burn_cpu(seconds: float) -> None:
    """Pure-Python busy work until this thread has used ``seconds`` of CPU (however long that takes)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class BusyEnv(gym.Wrapper):
    """CartPole whose every step first keeps its worker busy for ``seconds``, then steps as CartPole would.

    ``how`` is ``"python"`` (:func:`spin`), ``"cpu"`` (:func:`burn_cpu`) or ``"c"`` (:func:`hold_gil`).
    The file ``started``, if given, is created as a step begins, so that a test knows the worker is inside it.
    """

    def __init__(self, seconds: float, how: str = "c", started: str | None = None) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.seconds, self.started = seconds, started
        self.busy = {"python": spin, "cpu": burn_cpu, "c": hold_gil}[how]

    def step(self, action):
        if self.started is not None:
            Path(self.started).touch()
        self.busy(self.seconds)
        return self.env.step(action)


class WrongShapeObsEnv(gym.Env):
    """Returns an observation one element too long from ``bad_in`` (``"reset"`` or ``"step"``), else fits its space."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, bad_in: str | None = None) -> None:
        self.bad_in = bad_in

    def _obs(self, where: str) -> np.ndarray:
        return np.zeros(3 if where == self.bad_in else 2, np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self._obs("reset"), {}

    def step(self, action):
        return self._obs("step"), 0.0, False, False, {}


class BrokenInitEnv(gym.Env):
    """Raises in its constructor, inside the worker."""

    def __init__(self) -> None:
        raise RuntimeError("cannot build this env")


class FailingResetEnv(FailingEnv):
    """Raises from ``reset`` once it has been reset ``fail_at`` times."""

    def __init__(self, fail_at: int = 2) -> None:
        super().__init__(fail_at)
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.resets += 1
        if self.resets >= self.fail_at:
            raise KeyError(f"deliberate reset failure {self.resets}")
        return super().reset(seed=seed, options=options)


class BoxInfoEnv(gym.Env):
    """Box observations and a Discrete(3) action, with action-dependent rewards and varied infos.

    The shape local policies accept, with what makes step-mode comparisons meaningful:
    random terminations, truncation at ``max_len``, and infos whose keys come and go.
    """

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(3)

    def __init__(self, max_len: int = 9) -> None:
        self.max_len = max_len
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {"start": int(self.np_random.integers(100))}

    def step(self, action):
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        reward = float(action) + float(self.np_random.normal())
        terminated = bool(self.np_random.random() < 0.1)
        info: dict[str, Any] = {"t": self.t}
        if self.t % 4 == 0:
            info["quarter"] = np.float32(self.np_random.random())
        return obs, reward, terminated, self.t >= self.max_len, info


class TypedInfoEnv(BoxInfoEnv):
    """``BoxInfoEnv`` whose info ``"x"`` has the type given (``int``, ``float``, ``np.float32``...).

    Envs of different types in one vector: the first env that reports a key decides its
    dtype, and later envs' values are cast into it, across worker slices too.
    """

    def __init__(self, value_type: type = int) -> None:
        super().__init__()
        self.value_type = value_type

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "x": self.value_type(self.t * 1.25)}


class SlowCartPole(gym.Wrapper):
    """CartPole whose step sleeps ``delay`` seconds: a rollout that takes a while, without using CPU."""

    def __init__(self, delay: float = 0.01) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.delay = delay

    def step(self, action):
        time.sleep(self.delay)
        return self.env.step(action)


class JitteryRichEnv(RichSpacesEnv):
    """``RichSpacesEnv`` whose steps take 0-4 ms at random, so that workers reply in a varying order.

    The jitter comes from its own unseeded generator: the env's seeded results do not depend on it.
    """

    def __init__(self, action_kind: str = "discrete") -> None:
        super().__init__(action_kind)
        self._jitter = np.random.default_rng()

    def step(self, action):
        time.sleep(float(self._jitter.uniform(0.0, 0.004)))
        return super().step(action)


class OneStepEnv(gym.Env):
    """Episodes of one step; ``step`` asserts its action is in ``Discrete(4)``, as CartPole does."""

    observation_space = spaces.Box(0.0, 100.0, (1,), np.float32)
    action_space = spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([self.np_random.integers(100)], np.float32), {}

    def step(self, action):
        assert self.action_space.contains(action), f"{action!r} invalid"
        return np.array([float(action)], np.float32), 1.0, True, False, {"action": int(action)}


class TextActionEnv(gym.Env):
    """A ``Text`` action space (no fixed array form): the env echoes its actions into its observations."""

    observation_space = spaces.Box(0.0, 100.0, (1,), np.float32)
    action_space = spaces.Text(max_length=6)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        assert isinstance(action, str), f"{action!r} is not a str"
        return np.array([len(action)], np.float32), float(len(action)), action == "stop", False, {"said": action}


class UnsortedDictActionEnv(gym.Env):
    """A Dict action space whose keys are not in sorted order (``batch_space`` sorts them)."""

    observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)

    def __init__(self) -> None:
        self.action_space = spaces.Dict([("b", spaces.Box(-10, 10, (1,), np.float32)), ("a", spaces.Discrete(3))])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(action), f"{action!r} invalid"
        return np.array([action["a"], action["b"][0]], np.float32), 0.0, False, False, {}


class ObservationSpaceEnv(gym.Env):
    """An env whose observation space is given: for checks of mismatched spaces."""

    action_space = spaces.Discrete(2)

    def __init__(self, observation_space: spaces.Space) -> None:
        self.observation_space = observation_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, False, {}


#: An id that :func:`make_after_registering` registers, as a package such as ale-py does on import.
SELF_REGISTERED_ID = "clusterenv-test/SelfRegistered-v0"


def register_self_registered(max_episode_steps: int = 5) -> None:
    gym.register(
        SELF_REGISTERED_ID,
        entry_point=RichSpacesEnv,
        max_episode_steps=max_episode_steps,
        kwargs={"action_kind": "box"},
    )


def make_after_registering(max_episode_steps: int = 5) -> gym.Env:
    """A CleanRL-style factory: it registers its env ids (``import ale_py``), warns about something, and makes one."""
    register_self_registered(max_episode_steps)
    warnings.warn("a factory's own warning", UserWarning, stacklevel=1)
    return gym.make(SELF_REGISTERED_ID)


def make_without_return() -> None:
    """A factory whose ``return`` is missing: it makes a CartPole and returns ``None``."""
    gym.make("CartPole-v1")


class NoOptionsEnv(gym.Env):
    """An env written before Gymnasium 0.26 added ``options``: ``reset(self, seed=None)``.

    A random walk whose reward and length depend on the seed, so equal episodes mean equal seeding.
    """

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, seed=None):  # type: ignore[override]
        super().reset(seed=seed)
        self.t = 0
        self.state = self.np_random.uniform(-0.5, 0.5, 3).astype(np.float32)
        return self.state, {}

    def step(self, action):
        self.t += 1
        push = self.np_random.normal(0.0, 0.2, 3) + (0.1 if action else -0.1)
        self.state = np.clip(self.state + push, -1.0, 1.0).astype(np.float32)
        return self.state, float(self.state[0]), bool(abs(self.state[1]) >= 1.0), self.t >= 25, {}


class ResetArgumentsEnv(NoOptionsEnv):
    """Reports in its reset info which keyword arguments its ``reset`` was given."""

    def reset(self, **kwargs):  # type: ignore[override]
        obs, _ = super().reset(seed=kwargs.get("seed"))
        return obs, {"reset_arguments": sorted(kwargs)}


class SpriteEnv(gym.Env):
    """Images like a game's: a dark screen, a sprite the actions move, and a few noisy pixels.

    Frames compress well, as real game frames do, yet differ from step to step and env to env;
    episodes end at random or after ``max_len`` steps, with infos that say where the sprite is.
    """

    action_space = spaces.Discrete(4)

    def __init__(self, size: int = 96, max_len: int = 30) -> None:
        self.observation_space = spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.size, self.max_len = size, max_len
        self.t, self.position = 0, np.zeros(2, np.int64)

    def _frame(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size, 3), np.uint8)
        y, x = self.position
        frame[y : y + 8, x : x + 8] = (200, 120, 40)
        noise = self.np_random.integers(0, self.size, (6, 2))
        frame[noise[:, 0], noise[:, 1]] = self.np_random.integers(0, 256, (6, 3), dtype=np.uint8)
        return frame

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t, self.position = 0, self.np_random.integers(0, self.size - 8, 2)
        return self._frame(), {"position": self.position.copy()}

    def step(self, action):
        self.t += 1
        move = [(0, 1), (0, -1), (1, 0), (-1, 0)][int(action)]
        self.position = np.clip(self.position + move, 0, self.size - 8)
        terminated = bool(self.np_random.random() < 0.05)
        return (
            self._frame(),
            float(self.position.sum()),
            terminated,
            self.t >= self.max_len,
            {"position": self.position},
        )


_FLAKY_ERRORS = itertools.count()  # numbers the errors of one process: each message is unique


class FlakyCartPole(gym.Wrapper):
    """CartPole whose step raises ``RuntimeError`` now and then (with ``probability``), at seeded random steps.

    Each error is written to the file ``log`` first, one line with a message no other error
    has, so that a test can tell that every error was reported, and reported once.
    """

    def __init__(self, log: str, probability: float = 0.01) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.log, self.probability = log, probability
        self._rng = np.random.default_rng()
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed + 10_000)
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self._t += 1
        if self._rng.random() < self.probability:
            message = f"flaky error {next(_FLAKY_ERRORS)} in process {os.getpid()}, step {self._t}"
            with open(self.log, "a") as f:
                f.write(message + "\n")
            raise RuntimeError(message)
        return self.env.step(action)


def failing_factory(log: str) -> gym.Env:
    """Makes an env that raises at its first step, once; every later call of the factory raises."""
    with open(log, "a+") as f:
        f.seek(0)
        made = len(f.read().splitlines())
        f.write("made\n")
    if made:
        raise OSError("the simulator's licence server is down")
    return FlakyCartPole(log + ".errors", probability=1.0)


class LeakyCartPole(gym.Wrapper):
    """CartPole that keeps ``mb_per_step`` MB of fresh, touched memory on every step, as a leaking simulator does."""

    def __init__(self, mb_per_step: float = 1.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.chunk = int(mb_per_step * 2**20)
        self.kept: list[bytearray] = []

    def step(self, action):
        self.kept.append(bytearray(b"\x01" * self.chunk))  # written, so resident
        return self.env.step(action)


class UnprintableError(Exception):
    """An exception whose ``__str__`` raises, as some wrappers of C++ simulators' errors do."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of a simulator's error failed")


class UnpicklableArgsError(Exception):
    """An exception holding a lock: it does not pickle."""


# Whether this process's OddErrorEnv has raised: once per process, so that a rebuilt env (on_env_error="reset")
# carries on.
_odd_error_raised = False


def odd_exception(kind: str, size: int, worker_only_dir: str) -> Exception:
    """An exception of one of the kinds users' envs raise that are hard to carry (see test_error_delivery.py)."""
    if kind == "huge":
        return ValueError("x" * size)
    if kind == "unprintable":
        return UnprintableError("boom")
    if kind == "unpicklable":
        import threading

        return UnpicklableArgsError(threading.Lock())
    if kind == "worker_only":  # a class the learner cannot import: its module is on the worker's path only
        import importlib
        import sys

        if worker_only_dir not in sys.path:
            sys.path.insert(0, worker_only_dir)
        return importlib.import_module("worker_only_errors").WorkerOnlyError("only the worker knows this class")
    if kind == "chained":
        try:
            raise KeyError("the inner cause")
        except KeyError as inner:
            outer = RuntimeError("the outer error")
            outer.__cause__ = inner
            return outer
    raise ValueError(f"unknown kind {kind!r}")


class OddErrorEnv(gym.Env):
    """CartPole-shaped; raises an :func:`odd_exception` from ``reset`` or at step ``at_step``, once per process."""

    observation_space = spaces.Box(-1, 1, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(
        self, kind: str, phase: str, at_step: int, size: int = 0, worker_only_dir: str = "", delay: float = 0.0
    ) -> None:
        self.kind, self.phase, self.at_step = kind, phase, at_step
        self.size, self.worker_only_dir, self.delay = size, worker_only_dir, delay
        self.t = 0

    def _maybe_raise(self, phase: str) -> None:
        global _odd_error_raised
        if phase == self.phase and not _odd_error_raised and (phase == "reset" or self.t >= self.at_step):
            _odd_error_raised = True
            time.sleep(self.delay)
            raise odd_exception(self.kind, self.size, self.worker_only_dir)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        self._maybe_raise("reset")
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        self._maybe_raise("step")
        return np.full(4, self.t / 100, np.float32), 1.0, False, False, {}


class EmptyLeafEnv(gym.Env):
    """A Dict observation: a 96x96 RGB image beside a Box of shape ``(0,)``, and infos of ``info_bytes`` bytes."""

    observation_space = spaces.Dict(
        {"image": spaces.Box(0, 255, (96, 96, 3), np.uint8), "empty": spaces.Box(-1, 1, (0,), np.float32)}
    )
    action_space = spaces.Dict({"move": spaces.Discrete(3), "none": spaces.Box(-1, 1, (0,), np.float32)})

    def __init__(self, info_bytes: int = 0) -> None:
        self.info_bytes = info_bytes

    def _obs(self) -> dict[str, np.ndarray]:
        image = self.np_random.integers(0, 256, (96, 96, 3), dtype=np.uint8)
        return {"image": image, "empty": np.zeros((0,), np.float32)}

    def _info(self) -> dict[str, Any]:
        return {"blob": self.np_random.bytes(self.info_bytes)} if self.info_bytes else {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self._obs(), self._info()

    def step(self, action):
        return self._obs(), float(action["move"]), False, False, self._info()


class SparseInfoRichEnv(RichSpacesEnv):
    """``RichSpacesEnv`` whose steps report infos only now and then: most steps have none to send.

    A step with no infos is all a worker on the shared step path writes into memory, so this
    exercises both of its replies: the wake-up alone, and the message that carries infos.
    """

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, info if self.t % 4 == 0 else {}


class ScalarInfoCartPole(gym.Wrapper):
    """CartPole whose every step reports the same scalar infos, of several types (as MuJoCo and Atari envs do)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.t = 0

    def reset(self, **kwargs):
        self.t = 0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.t += 1
        info = {"x_position": float(obs[0]), "frame": self.t, "speed": np.float32(obs[1]), "upright": bool(obs[2] > 0)}
        if self.t % 25 == 0:
            info["milestone"] = np.int16(self.t)  # a key the layout does not have: a message for this step
        return obs, reward, terminated, truncated, info


class NestedInfoCartPole(gym.Wrapper):
    """CartPole whose reset and every step report the same numeric infos, nested two deep (as EnvPool's ``players``).

    No ``bool``: a vector env batches it into an object array (Gymnasium's ``_add_info``), which a message carries.
    """

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.t = 0

    def _info(self, obs: np.ndarray) -> dict[str, Any]:
        return {
            "t": self.t,
            "pole": {"angle": np.float32(obs[2]), "upright": np.int8(obs[2] > 0), "state": obs.copy()},
            "players": {"env": {"id": np.int32(7), "pos": np.array([obs[0], -obs[0]], dtype=np.float64)}},
        }

    def reset(self, **kwargs):
        self.t = 0
        obs, _ = self.env.reset(**kwargs)
        return obs, self._info(obs)

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.t += 1
        return obs, reward, terminated, truncated, self._info(obs)


class CountingEnv(gym.Env):
    """Observes its step count; built by its class (no ``OrderEnforcing``), so it steps before any reset.

    Like Stable-Baselines3's ``NanAndInfEnv``: ``SyncVectorEnv`` steps it as it is.
    """

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1e6, (1,), np.float32)
        self.action_space = spaces.Discrete(3)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.t], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t], np.float32), float(action), self.t % 7 == 0, False, {}


class Stall:
    """An info value whose pickling takes ``seconds``: the worker stalls after its envs wrote their observations."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (Stall, (self.seconds,))


class StallingCountingEnv(CountingEnv):
    """:class:`CountingEnv` whose step ``stall_at`` reports a :class:`Stall` info: that reply takes a minute."""

    def __init__(self, stall_at: int) -> None:
        super().__init__()
        self.stall_at = stall_at

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, ({"stall": Stall(60.0)} if self.t == self.stall_at else info)


_steps_in_this_process = itertools.count(1)


class ProcessCounterEnv(gym.Env):
    """Rewards count the steps of every such env in this process: one process or several tell apart.

    Under ``SyncVectorEnv`` env ``i`` of ``n`` gets reward ``i + 1`` on the first step; in a second
    worker the count starts again, so ClusterEnv differs there (what the bench's exactness check must show).
    """

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), float(next(_steps_in_this_process)), False, False, {}


class LockedSpaceEnv(ProcessCounterEnv):
    """An env whose observation space holds a lock: it cannot be pickled, so it cannot travel to the learner."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.observation_space.lock = threading.Lock()  # type: ignore[attr-defined]


class ResizingCartPole(gym.Wrapper):
    """CartPole whose first step tries to resize its learner's step region, through ``/proc/<learner>/fd``.

    What a local worker's env code can reach: the learner is its worker's parent, of the same
    user. Each attempt (growing, then shrinking to nothing, which would leave the learner's
    mapping without pages) appends ``<size> <outcome>`` to ``log``.
    """

    def __init__(self, log: str) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.log = log
        self.tried = False

    def step(self, action):
        if not self.tried:
            self.tried = True
            learner_fds = f"/proc/{os.getppid()}/fd"
            for fd in os.listdir(learner_fds):
                path = os.path.join(learner_fds, fd)
                try:
                    if "clusterenv-steps" not in os.readlink(path):
                        continue
                except OSError:
                    continue
                for size in (1 << 30, 0):
                    try:
                        os.truncate(path, size)
                        outcome = "resized"
                    except OSError as exc:
                        outcome = f"refused ({errno.errorcode[exc.errno]})"
                    with open(self.log, "a") as f:
                        f.write(f"{size} {outcome}\n")
        return self.env.step(action)


class WarningEnv(gym.Env):
    """Warns as it is built (a Box whose bounds lose precision, as Stable-Baselines3's test envs' do), and at each step.

    Its ``shout()`` method warns too, for attribute calls. ``loud=False``: the same env, silent.
    """

    action_space = spaces.Discrete(2)

    def __init__(self, loud: bool = True) -> None:
        bound = np.full(2, 1.1, dtype=np.float64 if loud else np.float32)
        self.observation_space = spaces.Box(-bound, bound, dtype=np.float32)
        self.loud = loud

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        if self.loud:
            warnings.warn("WarningEnv stepped", UserWarning, stacklevel=1)
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def shout(self) -> str:
        if self.loud:
            warnings.warn("WarningEnv called", RuntimeWarning, stacklevel=1)
        return "shouted"
