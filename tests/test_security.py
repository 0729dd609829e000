"""Only peers holding the shared secret are heard; nothing else is unpickled, and nothing crashes."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterenv import ClusterEnv, ProtocolError
from clusterenv.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION, Kind, _mac, coalesce, decode, encode, split
from clusterenv.transport import SECRET_ENV_VAR, Channel

SECRET = "correct horse battery staple"
WRONG = "incorrect horse battery staple"
ENV_FNS = [functools.partial(gym.make, "CartPole-v1")] * 2


class Marker:
    """A pickle that creates a file when it is loaded: the payload an attacker would send."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def attacks(marker: Path) -> list[list[bytes]]:
    """Frames a peer without the secret might send, each carrying the marker payload where it can."""
    payload = pickle.dumps(Marker(marker))
    forged = encode(Kind.INIT, {"env_offset": 0}, blobs=[payload], key=WRONG.encode(), cover_arrays=True)
    valid = coalesce(encode(Kind.RESULT, {"seq": 1}, blobs=[payload], key=SECRET.encode(), cover_arrays=True))
    return [
        coalesce(forged),  # wrong secret
        forged[:-1] + [b""],  # no MAC
        [payload],  # a bare pickle, as recv_pyobj would take it
        [valid[0][:-7]],  # truncated
        [valid[0][:5] + b"\xff" + valid[0][6:]],  # one byte changed
        [b"\x00" * (4 << 20)],  # 4 MiB of nothing
        [msgpack.packb([PROTOCOL_VERSION, int(Kind.HELLO), {"pad": "x" * MAX_HEADER_BYTES}, [], 0]), b"mac"],
        [msgpack.packb([PROTOCOL_VERSION, int(Kind.RESULT), {}, [["<f8", [1 << 40]]], 0]), b"", b"mac"],
    ]


def test_marker_payload_runs_when_unpickled(tmp_path):
    # The control for the tests below: this payload would be caught executing.
    pickle.loads(pickle.dumps(Marker(tmp_path / "control")))
    assert (tmp_path / "control").exists()


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:*", "tcp://[::]:*", "tcp://example.org:5555"])
def test_binding_beyond_loopback_without_a_secret_is_refused(bind, monkeypatch):
    monkeypatch.delenv(SECRET_ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="Refusing to bind .* without a shared secret"):
        ClusterEnv(ENV_FNS, num_workers=1, bind=bind)


def test_external_workers_without_a_secret_are_refused_rather_than_locked_out(monkeypatch):
    monkeypatch.delenv(SECRET_ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="launcher='external'.* must know the learner's secret"):
        ClusterEnv(ENV_FNS, num_workers=1, bind="tcp://127.0.0.1:*", launcher="external")


def test_learner_drops_unauthenticated_peers_and_keeps_serving(tmp_path, caplog):
    marker = tmp_path / "learner-executed"
    with ClusterEnv(ENV_FNS, num_workers=1, bind="tcp://127.0.0.1:*", secret=SECRET, timeout=30) as envs:
        envs.reset(seed=0)
        context = zmq.Context()
        rogue = context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(envs.address)
        try:
            with caplog.at_level(logging.WARNING, logger="clusterenv.transport"):
                for frames in attacks(marker):
                    rogue.send_multipart(frames)
                # The rogue messages are read (and dropped) while the learner waits for replies.
                for _ in range(50):
                    envs.step(np.array([0, 1]))
                    if len(dropped(caplog)) == len(attacks(marker)):
                        break
        finally:
            rogue.close()
            context.term()
    assert len(dropped(caplog)) == len(attacks(marker)), [r.getMessage() for r in caplog.records]
    assert not marker.exists()


def dropped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Dropped a message")]


