"""The shared-memory fast path under hostile tenants and careless operators (issue 17, items 1 and 2).

Real sidecars, real files in a real --shm-dir, real sockets; tenants are separate identities (bearer tokens,
--tenancy isolated) in the SAME process, so the same Unix user: file permissions are not what stops them."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from support import CHUNK, SMALL, make_kv
from promptcache.client import PromptCacheClient
from promptcache.contract.layout import chunk_nbytes, chunk_shape
from promptcache.client.credentials import client_channel
from promptcache.sidecar.identity import Identity
from promptcache.v1 import kvcache_pb2 as pb
from promptcache.v1 import kvcache_pb2_grpc as pb_grpc
from promptcache.contract.wire import NAME_TO_DTYPE, model_to_proto
from test_auth import write_secret_dir

NBYTES = chunk_nbytes(SMALL, CHUNK)


class _SharedNames(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor):
    """Records every shared-buffer name a client puts on the wire: the worst case of a leaked name."""

    def __init__(self, seen: set):
        self.seen = seen

    def _note(self, request):
        if isinstance(request, pb.GetRequest) and request.HasField("shared_buffer"):
            self.seen.add(request.shared_buffer.name)
        elif isinstance(request, pb.PutRequest) and request.WhichOneof("frame") == "header":
            if request.header.shared_buffer:
                self.seen.add(request.header.shared_buffer)
        return request

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(details, self._note(request))

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(details, self._note(request))

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(details, (self._note(r) for r in request_iterator))


@pytest.fixture
def isolated(sidecar_factory, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    tokens = tmp_path / "tokens"
    write_secret_dir(tokens, {"alice": "alice-token", "bob": "bob-token"})

    def start(**overrides):
        return sidecar_factory(grpc_address=f"unix:{tmp_path / 's.sock'}", shm_dir=str(shm),
                               token_file=str(tokens), tenancy="isolated", **overrides)
    return start, shm


def _put_frames(tokens, name, offsets):
    shape, dtype = chunk_shape(SMALL, CHUNK), NAME_TO_DTYPE[SMALL.kv_dtype]
    yield pb.PutRequest(header=pb.PutHeader(model=model_to_proto(SMALL), tokens=tokens, shared_buffer=name))
    for i, offset in enumerate(offsets):  # no checksum: the attacker does not know the bytes
        yield pb.PutRequest(chunk=pb.ChunkBegin(index=i, nbytes=NBYTES, shape=shape, dtype=dtype,
                                                buffer_offset=offset))


def test_a_tenant_cannot_read_or_write_another_tenants_shared_buffer(isolated):
    start, shm = isolated
    sidecar = start()
    seen: set[str] = set()
    channel = grpc.intercept_channel(client_channel(sidecar.address, token="alice-token"), _SharedNames(seen))
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=1)
    with PromptCacheClient(sidecar.address, shm_dir=str(shm), channel=channel, timeout=10) as alice, \
            PromptCacheClient(sidecar.address, token="bob-token", timeout=10) as bob, \
            client_channel(sidecar.address, token="bob-token") as bob_channel:
        assert alice.put(SMALL, tokens, kv).stored_chunks == 3
        alice_blobs = alice.get_blobs(SMALL, tokens)
        assert len(alice_blobs) == 3
        buffer = alice._shm.get(1).array  # alice's shared memory now holds her three chunks
        before = buffer.copy()
        assert np.array_equal(before[:3 * NBYTES], np.concatenate([b.numpy() for b in alice_blobs]))

        bob_tokens = list(range(10**6, 10**6 + 3 * CHUNK))
        assert bob.put(SMALL, bob_tokens, make_kv(SMALL, len(bob_tokens), seed=2)).stored_chunks == 3
        stub = pb_grpc.KVCacheStub(bob_channel)
        # Everything bob could learn: every name alice sent (as if leaked), every file in --shm-dir, and a name
        # nobody was ever given (the answer for alice's names must be the same as for that one).
        names = seen | set(os.listdir(shm)) | {"pc-never-granted"}
        assert seen, "alice's client sent no shared-buffer name"
        codes = set()
        for name in sorted(names):
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(_put_frames(tokens, name, [0, NBYTES, 2 * NBYTES]), timeout=5)
            codes.add(info.value.code())
            request = pb.GetRequest(model=model_to_proto(SMALL), tokens=bob_tokens,
                                    shared_buffer=pb.SharedBuffer(name=name, length=3 * NBYTES))
            with pytest.raises(grpc.RpcError) as info:
                stub.GetShared(request, timeout=5)
            codes.add(info.value.code())
        assert len(codes) == 1 and grpc.StatusCode.OK not in codes
        # Bob holds none of alice's bytes under his own key, and wrote nothing into her buffer.
        assert bob.lookup(SMALL, tokens).cached_tokens == 0
        assert bob.get_blobs(SMALL, tokens) == []
        assert np.array_equal(buffer, before)
        # Alice is unaffected.
        assert [b.tolist() for b in alice.get_blobs(SMALL, tokens)] == [b.tolist() for b in alice_blobs]


def test_a_fifo_named_as_shared_buffer_is_refused_quickly_and_the_sidecar_keeps_serving(isolated):
    start, shm = isolated
    fifo = shm / "pc-fifo"
    os.mkfifo(fifo)
    sidecar = start(workers=4)
    tokens = list(range(CHUNK))
    unblock = None
    try:
        with client_channel(sidecar.address, token="alice-token") as channel:
            stub = pb_grpc.KVCacheStub(channel)

            def put():
                return stub.Put(_put_frames(tokens, fifo.name, [0]), timeout=5)

            def get_shared():
                return stub.GetShared(pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens,
                                                    shared_buffer=pb.SharedBuffer(name=fifo.name, length=NBYTES)),
                                      timeout=5)

            began = time.monotonic()
            with ThreadPoolExecutor(8) as pool:  # twice the workers: a hang in each would starve the server
                calls = [pool.submit(put) for _ in range(4)] + [pool.submit(get_shared) for _ in range(4)]
                for call in calls:
                    error = call.exception()
                    assert isinstance(error, grpc.RpcError), "a FIFO was accepted as a shared buffer"
                    assert error.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
                    assert fifo.name in error.details()
            assert time.monotonic() - began < 3
            began = time.monotonic()
            assert stub.Stats(pb.StatsRequest(), timeout=3).chunk_tokens == CHUNK
            assert time.monotonic() - began < 1
        stopper = threading.Thread(target=sidecar.stop, args=(1.0,))
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive(), "stop() did not return"
    finally:
        # On code that blocked in open(), give the stuck workers a writer so the process can end.
        unblock = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        time.sleep(0.2)
        os.close(unblock)


def test_a_granted_file_name_is_not_a_handle_and_leaves_the_folder_at_first_use(isolated):
    """The window between OpenSharedBuffer and the first use, when the file is still listed: its name is no
    handle, and the handle works for its owner only."""
    start, shm = isolated
    sidecar = start()
    tokens = list(range(3 * CHUNK))
    with client_channel(sidecar.address, token="alice-token") as a, \
            client_channel(sidecar.address, token="bob-token") as b, \
            PromptCacheClient(sidecar.address, token="alice-token") as alice_client:
        alice_client.put(SMALL, tokens, make_kv(SMALL, len(tokens), seed=4))
        alice, bob = pb_grpc.KVCacheStub(a), pb_grpc.KVCacheStub(b)
        granted = alice.OpenSharedBuffer(pb.OpenSharedBufferRequest(length=3 * NBYTES), timeout=5)
        assert os.listdir(shm) == [granted.file_name] and granted.handle != granted.file_name
        assert os.stat(shm / granted.file_name).st_ino == granted.inode
        fd = os.open(shm / granted.file_name, os.O_RDWR)  # what alice's client does first

        def get_shared(stub, name):
            return stub.GetShared(pb.GetRequest(model=model_to_proto(SMALL), tokens=tokens,
                                                shared_buffer=pb.SharedBuffer(name=name, length=3 * NBYTES)),
                                  timeout=5)

        for stub, name in ((bob, granted.handle), (bob, granted.file_name), (alice, granted.file_name)):
            with pytest.raises(grpc.RpcError) as info:
                get_shared(stub, name)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(_put_frames(tokens, name, [0]), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:  # nor may bob close it
            bob.CloseSharedBuffer(pb.CloseSharedBufferRequest(handle=granted.handle), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert os.pread(fd, 3 * NBYTES, 0) == bytes(3 * NBYTES)  # nothing was written into it

        assert len(get_shared(alice, granted.handle).chunks) == 3
        assert os.listdir(shm) == []  # gone from the folder at its first use; alice's descriptor still works
        stored = b"".join(b.numpy().tobytes() for b in alice_client.get_blobs(SMALL, tokens))
        assert os.pread(fd, 3 * NBYTES, 0) == stored
        alice.CloseSharedBuffer(pb.CloseSharedBufferRequest(handle=granted.handle), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            get_shared(alice, granted.handle)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        os.close(fd)


def test_shared_buffers_are_bounded_per_tenant_and_the_client_streams_past_the_limit(isolated):
    start, shm = isolated
    sidecar = start(shm_max_buffers=2, shm_max_bytes=4 * NBYTES)
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=5)
    with client_channel(sidecar.address, token="alice-token") as a, \
            client_channel(sidecar.address, token="bob-token") as b:
        alice, bob = pb_grpc.KVCacheStub(a), pb_grpc.KVCacheStub(b)

        def open_buffer(stub, length):
            return stub.OpenSharedBuffer(pb.OpenSharedBufferRequest(length=length), timeout=5)

        first, second = open_buffer(alice, NBYTES), open_buffer(alice, NBYTES)
        for length, flag in ((NBYTES, "--shm-max-buffers"), (5 * NBYTES, "--shm-max-bytes")):
            with pytest.raises(grpc.RpcError) as info:
                open_buffer(alice, length)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and flag in info.value.details()
        assert open_buffer(bob, 4 * NBYTES).length == 4 * NBYTES  # bob's limits are his own
        with pytest.raises(grpc.RpcError) as info:
            open_buffer(alice, 0)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # At her limit, alice's client streams instead of failing.
        with PromptCacheClient(sidecar.address, token="alice-token", shm_dir=str(shm), timeout=10) as c:
            assert c.put(SMALL, tokens, kv).stored_chunks == 3
            assert len(c.get_blobs(SMALL, tokens)) == 3
            assert c._shm._all == []
        alice.CloseSharedBuffer(pb.CloseSharedBufferRequest(handle=first.handle), timeout=5)
        assert open_buffer(alice, 2 * NBYTES).length == 2 * NBYTES
        assert second.handle


def test_an_idle_buffer_is_closed_and_its_client_opens_a_new_one(isolated):
    start, shm = isolated
    sidecar = start(shm_idle_seconds=0.2)
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=6)
    with PromptCacheClient(sidecar.address, token="alice-token", shm_dir=str(shm), timeout=10) as c:
        assert c.put(SMALL, tokens, kv).stored_chunks == 3
        old = c._shm._all[0].handle
        time.sleep(0.3)
        assert sidecar.engine.buffers.reap() == 1  # what the sweeper thread does every few seconds
        cached, got = c.get(SMALL, tokens)  # NOT_FOUND for the old handle, then a new buffer
        assert cached == 3 * CHUNK and all(torch.equal(g[0], k[0]) for g, k in zip(got, kv))
        assert [b.handle for b in c._shm._all] != [old] and len(c._shm._all) == 1


def test_the_client_never_blocks_on_what_was_swapped_in_for_its_buffer_file(isolated):
    """Someone who can write --shm-dir replaces the file the sidecar created with a FIFO (or a symlink) before
    the client opens it: the client must neither hang in open() nor write its chunks there; it streams."""
    start, shm = isolated
    sidecar = start()
    tokens = list(range(3 * CHUNK))
    kv = make_kv(SMALL, len(tokens), seed=7)
    (shm.parent / "elsewhere").write_bytes(bytes(8 * NBYTES))

    for swap in ("fifo", "symlink"):
        class Swapper(grpc.UnaryUnaryClientInterceptor):
            def intercept_unary_unary(self, continuation, details, request):
                answer = continuation(details, request)
                if isinstance(request, pb.OpenSharedBufferRequest):
                    path = shm / answer.result().file_name
                    os.unlink(path)
                    os.mkfifo(path) if swap == "fifo" else os.symlink(shm.parent / "elsewhere", path)
                return answer

        channel = grpc.intercept_channel(client_channel(sidecar.address, token="alice-token"), Swapper())
        began = time.monotonic()
        with PromptCacheClient(sidecar.address, shm_dir=str(shm), channel=channel, timeout=10) as c:
            assert c.put(SMALL, tokens, kv).stored_chunks in (0, 3)
            assert len(c.get_blobs(SMALL, tokens)) == 3
            assert c._shm._all == []  # streamed: the swapped-in file was refused, never used
        assert time.monotonic() - began < 3
        assert (shm.parent / "elsewhere").read_bytes() == bytes(8 * NBYTES)
        assert sidecar.engine.buffers.held(Identity("alice", "token")) == (0, 0)  # given back at once
        for leftover in shm.iterdir():
            leftover.unlink()


def test_refusal_names_the_limit_that_stops_a_buffer():
    from promptcache.sidecar.shmbuffers import refusal

    assert refusal(0, 0, 100, max_buffers=2, max_bytes=100) is None
    assert refusal(1, 50, 50, max_buffers=2, max_bytes=100) is None
    assert "--shm-max-buffers" in refusal(2, 0, 1, max_buffers=2, max_bytes=100)
    assert "--shm-max-bytes" in refusal(1, 60, 41, max_buffers=2, max_bytes=100)
    assert "larger than" in refusal(0, 0, 101, max_buffers=2, max_bytes=100)


def test_a_buffer_closed_during_a_call_keeps_its_descriptor_until_the_call_ends(tmp_path):
    """No descriptor is closed under a call still using it (the number could be reused for another file)."""
    from promptcache.sidecar.shmbuffers import SharedBuffers, UnknownBuffer

    now = [0.0]
    buffers = SharedBuffers(str(tmp_path), max_buffers=4, max_bytes=1 << 20, idle_seconds=10, clock=lambda: now[0])
    alice, bob = Identity("alice", "token"), Identity("bob", "token")
    grant = buffers.open(alice, 4096)
    call = buffers.use(alice, grant.handle, 4096)
    assert not buffers.close(bob, grant.handle)
    assert buffers.close(alice, grant.handle)
    call.write(0, np.full(4096, 3, dtype=np.uint8))  # still its own file
    assert os.pread(grant.fd, 4, 0) == b"\x03" * 4
    call.close()
    try:  # closed now (the number may already be another file's, never this one's)
        assert os.fstat(grant.fd).st_ino != grant.inode
    except OSError:
        pass
    with pytest.raises(UnknownBuffer):
        buffers.use(alice, grant.handle, 1)
    # Idle ones go after idle_seconds, ones in use never.
    idle, busy = buffers.open(alice, 4096), buffers.open(alice, 4096)
    in_use = buffers.use(alice, busy.handle, None)
    now[0] = 11
    assert buffers.reap() == 1 and buffers.held(alice) == (1, 4096)
    in_use.close()
    assert idle.closed and not busy.closed
    assert os.listdir(tmp_path) == []
    buffers.close_all()


_FALLBACK_CLIENT = r"""
import sys, torch
from promptcache.client import PromptCacheClient
from promptcache.contract.keys import ModelSpec
spec = ModelSpec("test/shm-full", "rev-1", "float32", num_layers=4, num_kv_heads=8, head_dim=64)
address, shm, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokens = [seed * 1000 + t for t in range(8 * 16)]  # 8 chunks of 256 KiB: 2 MiB, more than the 1 MiB tmpfs
g = torch.Generator().manual_seed(seed)
kv = [(torch.randn(1, 8, len(tokens), 64, generator=g), torch.randn(1, 8, len(tokens), 64, generator=g))
      for _ in range(4)]
