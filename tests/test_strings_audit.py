"""Client-controlled strings reaching logs, status messages and KV event topics (an adversarial audit). Each test
failed before its fix; the repro scripts against a real `promptcache serve` are in the audit's report."""
from __future__ import annotations

import logging
import time

import grpc
import pytest

from support import SidecarProcess
from promptcache.sidecar import kvevents
from promptcache.sidecar.errors import MAX_MESSAGE_BYTES, InvalidRequest, bounded_message
from promptcache.sidecar.identity import Caller, Identity
from promptcache.sidecar.logs import TextFormatter
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as rpc

FORGED = "2026-01-01 00:00:00,000 ERROR   promptcache.sidecar: FORGED"
EVIL = "x\n" + FORGED + "\r\x1b[2J\x1b[31m\u202e chunks=999"


def _record(msg: str, args=(), **extra) -> logging.LogRecord:
    record = logging.LogRecord("promptcache.sidecar", logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_text_logs_escape_what_a_client_sent():
    """--log-format text wrote a client's model name as it came: a newline started a forged log line, ANSI escapes
    reached the on-call's terminal, and `model_id=x chunks=999` read as two fields."""
    line = TextFormatter().format(_record("purged model %s", (EVIL,), model_id=EVIL, chunks=0))
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u202e" not in line
    # the client's text is quoted as one value: its "chunks=999" is inside the quotes
    assert ' model_id="x\\n2026-01-01' in line and line.endswith(' chunks=999" chunks=0')
    # plain words stay as they were; other languages are not escaped
    assert TextFormatter().format(_record("ok", tenant="alice", rows=3, label="modèle")).endswith(
        "ok tenant=alice rows=3 label=modèle")


def test_text_log_tracebacks_cannot_start_a_line():
    try:
        raise ValueError(EVIL)
    except ValueError:
        import sys
        record = logging.LogRecord("promptcache.sidecar", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    text = TextFormatter().format(record)
    lines = text.split("\n")
    assert lines[0].endswith("boom") and all(line.startswith("  ") for line in lines[1:])
    assert "\x1b" not in text and "\r" not in text


def test_a_refusal_message_is_bounded():
    message = bounded_message("q" * 5_000_000)
    assert len(message.encode()) <= MAX_MESSAGE_BYTES and "characters cut]" in message and message.startswith("qqq")
    wide = bounded_message("é" * 5000)  # cut on a character boundary
    assert len(wide.encode()) <= MAX_MESSAGE_BYTES and wide.encode().decode() == wide
    assert InvalidRequest("x" * 10_000).message == bounded_message("x" * 10_000)
    assert bounded_message("short") == "short"


def _model(**fields) -> pb.Model:
    base = dict(model_id="m", revision="r", kv_dtype=pb.DTYPE_FLOAT16, num_layers=1, num_kv_heads=1, head_dim=8)
    return pb.Model(**{**base, **fields})


def test_a_real_sidecar_neither_echoes_megabytes_nor_lets_a_client_forge_a_log_line():
    """A 3 MB model.quantization came back whole in the status message: a client with gRPC's default metadata
    limit (16 KiB) got RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" (retryable) instead of
    INVALID_ARGUMENT; and a Purge naming a model with a newline wrote a forged line to the text log."""
    proc = SidecarProcess("--memory-bytes", "4Mi", "--chunk-tokens", "16", "--log-format", "text").wait_ready()
    try:
        with grpc.insecure_channel(proc.address) as channel:  # the default limits of a gRPC client
            stub = rpc.KVCacheStub(channel)
            for quantization in ("Q" * 3_000_000, "é" * 20_000, "\x00" * 20_000):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Lookup(pb.LookupRequest(model=_model(quantization=quantization), tokens=[1] * 16),
                                timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:200]
                assert "model.quantization" in err.value.details() and "characters cut]" in err.value.details()
                assert err.value.details().endswith("is not one of none, k8v8, k8v4, k6v4z")
            stub.Purge(pb.PurgeRequest(model=_model(model_id=EVIL)), timeout=10)
    finally:
        proc.stop()
    out = proc.proc.stdout.read()
    assert "purged model" in out
    assert not any(line.startswith(FORGED) for line in out.splitlines())
    assert "\x1b" not in out


def test_kv_event_topics_hold_no_client_separator():
    """A pod named `victim@MODEL` got topic kv@victim@MODEL@..., which a subscriber to pod victim's topic received
    too (ZMQ matches by prefix), starting with an AllBlocksCleared; a model named `llama@x` did the same to the
    node topic of model `llama`. Now such a pod name is refused and such a model is not announced."""
    import zmq

    events = kvevents.KVEvents("tcp://127.0.0.1:*", "node", 16, "CPU").start()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.connect(events.address)
        for prefix in (b"kv@victim@llama", b"kv@node@llama"):
            sub.setsockopt(zmq.SUBSCRIBE, prefix)
        time.sleep(0.3)
        victim = Caller(Identity("", "none"), "ipv4:10.0.0.1:1")
        attacker = Caller(Identity("", "none"), "ipv4:10.0.0.2:1")
        events.stored(b"v" * 32, None, "llama", range(16))
        assert events.seen("victim", "llama", victim)
        events.stored(b"a" * 32, None, "other", range(16))
        assert not events.seen("victim@llama", "other", attacker)
        assert not events.seen("victim\n", "other", attacker) and not events.seen("", "other", attacker)
        events.stored(b"b" * 32, None, "llama@x", range(16))
        assert "llama@x" not in events._models
        topics = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if sub.poll(200):
                topics.add(sub.recv_multipart()[0])
        assert topics == {b"kv@node@llama", b"kv@victim@llama"}
        assert events.seen("pod-7.a_b", "llama", attacker)  # a real pod name is still taken
    finally:
        sub.close(0)
        context.term()
        events.close()
