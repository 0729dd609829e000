"""Workers pack their slice's infos; the learner's merge is exactly Gymnasium's env-by-env batching.

The reference is ``VectorEnv._add_info`` over every env in order, which is what
``SyncVectorEnv`` runs. The property holds for any info structure, split any way into
worker slices, after the payload crossed the wire (pickle).
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import VectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clusterenv.wire import infos as wire_infos
from clusterenv.wire.infos import PACK_MIN_ENVS, merge_infos, pack_infos, records_of


class _Batcher(VectorEnv):
    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def sync_vector_env_infos(env_infos: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``SyncVectorEnv`` builds from these per-env infos."""
    batcher, infos = _Batcher(len(env_infos)), {}
    for index, info in enumerate(env_infos):
        if info:  # as SyncVectorEnv: an empty info adds nothing
            infos = batcher._add_info(infos, info, index)
    return infos


def merged_through_workers(env_infos: list[dict[str, Any]], cuts: list[int]) -> dict[str, Any]:
    """Each slice packed by its worker (whatever its size), sent (pickled), and merged by the learner in env order."""
    bounds = [0, *sorted(set(cuts)), len(env_infos)]
    infos: dict[str, Any] = {}
    for start, stop in zip(bounds, bounds[1:], strict=False):
        if start == stop:
            continue
        records = [(i - start, env_infos[i]) for i in range(start, stop) if env_infos[i]]
        payload = pickle.loads(pickle.dumps(pack_infos(records, stop - start, min_envs=1)))
        infos = merge_infos(infos, payload, len(env_infos), start)
    return infos


