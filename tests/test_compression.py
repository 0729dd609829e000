"""Compressed array frames: lossless, decompressed only after the MAC, and never past the size their array declares."""

from __future__ import annotations

import dataclasses
import functools
from contextlib import closing

import lz4.block
import msgpack
import numpy as np
import pytest
import torch
import zstandard
from gymnasium.vector import SyncVectorEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import clusterenv
from clusterenv import AuthenticationError, ClusterEnv, EveryUpdate, PolicyRunner, ProtocolError
from clusterenv.wire import codecs, protocol
from clusterenv.wire.protocol import PROTOCOL_VERSION, Kind, decode, pack, trailer
from tests.conftest import assert_same
from tests.envs import SpriteEnv
from tests.test_remote import run_lockstep

KEY = b"k" * 32
CODECS = list(codecs.CODECS)


def authenticated(specs: list, frames: list[bytes]) -> list[bytes]:
    """A message whose MAC is right for ``KEY``, with whatever array specs and frames a key holder sends."""
    body = [msgpack.packb([PROTOCOL_VERSION, int(Kind.RESULT), {}, specs, 0]), *frames]
    return [*body, trailer(KEY, 1, len(frames), body, cover_arrays=True)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(
        st.sampled_from([np.uint8, np.int16, np.float32, np.float64, np.bool_]),
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=40),
    ),
    st.sampled_from(CODECS),
    st.booleans(),
)
def test_arrays_come_back_bit_for_bit_whatever_the_codec(array, codec, zeros):
    if zeros:
        array = np.zeros_like(array)  # compresses: a frame that shrinks travels compressed
    frames = pack(Kind.RESULT, {}, [array], [b"infos"], key=KEY, counter=1, cover_arrays=True, compression=codec)
    _, message = decode(frames, key=KEY, cover_arrays=True)
    assert_same(message.arrays, [array])
    assert not message.arrays[0].flags.writeable
    header = msgpack.unpackb(protocol.split(frames)[0])
    compressed = len(header[3][0]) == 3
    if array.nbytes < codecs.MIN_BYTES:
        assert not compressed  # small frames travel as they are
    elif zeros:
        assert compressed


@pytest.mark.parametrize("codec", CODECS)
def test_nothing_is_decompressed_before_the_mac_is_checked(codec, monkeypatch):
    frames = pack(
        Kind.RESULT, {}, [np.zeros(1 << 16, np.uint8)], key=b"w" * 32, counter=1, cover_arrays=True, compression=codec
    )

    def decompress(*args):
        raise AssertionError("decompressed a frame whose MAC was not checked")

    monkeypatch.setattr(codecs, "decompress", decompress)
    with pytest.raises(AuthenticationError):
        decode(frames, key=KEY, cover_arrays=True)


BOMBS = {
    # A frame that decompresses to more than its array's 4,096 bytes.
    "lz4": lz4.block.compress(bytes(1 << 20), store_size=False),
    "zstd": zstandard.ZstdCompressor().compress(bytes(1 << 20)),
}


@pytest.mark.parametrize("codec", CODECS)
def test_a_frame_that_decompresses_past_its_array_is_refused(codec):
    frames = authenticated([["|u1", [4096], codec]], [BOMBS[codec]])
    with pytest.raises(ProtocolError, match=r"(declares 1048576 bytes; its array needs 4096|does not decompress)"):
        decode(frames, key=KEY, cover_arrays=True)


@pytest.mark.parametrize("codec", CODECS)
def test_a_frame_that_decompresses_short_of_its_array_is_refused(codec):
    frames = authenticated([["|u1", [1 << 21], codec]], [BOMBS[codec]])
    with pytest.raises(
        ProtocolError, match=r"(declares 1048576 bytes; its array needs 2097152|decompressed to 1048576)"
    ):
        decode(frames, key=KEY, cover_arrays=True)


def test_arrays_declaring_more_than_the_limit_are_refused_before_decompression(monkeypatch):
    monkeypatch.setattr(codecs, "decompress", lambda *args: pytest.fail("decompressed past the size limit"))
    frames = authenticated([["<f8", [1 << 40], "zstd"]], [BOMBS["zstd"]])
    with pytest.raises(ProtocolError, match=r"declare 8796093022208 bytes, more than 1024"):
        decode(frames, key=KEY, cover_arrays=True, max_array_bytes=1024)


def test_an_unknown_codec_is_refused():
    frames = authenticated([["|u1", [4], "gzip"]], [b"\x00" * 4])
    with pytest.raises(ProtocolError, match=r"with a codec in \['lz4', 'zstd'\]"):
        decode(frames, key=KEY, cover_arrays=True)


# -- end to end -----------------------------------------------------------------------------
ENV_FNS = [functools.partial(SpriteEnv, size=96)] * 4


@pytest.mark.parametrize("compression", [None, *CODECS])
def test_tcp_workers_with_compression_are_exact(compression):
    with (
        ClusterEnv(
            ENV_FNS, num_workers=2, bind="tcp://127.0.0.1:*", shared_memory=False, compression=compression
        ) as envs,
        closing(SyncVectorEnv(ENV_FNS)) as reference,
    ):
        run_lockstep(envs, reference, steps=40)


class ImageActor(torch.nn.Module):
    """Logits from 96x96x3 uint8 images: 110,596 weights, a frame large enough to compress."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(96 * 96 * 3, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs.flatten(1).float() / 255.0)


def test_rollouts_and_weights_travel_compressed_and_exact():
    """The same rollouts, acted by the same weights, whether frames were compressed or not."""
    batches = []
    for compression in (None, "zstd"):
        with ClusterEnv(
            ENV_FNS, num_workers=2, bind="tcp://127.0.0.1:*", shared_memory=False, compression=compression
        ) as envs:
            envs.reset(seed=3)
            torch.manual_seed(0)
            actor = ImageActor()
            runner = PolicyRunner(envs, actor, EveryUpdate(), seed=0)
            first = runner.rollout(8)
            with torch.no_grad():
                actor.linear.weight.mul_(-1.0)  # the next rollout acts with pulled, changed weights
            runner.publish(actor)
            batches.append([dataclasses.asdict(first), dataclasses.asdict(runner.rollout(8))])
    assert_same(batches[0], batches[1])


def test_settings_are_checked_and_make_vec_passes_shared_memory_through():
    with pytest.raises(ValueError, match=r"`compression` must be None or one of \['lz4', 'zstd'\], got 'gzip'"):
        ClusterEnv(ENV_FNS, num_workers=1, compression="gzip")
    with pytest.raises(TypeError, match=r"`shared_memory` must be True or False, got str \('no'\)"):
        ClusterEnv(ENV_FNS, num_workers=1, shared_memory="no")
    envs = clusterenv.make_vec("CartPole-v1", num_envs=2, vector_kwargs={"num_workers": 1, "shared_memory": False})
    with envs:
        assert envs.shared_memory is False
