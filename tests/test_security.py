"""Only peers holding the shared secret are heard, once; nothing else is unpickled, and nothing crashes."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clusterenv import AuthenticationError, ClusterEnv, ProtocolError, WorkerStartError
from clusterenv.learner.heartbeat_monitor import HeartbeatMonitor
from clusterenv.wire import codecs, protocol, transport
from clusterenv.wire.liveness import HEARTBEAT_MAX_BYTES, Heartbeat
from clusterenv.wire.protocol import (
    COALESCE_BYTES,
    MAX_HEADER_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Kind,
    coalesce,
    encode,
    hello_session,
    parse,
    read_trailer,
    session_pair,
    split,
    trailer,
)
from clusterenv.wire.transport import DROP_LOG_BURST, PRE_JOIN_BYTES, SECRET_ENV_VAR, Channel
from tests.conftest import assert_same
from tests.test_remote import SECRET as WORKER_SECRET  # what the `spawn` fixture gives its processes
from tests.test_remote import free_address, spawn, worker_command  # noqa: F401 (spawn is a fixture)

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
    wrong, right = hello_session(WRONG.encode()).send_key, hello_session(SECRET.encode()).send_key
    forged = encode(Kind.INIT, {"env_offset": 0}, blobs=[payload], key=wrong, counter=1, cover_arrays=True)
    valid = coalesce(encode(Kind.RESULT, {"seq": 1}, blobs=[payload], key=right, counter=1, cover_arrays=True))
    return [
        coalesce(forged),  # wrong secret
        forged[:-1] + [b""],  # no trailer
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
            with caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
                for frames in attacks(marker):
                    rogue.send_multipart(frames)
                # The rogue messages are read (and dropped) while the learner waits for replies.
                deadline = time.monotonic() + 10
                while len(dropped(caplog)) < len(attacks(marker)) and time.monotonic() < deadline:
                    envs.step(np.array([0, 1]))
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
        assert hello is not None and hello[1].kind is Kind.HELLO  # the worker joined: it holds the secret
        identity = hello[0]
        for frames in attacks(marker):
            learner.socket.send_multipart([identity, *frames])
        # A valid command still gets its answer: the worker survived everything above.
        learner.send(
            Kind.CALL, {"seq": 5, "name": "spec", "indices": None}, blobs=[pickle.dumps(((), {}))], to=identity
        )
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
SEND_KEY = hello_session(KEY).send_key
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


def decode(frames, *, key, cover_arrays):
    """What a receiving end does (``protocol.decode``): check the MAC before anything is parsed, then parse."""
    return protocol.decode(frames, key=key, cover_arrays=cover_arrays)[1]


def signed(frames: list[bytes], n_arrays: int, counter: int = 1) -> list[bytes]:
    """``frames`` with a valid trailer, as a holder of the key would send them."""
    return [*frames, trailer(SEND_KEY, counter, n_arrays, frames, True)]


@st.composite
def authenticated_messages(draw) -> list[bytes]:
    """Messages a key holder could send: mostly well-formed, with one part off in some way."""
    specs = draw(st.lists(st.tuples(dtype_names, st.lists(st.integers(0, 4), max_size=3)), max_size=3))
    # Some frames claim a codec (a real one, an unknown one, or not a string), with bytes that may decompress.
    claimed = [draw(st.sampled_from([None] * 4 + ["lz4", "zstd", "gzip", 7])) for _ in specs]
    n_blobs = draw(st.integers(0, 2))
    listed = [[*s] if c is None else [*s, c] for s, c in zip(specs, claimed, strict=True)]
    fields = [PROTOCOL_VERSION, int(draw(st.sampled_from(list(Kind)))), {"seq": 1}, listed, n_blobs]
    if draw(st.booleans()):
        fields[draw(st.integers(0, 4))] = draw(msgpack_values | st.integers(-(2**63), -1))
    form = draw(st.sampled_from(["list"] * 8 + ["short", "any"]))
    header = fields if form == "list" else fields[:4] if form == "short" else draw(msgpack_values)
    arrays = [
        b"\x01" * (int(np.prod(shape)) * itemsize(name) + draw(st.sampled_from([0, 0, 0, 1, -1])))
        for name, shape in specs
    ]
    for i, codec in enumerate(claimed):
        if codec in codecs.CODECS and draw(st.booleans()):
            arrays[i] = codecs.compress(codec, arrays[i])
        elif codec is not None:
            arrays[i] = draw(st.binary(max_size=48))
    frames = [msgpack.packb(header), *(a for a in arrays), *(b"blob" for _ in range(n_blobs))]
    if draw(st.integers(0, 4)) == 0:
        frames = frames[:-1] if len(frames) > 1 and draw(st.booleans()) else [*frames, b"extra"]
    n_arrays = len(specs) + draw(st.sampled_from([0] * 8 + [-1, 1, 1 << 31]))
    return signed(frames, max(0, min(n_arrays, 2**32 - 1)))


def decode_or_protocol_error(frames):
    try:
        return decode(split(frames), key=SEND_KEY, cover_arrays=True)
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
    frames = encode(Kind.RESULT, {"seq": 3}, [array], [b"blob"], key=SEND_KEY, counter=7, cover_arrays=True)
    wire = bytearray(coalesce(frames)[0])
    position = data.draw(st.integers(0, len(wire) - 1))
    if data.draw(st.booleans()):
        wire[position] ^= data.draw(st.integers(1, 255))
    else:
        del wire[position:]
    assert decode_or_protocol_error([bytes(wire)]) is None


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(0, 40_000), max_size=3),
    st.lists(st.binary(max_size=40_000), max_size=2),
    st.booleans(),
)
def test_packing_in_one_pass_sends_what_encoding_then_coalescing_sends(lengths, blobs, cover_arrays):
    """``pack`` (what channels send) is byte for byte ``coalesce(encode(...))``, below and above the coalescing size."""
    arrays = [np.arange(n, dtype=np.uint8).reshape(-1, 1) for n in lengths]
    arrays.append(np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2])  # not contiguous
    args = (Kind.RESULT, {"seq": 9}, arrays, blobs)
    packed = protocol.pack(*args, key=SEND_KEY, counter=4, cover_arrays=cover_arrays)
    expected = coalesce(encode(*args, key=SEND_KEY, counter=4, cover_arrays=cover_arrays))
    assert [bytes(f) for f in packed] == [bytes(f) for f in expected]
    counter, message = protocol.decode(packed, key=SEND_KEY, cover_arrays=cover_arrays)
    assert counter == 4 and message.blobs == blobs
    assert_same(message.arrays, [np.ascontiguousarray(a) for a in arrays])


# -- the MAC before anything else ----------------------------------------------------------
def test_the_mac_is_checked_before_msgpack_parses_anything(monkeypatch):
    forged = encode(Kind.RESULT, {"seq": 1}, key=hello_session(WRONG.encode()).send_key, counter=1, cover_arrays=True)

    def unpackb(*args, **kwargs):
        raise AssertionError("msgpack parsed a header whose MAC was not checked")

    monkeypatch.setattr(protocol.msgpack, "unpackb", unpackb)
    with pytest.raises(AuthenticationError):
        decode(forged, key=SEND_KEY, cover_arrays=True)
    with pytest.raises(AuthenticationError):
        decode(split(coalesce(forged)), key=SEND_KEY, cover_arrays=False)


class HugeFrame:
    """A frame whose length says too much; copying it would fail the test."""

    def __len__(self) -> int:
        return MAX_HEADER_BYTES + 1

    def __bytes__(self) -> bytes:
        raise AssertionError("the header was copied before its size was checked")


def test_the_header_size_is_checked_before_it_is_copied():
    with pytest.raises(ProtocolError, match=f"exceeds the {MAX_HEADER_BYTES}-byte limit"):
        parse([HugeFrame(), b"trailer"], 0)


def test_the_mac_covers_the_array_count_and_the_frame_lengths():
    array, blob = np.arange(4, dtype=np.uint8), b"blob"
    frames = encode(Kind.RESULT, {}, [array], [blob], key=SEND_KEY, counter=1, cover_arrays=False)
    counter, _, tag = read_trailer(frames[-1])
    as_blob = [
        frames[0],
        frames[1],
        frames[2],
        struct.pack("<QI32s", counter, 0, tag),
    ]  # the array passed off as a blob
    with pytest.raises(AuthenticationError):
        decode(as_blob, key=SEND_KEY, cover_arrays=False)
    longer = [frames[0], np.arange(5, dtype=np.uint8), frames[2], frames[3]]  # uncovered, yet its length is
    with pytest.raises(AuthenticationError):
        decode(longer, key=SEND_KEY, cover_arrays=False)


# -- joining, keys and replays ---------------------------------------------------------------
class Net:
    """Sockets, channels and heartbeat monitors for one test, all closed when it ends (even when it fails)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.opened: list = []

    def learner(self) -> Channel:
        channel = Channel.bind_router(self.context, "tcp://127.0.0.1:*", SECRET.encode())
        self.opened.append(channel)
        return channel

    def worker(self, address: str, identity: bytes = b"worker-0-1234") -> Channel:
        channel = Channel.connect_dealer(self.context, address, SECRET.encode(), identity)
        self.opened.append(channel)
        return channel

    def raw(self, kind: int, identity: bytes | None = None) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            socket.setsockopt(zmq.IDENTITY, identity)
        self.opened.append(socket)
        return socket

    def monitor(self, busy_timeout: float | None = 300.0) -> HeartbeatMonitor:
        config = Heartbeat(interval=0.05, liveness=4, busy_timeout=busy_timeout)
        monitor = HeartbeatMonitor(self.context, None, SECRET.encode(), config)
        self.opened.append(monitor)
        return monitor

    def close(self) -> None:
        for thing in reversed(self.opened):
            thing.close()
        self.context.term()