def assert_same(expected: Any, actual: Any, where: str = "infos") -> None:
    """Equal to the bit: types, key order, dtypes (by character code), shapes and bytes."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype.char, actual.shape) == (expected.dtype.char, expected.shape), where
        if expected.dtype == object:
            for index, item in enumerate(expected.flat):
                assert_same(item, actual.flat[index], f"{where}.flat[{index}]")
        else:
            assert actual.tobytes() == expected.tobytes(), f"{where}: {actual!r} != {expected!r}"
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{where}[{index}]")
    elif isinstance(expected, np.generic):
        assert actual.tobytes() == expected.tobytes(), where
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), where
    else:
        assert actual == expected, where


KEYS = st.sampled_from(["lives", "score", "x", "final_obs", "final_info", "_x", "__x", 3])
NUMPY_SCALARS = st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.uint8, np.bool_, np.longlong]).flatmap(
    lambda kind: st.integers(0, 200).map(kind)
)
NUMPY_ARRAYS = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.int64, np.uint8, np.bool_]),
    shape=st.sampled_from([(), (2,), (2, 3)]),
)
LEAVES = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    NUMPY_SCALARS,
    NUMPY_ARRAYS,
    st.none(),
    st.text(max_size=2),
    st.lists(st.integers(0, 3), max_size=2),
    st.tuples(st.integers(0, 3)),
)
VALUES = st.recursive(LEAVES, lambda inner: st.dictionaries(KEYS, inner, max_size=3), max_leaves=6)
# Each key of one type in every env, as real envs report them (the case packing is for).
TYPED_LEAVES = [
    st.integers(0, 2**40),
    st.floats(allow_nan=True),
    st.booleans(),
    st.integers(0, 200).map(np.float32),
    hnp.arrays(np.float32, (2,)),
    hnp.arrays(np.uint8, (2, 3)),
    st.text(max_size=2),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2),
]


@st.composite
def typed_env_infos(draw: st.DrawFn) -> list[dict[str, Any]]:
    keys = draw(st.lists(st.sampled_from(["lives", "score", "final_obs", "final_info"]), unique=True, max_size=3))
    values = {key: draw(st.sampled_from(TYPED_LEAVES)) for key in keys}
    return draw(st.lists(st.fixed_dictionaries({}, optional=values), min_size=1, max_size=7))


ENV_INFOS = st.one_of(st.lists(st.dictionaries(KEYS, VALUES, max_size=4), min_size=1, max_size=7), typed_env_infos())


def outcome(build: Any) -> tuple[str, Any]:
    try:
        return "value", build()
    except Exception as error:  # Gymnasium's batching raises on some mixes (NaN into an int array)
        return "error", type(error)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env_infos=ENV_INFOS, cuts=st.lists(st.integers(0, 7), max_size=4))
def test_merging_packed_slices_is_exactly_sync_vector_env_batching(env_infos, cuts) -> None:
    cuts = [cut for cut in cuts if cut <= len(env_infos)]
    env_infos = pickle.loads(pickle.dumps(env_infos))  # values as any transport delivers them
    expected = outcome(lambda: sync_vector_env_infos(env_infos))
    actual = outcome(lambda: merged_through_workers(env_infos, cuts))
    assert actual[0] == expected[0], (expected, actual)
    if expected[0] == "error":
        assert actual[1] is expected[1]
    else:
        assert_same(expected[1], actual[1])


@settings(max_examples=200, deadline=None)
@given(env_infos=ENV_INFOS)
def test_a_packed_slice_gives_back_its_records(env_infos) -> None:
    env_infos = pickle.loads(pickle.dumps(env_infos))
    records = [(i, info) for i, info in enumerate(env_infos) if info]
    payload = pickle.loads(pickle.dumps(pack_infos(records, len(env_infos), min_envs=1)))
    rebuilt = dict(records_of(payload))
    assert_same(
        outcome(lambda: sync_vector_env_infos(env_infos)),
        outcome(lambda: sync_vector_env_infos([rebuilt.get(i, {}) for i in range(len(env_infos))])),
    )


def atari_infos(start: int, count: int) -> list[tuple[int, dict[str, Any]]]:
    return [
        (i, {"lives": 3, "episode_frame_number": 4 * (start + i), "frame_number": 100 + start + i})
        for i in range(count)
    ]


def test_uniform_slices_are_placed_without_a_per_env_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = [pack_infos(atari_infos(start, 8), 8) for start in (0, 8)]
    assert all(isinstance(payload, tuple) for payload in payloads)  # packed, not records

    def no_replay(*args: Any) -> Any:
        raise AssertionError("a uniform slice was replayed env by env")

    monkeypatch.setattr(wire_infos, "replay_infos", no_replay)
    infos: dict[str, Any] = {}
    for start, payload in zip((0, 8), payloads, strict=True):
        infos = merge_infos(infos, payload, 16, start)
    expected = sync_vector_env_infos([info for start in (0, 8) for _, info in atari_infos(start, 8)])
    assert_same(expected, infos)


def test_slices_that_disagree_are_replayed_and_still_exact() -> None:
    """An ``int`` key in one slice, a ``float`` one in the next: the first env's type decides, as in SyncVectorEnv."""
    env_infos = [{"x": 1}, {"x": 2}, {"x": 2.5}, {"x": np.float32(0.1)}]
    assert_same(sync_vector_env_infos(env_infos), merged_through_workers(env_infos, [2, 3]))
    assert merged_through_workers(env_infos, [2, 3])["x"].tolist() == [1, 2, 2, 0]


def test_slices_that_cannot_be_packed_travel_as_records() -> None:
    mixed = [(0, {"x": 1}), (1, {"x": 1.5})]
    underscore = [(0, {"_x": 1})]
    too_large = [(0, {"x": 2**70})]
    for records in (mixed, underscore, too_large):
        assert pack_infos(records, 2, min_envs=1) == records


def test_slices_of_few_envs_travel_as_records() -> None:
    records = atari_infos(0, PACK_MIN_ENVS - 1)
    assert pack_infos(records, PACK_MIN_ENVS - 1) == records
    assert isinstance(pack_infos(atari_infos(0, PACK_MIN_ENVS), PACK_MIN_ENVS), tuple)


def test_int64_infos_pack_even_after_longlong_ones_were_seen():
    """``q`` and ``l`` dtypes are equal int64s; only the canonical one packs, whichever was seen first."""
    longlong = [(i, {"n": np.array(i, dtype=np.longlong)[()]}) for i in range(4)]
    int64 = [(i, {"n": np.int64(i)}) for i in range(4)]
    assert np.dtype(np.longlong) == np.dtype(np.int64)
    pack_infos(longlong, 4)
    assert isinstance(pack_infos(int64, 4), tuple)  # packed in columns, not sent as records
