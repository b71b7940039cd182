"""The client under concurrency and process lifecycle, against real sidecars (`promptcache serve` subprocesses):
an interrupted call, a fork after the client was used, close() while a thread is in a call. What is checked is the
worst outcome there is: one request's K/V handed to another. Every prefix has K/V of its own (random, seeded), so a
mix-up shows as tensors that are not the ones asked for."""
from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time

import pytest
import torch

from promptcache.client import PromptCacheClient, errors
from promptcache.contract import bulkwire
from support import CHUNK, SMALL, SidecarProcess, free_port, make_kv

BULK_MODES = ("tcp", "unix-lent", "unix-shared")  # bulk channel: bytes on the socket, lent memfds, a shared memfd


@contextlib.contextmanager
def _serve(mode: str):
    """A sidecar subprocess and the client arguments that reach it in `mode` (BULK_MODES, or "shm": gRPC with a
    shared-memory folder)."""
    with tempfile.TemporaryDirectory(prefix="pc-audit-") as tmp:
        args, kw = ["--chunk-tokens", str(CHUNK), "--memory-bytes", str(64 << 20)], {}
        if mode == "tcp":
            kw["bulk_address"] = f"127.0.0.1:{free_port()}"
        elif mode in ("unix-lent", "unix-shared"):
            kw["bulk_address"] = f"unix:{tmp}/bulk.sock"
            args += ["--bulk-zero-copy", "on" if mode == "unix-lent" else "off"]
        if "bulk_address" in kw:
            args += ["--bulk-address", kw["bulk_address"]]
        shm = None
        if mode == "shm":
            if not os.path.isdir("/dev/shm"):
                pytest.skip("no /dev/shm")
            shm = tempfile.mkdtemp(prefix="pc-audit-", dir="/dev/shm")
            args += ["--shm-dir", shm]
            kw["shm_dir"] = shm
        sidecar = SidecarProcess(*args).wait_ready()
        try:
            yield sidecar, kw
        finally:
            os.kill(sidecar.proc.pid, signal.SIGCONT)  # (a test that stopped it: SIGTERM waits for this)
            sidecar.stop()
            if shm:
                for name in os.listdir(shm):
                    os.unlink(os.path.join(shm, name))
                os.rmdir(shm)


@contextlib.contextmanager
def _stopped(sidecar, seconds: float):
    """The sidecar stopped (SIGSTOP, as a descheduled or busy one) now, and running again `seconds` later."""
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (sidecar.proc.pid, signal.SIGCONT))
    timer.start()
    try:
        yield
    finally:
        timer.join()


def _prefix(n: int, chunks: int = 4):
    tokens = [50_000 * (n + 1) + i for i in range(chunks * CHUNK)]
    return tokens, make_kv(SMALL, len(tokens), seed=n + 1)


def _is(kv, expected) -> bool:
    return len(kv) == len(expected) and all(
        k.shape == ek.shape and torch.equal(k, ek) and torch.equal(v, ev) for (k, v), (ek, ev) in zip(kv, expected))


def _head(kv, tokens: int):
    return [(k[:, :, :tokens], v[:, :, :tokens]) for k, v in kv]


@pytest.mark.parametrize("mode", BULK_MODES)
def test_a_get_interrupted_before_its_answer_never_hands_that_answer_to_the_next_get(mode, monkeypatch):
    """KeyboardInterrupt (or a deadline raised from a signal handler) after a Get was sent, before its answer came:
    the answer arrives later, after the next Get's request. That Get must not read it as its own. Prefix B has 2
    cached chunks of its 4, A all 4: A's answer read as B's is 4 chunks of A's K/V."""
    with _serve(mode) as (sidecar, kw), PromptCacheClient(sidecar.address, timeout=10, **kw) as c:
        (ta, kva), (tb, kvb) = _prefix(0), _prefix(1)
        c.put(SMALL, ta, kva)
        c.put(SMALL, tb[:2 * CHUNK], _head(kvb, 2 * CHUNK))
        assert _is(c.get(SMALL, ta)[1], kva)  # this thread's connection is open

        real = bulkwire.FrameReader.frame
        armed = [True]

        def interrupted(self, *args, **kwargs):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt("while waiting for the answer")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(bulkwire.FrameReader, "frame", interrupted)
        with _stopped(sidecar, 0.5):  # answers come late: nothing of A's answer is there when B is sent
            with pytest.raises(KeyboardInterrupt):
                c.get(SMALL, ta)
            cached, kv = c.get(SMALL, tb)
        assert cached == 2 * CHUNK and _is(kv, _head(kvb, 2 * CHUNK))
        assert _is(c.get(SMALL, ta)[1], kva)