@pytest.fixture
def net():
    net = Net()
    yield net
    net.close()


def join(learner: Channel, worker: Channel, **hello) -> tuple[bytes | None, protocol.Message]:
    """Run the three-message join between two in-process channels; returns what the learner's caller sees."""
    worker.send(Kind.HELLO, {"worker_id": 0, "pid": 1, "host": "h", **hello})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert worker.recv(0.01, routed=False) is None  # WELCOME is answered inside the channel
        received = learner.recv(0.01, routed=True)
        if received is not None:
            return received
    raise AssertionError("the join did not complete within 30 s")


def wire_kinds(socket: zmq.Socket, timeout: float) -> list[Kind]:
    """The kinds of the messages waiting on a raw socket, read from their headers without checking anything."""
    kinds = []
    while socket.poll(int(timeout * 1000)):
        frames = socket.recv_multipart()
        kinds.append(Kind(msgpack.unpackb(bytes(split(frames)[0]))[1]))
        timeout = 0.2
    return kinds


def test_the_learner_sees_a_worker_only_once_it_proved_its_keys(net):
    learner = net.learner()
    worker = net.worker(learner.endpoint)
    sender, hello = join(learner, worker, worker_id=0, host="h")
    assert (
        sender == b"worker-0-1234"
        and hello.kind is Kind.HELLO
        and hello.meta == {"worker_id": 0, "pid": 1, "host": "h"}
    )
    learner.send(Kind.CALL, {"seq": 1, "name": "spec", "indices": None}, to=sender)
    received = worker.recv(10, routed=False)
    assert received is not None and received[1].kind is Kind.CALL
    worker.send(Kind.VALUE, {"seq": 1})
    received = learner.recv(10, routed=True)
    assert received is not None and received[1].kind is Kind.VALUE
    assert learner.heartbeat_session(sender).send_key != worker.heartbeat_session().send_key


