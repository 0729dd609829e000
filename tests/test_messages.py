"""Each message kind declares its meta once; a message whose header does not match is refused before any handler."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from clusterenv import ProtocolError
from clusterenv.wire.messages import CallMeta, ErrorMeta, ResetMeta, ValueMeta, check_meta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.transport import Channel

SECRET = b"a secret for the message tests"


def test_a_meta_with_every_declared_key_passes():
    check_meta(Kind.RESET, ResetMeta(seeds=[1, 2], mask=None, seq=3))
    check_meta(Kind.STEP, {"seq": 4})
    check_meta(Kind.CLOSE, {})


@pytest.mark.parametrize(
    ("kind", "meta", "missing", "unknown"),
    [
        (Kind.RESET, {"seeds": [1]}, "['mask']", "[]"),
        (Kind.CALL, {"name": "spec", "indices": None, "attr": 1}, "[]", "['attr']"),
        (Kind.STEP, {"prefetch": True}, "[]", "['prefetch']"),
        (Kind.ERROR, {"message": "boom"}, "['env_index', 'exc_type', 'traceback']", "[]"),
    ],
    ids=["missing key", "unknown key", "a flag a kind does not declare", "several missing"],
)
def test_missing_or_unknown_keys_are_a_protocol_error_naming_them(kind, meta, missing, unknown):
    with pytest.raises(ProtocolError, match=f"A {kind.name} message must have meta keys") as error:
        check_meta(kind, meta)
    assert str(error.value).endswith(f"missing {missing}, unknown {unknown}.")


def test_meta_of_reads_a_message_through_its_kinds_declaration():
    msg = Message(Kind.SET_ATTR, CallMeta(name="x", indices=[0]))
    assert meta_of(msg, CallMeta)["indices"] == [0]
    with pytest.raises(ProtocolError, match="A SET_ATTR message does not carry ErrorMeta"):
        meta_of(msg, ErrorMeta)


@pytest.fixture
def joined():
    """A learner channel and a worker channel that completed the join, closed afterwards."""
    context = zmq.Context()
    learner = Channel.bind_router(context, "tcp://127.0.0.1:*", SECRET)
    worker = Channel.connect_dealer(context, learner.endpoint, SECRET, b"worker-0-1")
    try:
        worker.send(Kind.HELLO, {"worker_id": 0, "pid": 1, "host": "h"})
        deadline, hello = time.monotonic() + 30, None
        while hello is None and time.monotonic() < deadline:
            assert worker.recv(0.01, routed=False) is None  # WELCOME is answered inside the channel
            hello = learner.recv(0.01, routed=True)
        assert hello is not None and hello[1].meta == {"worker_id": 0, "pid": 1, "host": "h"}
        yield learner, worker, hello[0]
    finally:
        learner.close(linger=0)
        worker.close(linger=0)
        context.term()


def test_the_channel_drops_a_reply_whose_meta_its_kind_does_not_declare(joined, caplog):
    learner, worker, _ = joined
    with caplog.at_level(logging.WARNING, logger="clusterenv.wire.transport"):
        worker.send(Kind.VALUE, {"seq": 1, "surprise": True})
        assert learner.recv(2, routed=True) is None
    assert (
        "A VALUE message must have meta keys [] (and may have ['attached', 'seq', 'slot']); "
        "missing [], unknown ['surprise']" in caplog.text
    )
    worker.send(Kind.VALUE, {"seq": 2, "attached": False})
    received = learner.recv(10, routed=True)
    assert received is not None and meta_of(received[1], ValueMeta) == {"seq": 2, "attached": False}