with PromptCacheClient(address, shm_dir=shm, timeout=30) as c:
    assert c.put(spec, tokens, kv).stored_chunks == 8
    cached, got = c.get(spec, tokens)
    assert cached == len(tokens), cached
    assert all(bool((a == x).all()) and bool((b == y).all()) for (a, b), (x, y) in zip(got, kv))
print("survived")
"""


def test_a_full_shm_dir_makes_clients_stream_instead_of_dying_of_sigbus(tmp_path):
    """Issue 27 #2: OpenSharedBuffer granted buffers it had not backed (15 GiB on a 1 MiB tmpfs); a client that
    wrote into its mapping died of SIGBUS, and GetShared answered INTERNAL: OSError. Now a buffer is allocated
    (posix_fallocate) before it is lent, a folder without room answers RESOURCE_EXHAUSTED naming --shm-dir,
    and a client in its own process on a 1 MiB tmpfs streams instead and survives, also after another client
    has filled the folder with its own buffers."""
    import subprocess
    import sys

    from support import SidecarProcess

    shm = tmp_path / "shm"
    shm.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(shm)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a 1 MiB tmpfs (the test needs root): {mounted.stderr.strip()}")
    sock = tmp_path / "s.sock"
    proc = None
    try:
        proc = SidecarProcess("--grpc-address", f"unix:{sock}", "--shm-dir", str(shm), "--chunk-tokens", "16",
                              "--memory-bytes", "64Mi", "--log-format", "text")
        proc.address = f"unix:{sock}"
        proc.wait_ready()
        with client_channel(proc.address) as ch:
            stub = pb_grpc.KVCacheStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSharedBuffer(pb.OpenSharedBufferRequest(length=15 << 30), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert "--shm-dir" in info.value.details() and "no room" in info.value.details()
            client = [sys.executable, "-c", _FALLBACK_CLIENT, proc.address, str(shm)]
            out = subprocess.run(client + ["1"], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stderr[-2000:])
            # Another client holds buffers filling the folder: the next one streams too, and survives.
            held = []
            while True:
                try:
                    held.append(stub.OpenSharedBuffer(pb.OpenSharedBufferRequest(length=128 << 10), timeout=10))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                    break
                assert len(held) < 64, "buffers beyond the 1 MiB folder were granted"
            out = subprocess.run(client + ["2"], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stderr[-2000:])
            for h in held:
                stub.CloseSharedBuffer(pb.CloseSharedBufferRequest(handle=h.handle), timeout=10)
    finally:
        if proc is not None:
            proc.stop()
            log = proc.proc.stdout.read()
        subprocess.run(["umount", "-l", str(shm)], check=False)
    assert "Traceback" not in log and "INTERNAL" not in log, log[-3000:]