def test_a_replayed_hello_does_not_join(net):
    """Captured traffic replayed to a learner with the same secret: the HELLO earns only a WELCOME."""
    sniffer = net.raw(zmq.ROUTER)
    port = sniffer.bind_to_random_port("tcp://127.0.0.1")
    worker = net.worker(f"tcp://127.0.0.1:{port}")
    worker.send(Kind.HELLO, {"worker_id": 0, "pid": 1, "host": "h"})
    captured = sniffer.recv_multipart()[1:]  # the HELLO as it crossed the network

    address = free_address()
    replayer = net.raw(zmq.DEALER, b"worker-0-1234")
    replayer.connect(address)  # ZeroMQ delivers the HELLO once the learner binds
    replayer.send_multipart(captured)
    expected = "0 of 1 workers joined"
    with pytest.raises(WorkerStartError, match=expected):
        ClusterEnv(ENV_FNS, num_workers=1, bind=address, secret=SECRET, launcher="external", start_timeout=3)
    assert wire_kinds(replayer, 1) == [Kind.WELCOME]  # no INIT: no env factories, no seat taken


def test_replayed_and_reordered_messages_are_dropped(net, caplog):
    learner = net.learner()
    worker = net.worker(learner.endpoint)
    join(learner, worker)
    session = worker.sessions[None]

    def frames(counter: int) -> list:
        return encode(Kind.VALUE, {"seq": counter}, key=session.send_key, counter=counter, cover_arrays=True)

    base = session.sent
    for counter in [base + 1, base + 1, base + 3, base + 2, base + 4]:  # a replay, then a reordering
        worker.socket.send_multipart(frames(counter))
    seen = []
    with caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
        while (received := learner.recv(2, routed=True)) is not None:
            seen.append(received[1].meta["seq"])
    assert seen == [base + 1, base + 3, base + 4]
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 2 and all("a replayed or reordered message" in r for r in reasons), reasons


