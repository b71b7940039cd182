"""Fuzz the sidecar's gRPC surface: `python -m promptcache_devtools.fuzz --requests 100000`.

Starts a real sidecar subprocess on loopback (or fuzzes --target) and sends it generated and mutated requests
through generic channel calls, so that any bytes at all reach the server:

* structured: valid Lookup/Get/Put/Delete/Purge/Stats/Resize requests with fields mutated towards their edges
  (empty and oversized strings, unknown enum values, zero and huge dimensions, token lists of every length,
  Put streams with frames missing, repeated, reordered, cut short or oversized, shared-memory buffer names with
  path traversal, huge offsets);
* raw: serialized valid requests with their bytes flipped, inserted, deleted, truncated or spliced, and random
  bytes, sent to every method, including unknown ones;
* credentials: with auth on (the default), valid tokens of two tenants, wrong, empty and malformed ones;
* the bulk channel (docs/bulk-channel.md, on a unix socket): byte streams of hello (half of them asking for lent
  chunks), get, put (with the Put streams above as chunk frames and raw bytes, chunk counts that lie, shared
  buffers that are not attached) and buffer frames, valid and mutated, with wrong lengths, versions, tokens and
  attached descriptors, on fresh connections.

Every answer is classified by status code (on the bulk channel, its status frames'). A crash is the sidecar process dying (it is restarted and the run
goes on); a hang is a call that reaches its deadline; a bad status is UNKNOWN or INTERNAL (an unhandled error
or a request the server could not even parse answered without a proper status). Every 500 requests a valid
Put/Get round trip checks that the sidecar still serves correct bytes. Exit status 0 only when crashes, hangs
and bad statuses are all 0.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from promptcache_devtools.procs import free_port

BAD_CODES = ("UNKNOWN", "INTERNAL")
CHUNK = 16
SERVICE = "/promptcache.v1.KVCache/"
METHODS = {  # name -> (arity, request message name)
    "Lookup": ("uu", "LookupRequest"), "Put": ("su", "PutRequest"), "Get": ("us", "GetRequest"),
    "Delete": ("uu", "DeleteRequest"), "Purge": ("uu", "PurgeRequest"), "Stats": ("uu", "StatsRequest"),
    "Resize": ("uu", "ResizeRequest"), "GetShared": ("uu", "GetRequest"),
    "OpenSharedBuffer": ("uu", "OpenSharedBufferRequest"), "CloseSharedBuffer": ("uu", "CloseSharedBufferRequest"),
}
TOKENS = {"fuzz-a": "token-a-0123456789", "fuzz-b": "token-b-0123456789"}


class SidecarUnderTest:
    """`promptcache serve` as a subprocess, restartable."""

    def __init__(self, auth: bool, memory: str = "32Mi", extra: list[str] | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="promptcache-fuzz-"))
        self.shm = self.dir / "shm"
        self.shm.mkdir()
        os.mkfifo(self.shm / "fifo")  # named as a shared buffer now and then: it must never block a worker
        self.auth = auth
        self.memory = memory
        self.extra = extra or []
        if auth:
            tokens = self.dir / "tokens"
            tokens.mkdir()
            for tenant, token in TOKENS.items():
                (tokens / tenant).write_text(token + "\n")
            self.extra += ["--token-file", str(tokens), "--sharing-groups", "public=*;pair=fuzz-a",
                           "--tenant-quota-bytes", "8Mi", "--admin-tenants", "fuzz-a"]
        self.proc = None
        self.log = open(self.dir / "sidecar.log", "ab")
        self.start()

    def start(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.bulk = str(self.dir / "bulk.sock")
        cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--grpc-address", self.address,
               "--bulk-address", f"unix:{self.bulk}",
               "--metrics-port", "0", "--chunk-tokens", str(CHUNK), "--memory-bytes", self.memory,
               "--shm-dir", str(self.shm), "--stream-idle-seconds", "5", "--max-call-seconds", "30",
               "--log-level", "error", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited {self.proc.returncode}; log: {self.dir / 'sidecar.log'}")
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise TimeoutError("sidecar did not become healthy")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        from promptcache_devtools.procs import stop_process

        stop_process(self.proc)
        self.log.close()


class Generator:
    """Seeded request generator: structured mutations of valid requests, and raw byte mutations."""

    def __init__(self, rng: random.Random, shm_dir: str | None):
        from promptcache.contract.keys import ModelSpec
        from promptcache.contract.layout import chunk_nbytes, chunk_shape
        from promptcache.v1 import kvcache_pb2 as pb
        from promptcache.contract.wire import model_to_proto

        self.pb = pb
        self.rng = rng
        self.shm_dir = shm_dir
        self.spec = ModelSpec("fuzz/model", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
        self.model = model_to_proto(self.spec)
        self.nbytes = chunk_nbytes(self.spec, CHUNK)
        self.shape = list(chunk_shape(self.spec, CHUNK))
        self.prefixes = [[p * 1000 + i for i in range(4 * CHUNK)] for p in range(8)]  # a small hot set
        self.bulk_puts = 0  # puts sent on the bulk channel

    # --- field mutators ---------------------------------------------------------------------------------
    def _string(self, valid: str) -> str:
        r = self.rng.random()
        if r < 0.6:
            return valid
        return self.rng.choice(["", "x" * self.rng.choice([511, 512, 513, 5000]), "é\u0000\U0001F600",
                                valid + "\n", "../../etc/passwd", "none", "k8v8", "k8v4", "bogus"])

    def _uint(self, valid: int, bits: int = 32) -> int:
        if self.rng.random() < 0.7:
            return valid
        return self.rng.choice([0, 1, 2, 3, 7, 16, 65535, 65536, 65537, 2**31 - 1, 2**bits - 1,
                                self.rng.randrange(2**bits)])

    def model_msg(self):
        pb, m = self.pb, self.pb.Model()
        m.CopyFrom(self.model)
        if self.rng.random() < 0.5:
            return m
        m.model_id = self._string(m.model_id)
        m.revision = self._string(m.revision)
        m.quantization = self._string(m.quantization)
        if self.rng.random() < 0.2:
            m.kv_dtype = self.rng.choice([0, 1, 2, 3, 4, 99, 2**31 - 1, -1])
        m.num_layers = self._uint(m.num_layers)
        m.num_kv_heads = self._uint(m.num_kv_heads)
        m.head_dim = self._uint(m.head_dim)
        r = self.rng.random()
        if r < 0.15:
            m.tenant_salt = self.rng.choice([b"share:public", b"share:pair", b"share:", b"share:nope"])
        elif r < 0.3:
            m.tenant_salt = self.rng.randbytes(self.rng.choice([0, 1, 32, 64, 65, 200]))
        return m

    def tokens(self) -> list[int]:
        r = self.rng.random()
        if r < 0.5:
            return list(self.rng.choice(self.prefixes))[: CHUNK * self.rng.randint(1, 4)]
        if r < 0.6:
            return []
        if r < 0.65:
            return [self.rng.randrange(2**32) for _ in range(self.rng.randint(1, 64))]
        if r < 0.652:
            return [1] * self.rng.choice([CHUNK * 4096, (1 << 22) + 1])  # far past limits (message size)
        return [self.rng.randrange(50_000) for _ in range(self.rng.randint(1, 8 * CHUNK))]

    def _shared_name(self) -> str:
        return self.rng.choice(["", "", "", "missing.buf", "../escape", "a/b", ".", "..", "x" * 300,
                                "ok-name_1.buf", "\u00e9", "/abs", "fifo", "pc-0123456789abcdef"])

    # --- structured requests ----------------------------------------------------------------------------
    def structured(self):
        pb = self.pb
        method = self.rng.choices(list(METHODS), weights=[3, 4, 3, 1, 1, 1, 1, 1, 1, 1])[0]
        if method == "Lookup":
            req = pb.LookupRequest(model=self.model_msg(), tokens=self.tokens())
            if self.rng.random() < 0.05:
                req.ClearField("model")
            return method, req.SerializeToString()
        if method in ("Get", "GetShared"):
            req = pb.GetRequest(model=self.model_msg(), tokens=self.tokens(),
                                start_chunk=self._uint(0), max_chunks=self._uint(0))
            if self.rng.random() < (0.15 if method == "Get" else 0.9):
                req.shared_buffer.name = self._shared_name()
                req.shared_buffer.length = self.rng.choice([0, 1, self.nbytes, 2**40, 2**64 - 1])
            return method, req.SerializeToString()
        if method == "OpenSharedBuffer":
            length = self.rng.choice([0, 1, self.nbytes, 4 * self.nbytes, 2**40, 2**64 - 1])
            return method, pb.OpenSharedBufferRequest(length=length).SerializeToString()
        if method == "CloseSharedBuffer":
            return method, pb.CloseSharedBufferRequest(handle=self._shared_name()).SerializeToString()
        if method == "Delete":
            return method, pb.DeleteRequest(model=self.model_msg(), tokens=self.tokens(),
                                            start_chunk=self._uint(0)).SerializeToString()
        if method == "Purge":
            return method, pb.PurgeRequest(model=self.model_msg()).SerializeToString()
        if method == "Stats":
            return method, pb.StatsRequest().SerializeToString()
        if method == "Resize":
            # Mostly refused values; valid ones stay near the configured budget so the run keeps its cache.
            value = self.rng.choice([0, -1, -(2**63), 1, 2**63 - 1, 32 << 20, 24 << 20, 40 << 20])
            return method, pb.ResizeRequest(memory_bytes=value).SerializeToString()
        return method, [f.SerializeToString() for f in self.put_frames()]

    def put_frames(self):
        pb, rng = self.pb, self.rng
        tokens = self.tokens()
        header = pb.PutHeader(model=self.model_msg(), tokens=tokens)
        if rng.random() < 0.1:
            header.shared_buffer = self._shared_name()
        frames = [] if rng.random() < 0.03 else [pb.PutRequest(header=header)]
        n = max(1, len(tokens) // CHUNK)
        for i in range(rng.randint(0, min(n, 4))):
            begin = pb.ChunkBegin(index=i, nbytes=self.nbytes, shape=self.shape, dtype=pb.DTYPE_FLOAT32)
            r = rng.random()
            if r < 0.05:
                begin.index = rng.choice([i + 1, n, 2**32 - 1, 0])
            elif r < 0.1:
                begin.nbytes = rng.choice([0, 1, self.nbytes - 1, self.nbytes + 1, 2**40, 2**64 - 1])
            elif r < 0.15:
                begin.shape[rng.randrange(len(self.shape))] = rng.choice([0, 1, 17, 2**32 - 1])
            elif r < 0.18:
                del begin.shape[:]
            elif r < 0.22:
                begin.dtype = rng.choice([0, 2, 3, 77])
            elif r < 0.26:
                begin.xxh3_64 = rng.randrange(2**64)
            elif r < 0.3:
                begin.buffer_offset = rng.choice([1, 2**63, 2**64 - 1])
            frames.append(pb.PutRequest(chunk=begin))
            data = rng.randbytes(self.nbytes) if rng.random() < 0.5 else bytes(self.nbytes)
            r = rng.random()
            if r < 0.05:
                data = data[: rng.randrange(self.nbytes)]
            elif r < 0.1:
                data += b"\x00" * rng.randint(1, 100)
            cut = sorted(rng.sample(range(1, max(2, len(data))), k=min(rng.randint(0, 3), max(0, len(data) - 1))))
            pieces = [data[a:b] for a, b in zip([0] + cut, cut + [len(data)])]
            frames.extend(pb.PutRequest(data=p) for p in pieces)
        r = rng.random()
        if r < 0.05 and frames:
            frames.insert(rng.randrange(len(frames) + 1), pb.PutRequest(header=header))
        elif r < 0.1:
            frames.insert(rng.randrange(len(frames) + 1), pb.PutRequest())
        elif r < 0.15 and len(frames) > 1:
            rng.shuffle(frames)
        elif r < 0.2 and len(frames) > 1:
            del frames[rng.randrange(len(frames))]
        return frames

    # --- raw bytes --------------------------------------------------------------------------------------
    def mutate(self, data: bytes) -> bytes:
        b = bytearray(data)
        for _ in range(self.rng.randint(1, 8)):
            op = self.rng.randrange(6)
            if op == 0 and b:
                i = self.rng.randrange(len(b))
                b[i] ^= 1 << self.rng.randrange(8)
            elif op == 1:
                i = self.rng.randrange(len(b) + 1)
                b[i:i] = self.rng.randbytes(self.rng.randint(1, 16))
            elif op == 2 and b:
                i = self.rng.randrange(len(b))
                del b[i:i + self.rng.randint(1, 16)]
            elif op == 3 and b:
                del b[self.rng.randrange(len(b)):]
            elif op == 4 and b:
                i = self.rng.randrange(len(b))
                b[i] = self.rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x0A, 0x12, 0x1A, 0x22])
            elif op == 5 and b:
                i, j = sorted(self.rng.randrange(len(b) + 1) for _ in range(2))
                b[i:i] = b[i:j]  # splice a copy of a piece of itself
        return bytes(b)

    def bulk(self, authorization: str) -> tuple[bytes, int | None]:
        """(bytes for one bulk connection, a descriptor to attach to them or None)."""
        from promptcache.contract import bulkwire

        pb, rng = self.pb, self.rng
        version = rng.choice([1] * 8 + [0, 2, 2**32 - 1])
        frames = [pb.BulkFrame(hello=pb.BulkHello(version=version, authorization=authorization,
                                                  sealed_memfds=rng.random() < 0.5))]
        if rng.random() < 0.05:
            frames.pop()
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.3:
                frames.append(self.bulk_put())
                continue
            method, payload = "Lookup", b""
            while method != "Get":
                method, payload = self.structured()
            get = pb.GetRequest.FromString(payload)
            if rng.random() < 0.2:
                get.shared_buffer.name = ""
            frames.append(pb.BulkFrame(get=get))
        if rng.random() < 0.05:
            frames.insert(rng.randrange(len(frames) + 1), pb.BulkFrame(status=pb.BulkStatus(code=0)))
        data = b"".join(f if isinstance(f, bytes) else bulkwire.encode(f) for f in frames)
        if rng.random() < 0.4:
            data = self.mutate(data)
        fd = None
        if rng.random() < 0.1:  # a descriptor on whatever frame comes first: a memfd, sealed or not, or /dev/null
            kind = rng.randrange(3)
            if kind == 2:
                fd = os.open(os.devnull, os.O_RDWR)
            else:
                fd = os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, rng.choice([0, 4096, self.nbytes * 4]))
                if kind == 1:
                    import fcntl

                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            buffer_frame = bulkwire.encode(pb.BulkFrame(buffer=pb.BulkBuffer(
                length=rng.choice([0, 4096, self.nbytes, self.nbytes * 4, 2**63]))))
            first = frames[0] if frames else b""
            cut = len(first if isinstance(first, bytes) else bulkwire.encode(first)) if rng.random() < 0.8 else 0
            data = data[:cut] + buffer_frame + data[cut:]
        return data, fd

    def bulk_put(self) -> bytes:
        """One put on the bulk channel: the frames of a generated Put stream as a put frame, chunk frames and
        the raw bytes of their data frames."""
        from promptcache.contract import bulkwire

        pb, rng = self.pb, self.rng
        self.bulk_puts += 1
        stream = self.put_frames()
        header = next((f.header for f in stream if f.WhichOneof("frame") == "header"), pb.PutHeader())
        if rng.random() < 0.9:
            header.shared_buffer = ""
        chunks = sum(f.WhichOneof("frame") == "chunk" for f in stream)
        if rng.random() < 0.1:
            chunks = rng.choice([0, chunks + 1, 2**32 - 1])
        out = [bulkwire.encode(pb.BulkFrame(put=pb.BulkPut(header=header, chunks=chunks,
                                                             shared_buffer=rng.random() < 0.1)))]
        for f in stream:
            kind = f.WhichOneof("frame")
            if kind == "chunk":
                out.append(bulkwire.encode(pb.BulkFrame(chunk=f.chunk)))
            elif kind == "data":
                out.append(f.data)
        return b"".join(out)

    def raw(self):
        method, payload = self.structured()
        if self.rng.random() < 0.1:
            method = self.rng.choice(list(METHODS) + ["NoSuchMethod"])
        if isinstance(payload, list):
            frames = [self.mutate(p) if self.rng.random() < 0.3 else p for p in payload]
            if self.rng.random() < 0.2:
                frames.append(self.rng.randbytes(self.rng.randint(0, 64)))
            payload = frames
        else:
            payload = self.mutate(payload) if self.rng.random() < 0.9 else self.rng.randbytes(
                self.rng.randint(0, 256))
        return method, payload


def _metadata(rng: random.Random, auth: bool):
    if not auth:
        return None if rng.random() < 0.95 else [("authorization", "Bearer whatever")]
    r = rng.random()
    if r < 0.45:
        return [("authorization", f"Bearer {TOKENS['fuzz-a']}")]
    if r < 0.85:
        return [("authorization", f"Bearer {TOKENS['fuzz-b']}")]
    return rng.choice([None, [("authorization", "Bearer nope")], [("authorization", "Bearer ")],
                       [("authorization", "Basic Zm9v")], [("authorization", TOKENS["fuzz-a"])]])


def _call(channel, method: str, payload, metadata, timeout: float):
    """Send raw bytes through a generic call; return the status code name."""
    import grpc

    path = SERVICE + method
    arity = METHODS.get(method, ("uu", None))[0]
    try:
        if arity == "uu":
            channel.unary_unary(path)(payload if isinstance(payload, bytes) else b"".join(payload),
                                      timeout=timeout, metadata=metadata)
        elif arity == "us":
            for _ in channel.unary_stream(path)(payload if isinstance(payload, bytes) else b"".join(payload),
                                                timeout=timeout, metadata=metadata):
                pass
        else:
            frames = payload if isinstance(payload, list) else [payload]
            channel.stream_unary(path)(iter(frames), timeout=timeout, metadata=metadata)
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""


def _bulk_call(path: str, data: bytes, fd: int | None, timeout: float) -> tuple[str, str]:
    """Send one connection's bytes (the descriptor with the first of them), half-close, read every answer
    until the sidecar closes. Returns the worst status code name seen (OK, or CLOSED when it closed without
    any status frame, e.g. after a clean end of the stream), and its message."""
    from promptcache.contract import bulkwire
    from promptcache.client.errors import STATUS_BY_VALUE

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    worst, message, reader = "CLOSED", "", None
    try:
        s.connect(path)
        if fd is not None and data:
            sent = socket.send_fds(s, [data], [fd])
            s.sendall(data[sent:])
        else:
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reader = bulkwire.FrameReader(s, descriptors=True)
        while True:
            try:
                frame = reader.frame()
            except bulkwire.FramingError:
                break  # closed by the sidecar
            if frame.WhichOneof("frame") == "chunk" and frame.chunk.sealed_memfd:
                try:
                    os.close(reader.take_fd())  # a lent chunk: its memfd came with the frame, no bytes follow
                except bulkwire.FramingError:
                    worst, message = "INTERNAL", "a lent chunk frame came without its memfd"
                    break
                continue
            if frame.WhichOneof("frame") == "chunk":
                if not frame.chunk.buffer_offset and frame.chunk.nbytes <= (64 << 20):
                    try:
                        reader.read_into(bytearray(frame.chunk.nbytes))
                    except bulkwire.FramingError:
                        break
                continue
            if frame.WhichOneof("frame") == "status":
                code = STATUS_BY_VALUE.get(frame.status.code)
                name = code.name if code is not None else f"CODE_{frame.status.code}"
                if worst in ("CLOSED", "OK") or name in BAD_CODES:
                    worst, message = name, frame.status.message
    except socket.timeout:
        return "DEADLINE_EXCEEDED", "no answer from the bulk channel"
    except (ConnectionResetError, BrokenPipeError):
        pass  # closed by the sidecar with our bytes unread: a framing error
    finally:
        s.close()
        if reader is not None:
            reader.close()  # descriptors that came and were not taken
        if fd is not None:
            os.close(fd)
    return worst, message


def _round_trip(address: str, auth: bool, rng: random.Random, bulk: str | None = None) -> str | None:
    """A valid Put then Get through the real client (the Get over the bulk channel when given); None if the
    bytes came back identical."""
    import torch

    from promptcache.client import PromptCacheClient, errors
    from promptcache.contract.keys import ModelSpec

    spec = ModelSpec("fuzz/check", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8)
    tokens = [rng.randrange(50_000) for _ in range(2 * CHUNK)]
    kv = [(torch.randn(1, 2, 2 * CHUNK, 8), torch.randn(1, 2, 2 * CHUNK, 8)) for _ in range(2)]
    kwargs = {"token": TOKENS["fuzz-a"]} if auth else {}
    if bulk:
        kwargs["bulk_address"] = f"unix:{bulk}"
    problem = None
    with PromptCacheClient(address, timeout=10, chunk_tokens=CHUNK, **kwargs) as c:
        # Other fuzzing threads may Resize the budget down or evict in between: retry a few times; bytes
        # that come back different are a failure at once.
        for _ in range(10):
            try:
                c.resize(32 << 20)
                c.put(spec, tokens, kv)
                cached, got = c.get(spec, tokens)
            except errors.ResourceExhausted as exc:
                problem = f"round trip: {exc}"
                continue
            for (k, v), (gk, gv) in zip(kv, got):
                if not (torch.equal(k[:, :, :cached], gk) and torch.equal(v[:, :, :cached], gv)):
                    return "round trip: bytes differ"
            if cached == 2 * CHUNK:
                return None
            problem = f"round trip: {cached} of {2 * CHUNK} tokens came back"
    return problem


def fuzz(requests: int, seed: int = 0, workers: int = 4, auth: bool = True, timeout: float = 10.0,
         target: str | None = None, token: str | None = None, max_seconds: float = 0,
         progress: bool = True) -> dict:
    import grpc

    sidecar = None if target else SidecarUnderTest(auth)
    address = target or sidecar.address
    lock = threading.Lock()
    stats = {"requests": 0, "crashes": 0, "hangs": 0, "bad_statuses": 0, "round_trip_failures": 0,
             "bulk_puts": 0, "codes": collections.Counter(), "examples": []}
    counter = iter(range(requests))
    stop = threading.Event()
    started = time.monotonic()

    def record(code: str, details: str, method: str, payload) -> None:
        with lock:
            stats["requests"] += 1
            stats["codes"][code] += 1
            if code in BAD_CODES or code == "DEADLINE_EXCEEDED":
                stats["hangs" if code == "DEADLINE_EXCEEDED" else "bad_statuses"] += 1
                if len(stats["examples"]) < 20:
                    raw = payload if isinstance(payload, bytes) else b"|".join(payload)
                    stats["examples"].append({"method": method, "code": code, "details": details[:300],
                                              "payload_hex": raw[:512].hex()})

    def check_alive(rng) -> None:
        if sidecar is None:
            return
        with lock:
            if not sidecar.alive():
                stats["crashes"] += 1
                stats["examples"].append({"crash": f"exit {sidecar.proc.returncode}",
                                          "log": str(sidecar.dir / "sidecar.log")})
                sidecar.start()

    def worker(wid: int) -> None:
        rng = random.Random(seed * 1000 + wid)
        gen = Generator(rng, str(sidecar.shm) if sidecar else None)
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        current = address
        try:
            for i in counter:
                if stop.is_set():
                    break
                if max_seconds and time.monotonic() - started > max_seconds:
                    stop.set()
                    break
                if sidecar is not None and sidecar.address != current:
                    channel.close()
                    current = sidecar.address
                    channel = grpc.insecure_channel(current, options=[("grpc.use_local_subchannel_pool", 1)])
                md = ([("authorization", f"Bearer {token}")] if token else _metadata(rng, auth and target is None))
                if sidecar is not None and rng.random() < 0.2:
                    method = "bulk"
                    puts = gen.bulk_puts
                    payload, fd = gen.bulk(dict(md or []).get("authorization", ""))
                    code, details = _bulk_call(sidecar.bulk, payload, fd, timeout)
                    with lock:
                        stats["bulk_puts"] += gen.bulk_puts - puts
                else:
                    method, payload = gen.raw() if rng.random() < 0.4 else gen.structured()
                    code, details = _call(channel, method, payload, md, timeout)
                if code == "UNAVAILABLE":
                    check_alive(rng)
                record(code, details, method, payload)
                if i % 500 == 499:
                    check_alive(rng)
                    try:
                        problem = _round_trip(sidecar.address if sidecar else address, auth and target is None,
                                              rng, sidecar.bulk if sidecar and i % 1000 == 999 else None
                                              ) if not token else None
                    except Exception as exc:  # noqa: BLE001
                        problem = f"round trip raised {type(exc).__name__}: {exc}"
                    if problem:
                        with lock:
                            stats["round_trip_failures"] += 1
                            stats["examples"].append({"round_trip": problem})
                    if progress and wid == 0:
                        print(f"  {stats['requests']} requests, {dict(stats['codes'])}", file=sys.stderr,
                              flush=True)
        finally:
            channel.close()

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_alive(random.Random(0))
    elapsed = time.monotonic() - started
    if sidecar is not None:
        alive = sidecar.alive()
        sidecar.stop()
        if not alive:
            stats["crashes"] += 1
    stats["codes"] = dict(stats["codes"].most_common())
    stats.update(seconds=round(elapsed, 1), requests_per_second=round(stats["requests"] / max(elapsed, 1e-9)),
                 seed=seed, auth=auth, workers=workers)
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m promptcache_devtools.fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000, help="requests to send (default 100000)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("PROMPTCACHE_FUZZ_SEED", "0")))
    p.add_argument("--workers", type=int, default=4, help="concurrent fuzzing threads")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of each call; reaching it is a hang")
    p.add_argument("--no-auth", action="store_true", help="fuzz a sidecar without authentication")
    p.add_argument("--target", help="fuzz this running sidecar instead of starting one")
    p.add_argument("--token", help="bearer token for --target")
    p.add_argument("--max-seconds", type=float, default=0, help="stop early after this long (0: no limit)")
    p.add_argument("--json", metavar="FILE", help="also write the report here")
    args = p.parse_args(argv)
    report = fuzz(args.requests, args.seed, args.workers, not args.no_auth, args.timeout, args.target, args.token,
                  args.max_seconds)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    ok = not (report["crashes"] or report["hangs"] or report["bad_statuses"] or report["round_trip_failures"])
    print(f"fuzz: {report['requests']} requests in {report['seconds']} s, crashes {report['crashes']}, hangs "
          f"{report['hangs']}, bad statuses {report['bad_statuses']}, round-trip failures "
          f"{report['round_trip_failures']}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