def test_worker_drops_unauthenticated_learner_messages(tmp_path):
    """A fake learner without the secret cannot make a worker run its payload, nor crash it."""
    marker = tmp_path / "worker-executed"
    context = zmq.Context()
    learner = Channel.bind_router(context, "tcp://127.0.0.1:*", SECRET.encode())
    env = {**os.environ, SECRET_ENV_VAR: SECRET, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "clusterenv.worker", "--connect", learner.endpoint, "--join-timeout", "60"]
    worker = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        hello = learner.recv(30, routed=True)
        assert hello is not None and hello[1].kind is Kind.HELLO  # the worker proves it holds the secret
        identity = hello[0]
        for frames in attacks(marker):
            learner.socket.send_multipart([identity, *frames])
        # A valid command still gets its answer: the worker survived everything above.
        learner.send(Kind.CALL, {"seq": 5, "name": "spec"}, blobs=[pickle.dumps(((), {}))], to=identity)
        reply = learner.recv(30, routed=True)
        assert reply is not None and reply[1].kind is Kind.ERROR and reply[1].meta["seq"] == 5
        assert "CALL before INIT" in reply[1].meta["message"]
        learner.send(Kind.CLOSE, {"seq": 6}, to=identity)
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()
        _, stderr = worker.communicate()
        learner.close()
        context.term()
    assert stderr.count("Dropped a message") == len(attacks(marker)), stderr
    assert not marker.exists()


# -- the decoder, fuzzed ---------------------------------------------------------------------
KEY = b"k" * 32
frames_strategy = st.lists(st.binary(max_size=96), min_size=0, max_size=6)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=6,
)
dtype_names = st.sampled_from(
    ["<f4", "|u1", "<i8", "|b1", "<c16", ">f8", "O", "V8", "|S3", "<U2", "M8", "i4,i4", "(2)f4", "x"]
)


def itemsize(name: str) -> int:
    try:
        return np.dtype(name).itemsize
    except Exception:
        return 1


@st.composite
def authenticated_messages(draw) -> list[bytes]:
    """Messages a key holder could send: mostly well-formed, with one part off in some way."""
    specs = draw(st.lists(st.tuples(dtype_names, st.lists(st.integers(0, 4), max_size=3)), max_size=3))
    n_blobs = draw(st.integers(0, 2))
    fields = [PROTOCOL_VERSION, int(draw(st.sampled_from(list(Kind)))), {"seq": 1}, [list(s) for s in specs], n_blobs]
    if draw(st.booleans()):
        fields[draw(st.integers(0, 4))] = draw(msgpack_values | st.integers(-(2**63), -1))
    form = draw(st.sampled_from(["list"] * 8 + ["short", "any"]))
    header = fields if form == "list" else fields[:4] if form == "short" else draw(msgpack_values)
    arrays = [
        b"\x01" * (int(np.prod(shape)) * itemsize(name) + draw(st.sampled_from([0, 0, 0, 1, -1])))
        for name, shape in specs
    ]
    frames = [msgpack.packb(header), *(a for a in arrays), *(b"blob" for _ in range(n_blobs))]
    if draw(st.integers(0, 4)) == 0:
        frames = frames[:-1] if len(frames) > 1 and draw(st.booleans()) else [*frames, b"extra"]
    return [*frames, _mac(KEY, frames)]


def decode_or_protocol_error(frames):
    try:
        return decode(split(frames), key=KEY, cover_arrays=True)
    except ProtocolError:
        return None


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames_strategy)
def test_fuzz_arbitrary_frames_only_raise_protocol_error(frames):
    assert decode_or_protocol_error(frames) is None  # without the key, nothing decodes


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(authenticated_messages(), st.booleans())
def test_fuzz_authenticated_messages_only_raise_protocol_error(frames, coalesced):
    """Past the MAC check (as a peer holding the key could get), the parser must still only reject."""
    message = decode_or_protocol_error(coalesce(frames) if coalesced else frames)
    if message is not None:
        assert isinstance(message.kind, Kind)
        for array in message.arrays:
            assert array.dtype.kind in "biufc" and not array.flags.writeable


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_tampered_messages_never_decode(data):
    array = np.arange(data.draw(st.integers(0, 40)), dtype=np.float32)
    frames = encode(Kind.RESULT, {"seq": 3}, [array], [b"blob"], key=KEY, cover_arrays=True)
    wire = bytearray(coalesce(frames)[0])
    position = data.draw(st.integers(0, len(wire) - 1))
    if data.draw(st.booleans()):
        wire[position] ^= data.draw(st.integers(1, 255))
    else:
        del wire[position:]
    assert decode_or_protocol_error([bytes(wire)]) is None