def test_keys_belong_to_one_connection_and_one_direction():
    nonces = [os.urandom(NONCE_BYTES) for _ in range(3)]
    learner, worker = session_pair(SECRET.encode(), nonces[0], nonces[1], b"w")
    other, _ = session_pair(SECRET.encode(), nonces[0], nonces[2], b"w")
    renamed, _ = session_pair(SECRET.encode(), nonces[0], nonces[1], b"v")
    sent = encode(Kind.STEP, {"seq": 1}, key=learner.send_key, counter=1, cover_arrays=True)
    assert decode(sent, key=worker.recv_key, cover_arrays=True).kind is Kind.STEP
    for wrong in [learner.recv_key, other.recv_key, renamed.recv_key, worker.heartbeat.recv_key]:  # type: ignore[union-attr]
        with pytest.raises(AuthenticationError):
            decode(sent, key=wrong, cover_arrays=True)  # reflected, another join, another worker, heartbeats


def watched_beat(net: Net, busy_timeout: float | None = 300.0) -> tuple[HeartbeatMonitor, zmq.Socket, object]:
    """A monitor watching worker 0, a raw socket with its identity, and that worker's heartbeat send key."""
    monitor = net.monitor(busy_timeout)
    learner, worker = session_pair(SECRET.encode(), os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES), b"w")
    assert learner.heartbeat is not None and worker.heartbeat is not None
    monitor.watch(0, b"w", learner.heartbeat)
    beat = net.raw(zmq.DEALER, b"w")
    beat.connect(monitor.endpoint)
    return monitor, beat, worker.heartbeat.send_key