def test_a_put_interrupted_part_way_leaves_no_connection_out_of_step(monkeypatch):
    """A bulk Put over a socket stopped by an exception after its first chunk: the sidecar still waits for the rest
    of its bytes. The next call of the thread must not be sent on that connection (it was read as chunk bytes, and
    the Get waited for an answer until its deadline)."""
    with _serve("tcp") as (sidecar, kw), PromptCacheClient(sidecar.address, timeout=3, **kw) as c:
        (ta, kva), (tb, kvb) = _prefix(2), _prefix(3)
        c.put(SMALL, tb, kvb)
        real = bulkwire.send_buffers
        calls = [0]

        def cut(sock, buffers, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt("part way through a put")
            return real(sock, buffers, *args, **kwargs)

        monkeypatch.setattr(bulkwire, "send_buffers", cut)
        with pytest.raises(KeyboardInterrupt):
            c.put(SMALL, ta, kva)
        monkeypatch.setattr(bulkwire, "send_buffers", real)
        cached, kv = c.get(SMALL, tb)
        assert cached == len(tb) and _is(kv, kvb)


def _child(fn) -> tuple[int, int]:
    """fork(); the child runs fn() and exits 0 if it returns True (1 if it returns anything else, 2 if it
    raises). Returns (pid, read end of a pipe closed when the child is done)."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = 0 if fn() is True else 1
        except BaseException:  # noqa: BLE001 - the exit code says it
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, seconds: float) -> int | None:
    """The child's exit code, or None if it is still running after `seconds` (it is then killed)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.parametrize("mode", BULK_MODES)
def test_a_forked_child_never_shares_the_parents_bulk_connection(mode):
    """fork() after this thread used the bulk channel: the child inherits the connection (socket, memfd). Requests
    of both on it are answered in order, to whichever process reads first. Here the child's request goes out
    first and the parent's next, while the sidecar is stopped: on one connection the parent reads the child's
    answer (or the child reads both, and the parent none)."""
    with _serve(mode) as (sidecar, kw), PromptCacheClient(sidecar.address, timeout=8, **kw) as c:
        (ta, kva), (tb, kvb) = _prefix(4), _prefix(5)
        c.put(SMALL, ta, kva)
        c.put(SMALL, tb, kvb)
        assert _is(c.get(SMALL, ta)[1], kva)
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        pid = _child(lambda: _is(c.get(SMALL, tb)[1], kvb))
        try:
            time.sleep(0.5)  # the child's request is out
            threading.Timer(0.5, os.kill, (sidecar.proc.pid, signal.SIGCONT)).start()
            try:
                got = c.get(SMALL, ta)[1]
            except errors.PromptCacheError as exc:  # (the old failure: the child took this answer too)
                got = exc
        finally:
            code = _wait(pid, 15)
        assert not isinstance(got, Exception) and _is(got, kva), got
        assert code == 0


def test_a_forked_child_never_shares_the_parents_shared_memory_buffer():
    """Shared-memory transport: a child forked after this thread used it inherits the thread's buffer (MAP_SHARED,
    and the parent's handle): the sidecar writes the child's answers into the buffer of the parent's views, and
    the other way round, after the checksum was checked. Both keep asking for their own prefix."""
    with _serve("shm") as (sidecar, kw), PromptCacheClient(sidecar.address, timeout=8, **kw) as c:
        (ta, kva), (tb, kvb) = _prefix(6), _prefix(7)
        c.put(SMALL, ta, kva)
        c.put(SMALL, tb, kvb)
        assert _is(c.get(SMALL, ta)[1], kva)

        def loop(tokens, expected, seconds=1.5) -> bool:
            end, wrong, right = time.monotonic() + seconds, 0, 0
            while time.monotonic() < end:
                blobs = c.get_blobs(SMALL, tokens, copy=False)  # views of this thread's buffer
                time.sleep(0.001)  # decoded a moment later, with no call of this thread in between
                from promptcache.client.client import decode_chunks

                if _is(decode_chunks(SMALL, blobs, CHUNK), expected):
                    right += 1
                else:
                    wrong += 1
            return wrong == 0 and right > 0

        pid = _child(lambda: loop(tb, kvb))
        try:
            parent_ok = loop(ta, kva)
        finally:
            code = _wait(pid, 20)
        assert parent_ok and code == 0


def test_a_lock_held_by_another_thread_at_fork_does_not_hang_the_child():
    """A parent thread inside a call at the fork holds the client's locks (here the transport policy's), which
    nobody releases in the child: its first call there waited forever."""
    with _serve("tcp") as (sidecar, kw), PromptCacheClient(sidecar.address, timeout=5, **kw) as c:
        ta, kva = _prefix(8)
        c.put(SMALL, ta, kva)
        lock = c._transports.policy._lock
        held, release = threading.Event(), threading.Event()

        def in_a_call():
            with lock:
                held.set()
                release.wait(10)

        t = threading.Thread(target=in_a_call)
        t.start()
        held.wait(5)
        try:
            pid = _child(lambda: _is(c.get(SMALL, ta)[1], kva))
        finally:
            release.set()
            t.join()
        assert _wait(pid, 15) == 0


def test_close_while_another_thread_is_in_calls_never_serves_another_prefix():
    """close() while a thread keeps calling: its calls answer right or fail; none is answered with another
    prefix's K/V. (Sound before this file's fixes too: a soundness check.)"""
    with _serve("tcp") as (sidecar, kw):
        c = PromptCacheClient(sidecar.address, timeout=5, **kw)
        ta, kva = _prefix(9)
        c.put(SMALL, ta, kva)
        stop, wrong, calls = threading.Event(), [], [0]

        def worker():
            while not stop.is_set():
                try:
                    _, kv = c.get(SMALL, ta)
                except Exception:  # noqa: BLE001 - failing after close() is fine
                    time.sleep(0.001)
                    continue
                calls[0] += 1
                if not _is(kv, kva):
                    wrong.append(kv)

        t = threading.Thread(target=worker)
        t.start()
        time.sleep(0.3)
        c.close()
        time.sleep(0.3)
        stop.set()
        t.join()
        assert calls[0] > 0 and not wrong


def test_a_closed_client_opens_no_new_bulk_connection():
    """A thread that used the bulk channel calls again after close(): its connection was closed under it, and a
    new one was opened (never closed: close() had run) and the call answered by a closed client."""
    with _serve("tcp") as (sidecar, kw):
        c = PromptCacheClient(sidecar.address, timeout=5, **kw)
        ta, kva = _prefix(10)
        c.put(SMALL, ta, kva)
        got = []

        def calls(after: threading.Event, closed: threading.Event):
            got.append(c.get(SMALL, ta))
            after.set()
            closed.wait(5)
            try:
                got.append(c.get(SMALL, ta))
            except Exception as exc:  # noqa: BLE001
                got.append(exc)

        used, closed = threading.Event(), threading.Event()
        t = threading.Thread(target=calls, args=(used, closed))
        t.start()
        used.wait(5)
        c.close()
        closed.set()
        t.join()
        assert _is(got[0][1], kva)
        assert isinstance(got[1], Exception), "a closed client answered"
        assert c._bulk._all == []