def test_replayed_heartbeats_do_not_keep_a_worker_alive(net):
    # A live connection keeps a busy worker; past busy_timeout only fresh heartbeats of its own count.
    monitor, beat, key = watched_beat(net, busy_timeout=1.0)
    captured = encode(Kind.HEARTBEAT, key=key, counter=1, cover_arrays=False)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # one real beat, then the same beat over and over
        beat.send_multipart(captured)
        time.sleep(0.02)
    assert 0 in monitor.expired(), "a replayed heartbeat counted"
    beat.send_multipart(encode(Kind.HEARTBEAT, key=key, counter=2, cover_arrays=False))
    assert wait_for(lambda: 0 not in monitor.expired(), 10), "a fresh heartbeat did not count"


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# -- bounds before joining -------------------------------------------------------------------
def test_peers_that_have_not_joined_may_send_only_small_messages(net, monkeypatch, caplog):
    learner = net.learner()
    rogue = net.raw(zmq.DEALER)
    rogue.connect(learner.endpoint)
    key = hello_session(SECRET.encode()).send_key
    padded = encode(
        Kind.HELLO, {"nonce": b"n" * NONCE_BYTES, "pad": "x" * PRE_JOIN_BYTES}, key=key, counter=1, cover_arrays=True
    )
    rogue.send_multipart(padded)

    def verify(*args, **kwargs):
        raise AssertionError("an oversized message from a peer that has not joined was authenticated")

    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
        patch.setattr(transport, "verify", verify)
        assert learner.recv(2, routed=True) is None
    assert f"exceeds the {PRE_JOIN_BYTES}-byte limit for a peer that has not joined" in caplog.text
    # A HELLO of the usual size from the same peer is answered.
    hello = {"worker_id": None, "pid": 1, "host": "h", "nonce": b"n" * NONCE_BYTES}
    rogue.send_multipart(encode(Kind.HELLO, hello, key=key, counter=1, cover_arrays=True))
    assert learner.recv(1, routed=True) is None
    assert wire_kinds(rogue, 5) == [Kind.WELCOME]


def test_dropped_message_warnings_are_rate_limited(net, caplog, monkeypatch):
    monkeypatch.setattr(transport, "DROP_LOG_WINDOW_S", 1.0)
    learner = net.learner()
    rogue = net.raw(zmq.DEALER)
    rogue.connect(learner.endpoint)
    with caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
        for _ in range(3 * DROP_LOG_BURST):
            rogue.send(b"garbage")
        while learner.recv(1, routed=True) is not None:
            pass
        assert len(caplog.records) == DROP_LOG_BURST
        time.sleep(1.0)  # the window is over
        rogue.send(b"garbage")
        assert learner.recv(1, routed=True) is None
    summary = f"Dropped {2 * DROP_LOG_BURST} more messages in the last"
    assert caplog.records[-2].getMessage().startswith(summary)
    assert caplog.records[-1].getMessage().startswith("Dropped a message from ")


def test_the_heartbeat_socket_refuses_large_messages_before_reading_them(net, caplog):
    monitor, beat, key = watched_beat(net)
    with caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
        beat.send(b"\0" * (HEARTBEAT_MAX_BYTES + 1))  # ZeroMQ closes the connection; the socket reconnects
        time.sleep(0.5)
        beat.send_multipart(encode(Kind.HEARTBEAT, key=key, counter=1, cover_arrays=False))
        assert wait_for(lambda: (monitor.silence(0) or 1.0) < 0.1, 10)
    assert "Dropped" not in caplog.text  # never delivered to the monitor: ZeroMQ refused it


# -- the secret stays out of env code --------------------------------------------------------
class SecretProbe(gym.Wrapper):
    """CartPole that remembers what its process's environment says about the secret."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.seen = os.environ.get(SECRET_ENV_VAR)


def test_env_code_cannot_read_the_secret_from_its_environment(spawn):  # noqa: F811
    with ClusterEnv([SecretProbe] * 2, num_workers=1) as envs:
        assert envs.get_attr("seen") == (None, None)
    address = free_address()
    spawn(worker_command(address))
    with ClusterEnv([SecretProbe] * 2, num_workers=1, bind=address, secret=WORKER_SECRET, launcher="external") as envs:
        assert envs.get_attr("seen") == (None, None)


# -- encryption (CurveZMQ) -------------------------------------------------------------------
FAST = Heartbeat(interval=0.1, liveness=5)  # a silent worker is lost after 0.5 s


def test_encrypted_runs_are_exact_and_keep_beating():
    reference = gym.vector.SyncVectorEnv(ENV_FNS)
    with ClusterEnv(
        ENV_FNS, num_workers=2, bind="tcp://127.0.0.1:*", secret=SECRET, encrypt=True, heartbeat=FAST
    ) as envs:
        assert_same(envs.reset(seed=3), reference.reset(seed=3))
        deadline = time.monotonic() + 1.5  # three heartbeat expiries: heartbeats work encrypted too
        while time.monotonic() < deadline:
            actions = reference.action_space.sample()
            assert_same(envs.step(actions), reference.step(actions))
            time.sleep(0.01)
    reference.close()


def test_external_workers_must_encrypt_when_the_learner_does(spawn):  # noqa: F811
    address = free_address()
    spawn(worker_command(address))  # without --encrypt: its handshake fails, it never joins
    with pytest.raises(WorkerStartError, match=re.escape("clusterenv-worker --connect") + ".* --encrypt"):
        ClusterEnv(
            ENV_FNS,
            num_workers=1,
            bind=address,
            secret=WORKER_SECRET,
            launcher="external",
            encrypt=True,
            start_timeout=2,
        )
    address = free_address()
    spawn(worker_command(address, "--encrypt"))
    with ClusterEnv(
        ENV_FNS, num_workers=1, bind=address, secret=WORKER_SECRET, launcher="external", encrypt=True
    ) as envs:
        envs.reset(seed=0)


FLOOD = """
import os, sys, time, zmq
from clusterenv.wire.transport import Curve
context = zmq.Context()
payload = bytes(int(sys.argv[2]) << 20)
for curve in [None, Curve.from_secret(b"incorrect horse battery staple")]:
    socket = context.socket(zmq.DEALER)
    # A failed handshake can end the socket's only connection; a send would then wait for a peer forever.
    socket.setsockopt(zmq.SNDTIMEO, 2000)
    if curve is not None:
        curve.connect(socket)
    socket.connect(sys.argv[1])
    for _ in range(2):
        try:
            socket.send(payload)
        except zmq.Again:
            pass
time.sleep(3)  # the IO threads deliver what the learner accepts
os._exit(0)  # not context.term(), which would wait for messages that nobody accepts
"""


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_with_encryption_peers_without_the_secret_cannot_make_the_learner_hold_memory(encrypt):
    """Four 32 MiB messages, sent while the learner does not read: ZeroMQ holds them, unless encrypted."""
    with ClusterEnv(ENV_FNS, num_workers=1, bind="tcp://127.0.0.1:*", secret=SECRET, encrypt=encrypt) as envs:
        envs.reset(seed=0)
        before = resident_mib()
        flood = subprocess.run([sys.executable, "-c", FLOOD, envs.address, "32"], timeout=60, check=True)
        grew = resident_mib() - before
        envs.step(np.array([0, 1]))  # reads and drops what was held
    assert flood.returncode == 0
    if encrypt:
        assert grew < 16, f"the learner holds {grew:.0f} MiB sent by peers without the secret"
    else:  # the control: what the test measures does happen without encryption
        assert grew > 48, grew


def test_a_forged_frame_table_is_rejected_before_it_is_read():
    huge = struct.pack("<I", 1 << 20) + bytes(4 << 20)  # a million frames announced: the table fits
    with pytest.raises(ProtocolError, match="announces 1048576 frames"):
        split([huge])
    padded = struct.pack("<3I", 2, 0, 0) + bytes(COALESCE_BYTES + 1)
    with pytest.raises(ProtocolError, match="larger than any coalesced message"):
        split([padded])
