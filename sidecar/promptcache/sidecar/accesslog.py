"""Opt-in access log: the sidecar's real traffic as a replayable trace (--access-log-path), rotated by size.

One JSON object per line in the trace format that `promptcache bench replay --trace FILE` reads
(promptcache.sidecar.trace.read_trace):

    {"timestamp": ms since the epoch, "input_length": prompt tokens, "output_length": 0,
     "hash_ids": [one integer per whole chunk], "block_tokens": tokens per chunk}

No token and no chunk key is written: each `hash_ids` entry is a keyed BLAKE2b of the chunk's key (64 bits, top bit
cleared so it stays a non-negative JSON integer), keyed by a secret drawn at random when the sidecar starts and never
written anywhere. Chunk keys are chained, so the hashed ids still identify whole prefixes: two records share entry i
iff their first i+1 chunks are equal, which is all a replay needs. Without the secret, an id cannot be tested against
a guessed prompt (a bare chunk key could: it is a SHA-256 of public inputs). Ids from different starts of the
sidecar do not match.

Sampling is by chain root (chunk 0's key), like the miss-ratio curve's, so a sampled conversation is logged whole
and a replay of the sample keeps the prefix structure. Rotation: when the next line would take the file past
--access-log-max-bytes, FILE becomes FILE.1 (FILE.1 becomes FILE.2, ...), and at most --access-log-files files are
kept (FILE included): the log never takes more than max-bytes x files on disk. A line longer than max-bytes is
dropped (and counted). Replay rotated files oldest first: `cat FILE.3 FILE.2 FILE.1 FILE > all.jsonl`.

The file (docs/security.md): opened O_NOFOLLOW|O_NONBLOCK (a symlink is refused, not followed; a FIFO never
hangs start-up), only a regular file is accepted, created (and kept) 0600. An existing file is written to only when
it is empty or an access log already (its first line is one of ours): any other file is refused, never appended
to, and the files rotation would overwrite (FILE.1 ...) are checked the same way. Only a file the sidecar
created, or an access log of ours, is set to 0600; an existing empty file readable by others is refused (not
chmod'ed). Rotation deletes or renames FILE only while it is still the file being written. Every refusal at start
names --access-log-path and the path (the start fails). When the file cannot be written while running (its folder
removed, the disk full) lines are dropped and counted, one log line says why, and the file is opened again once
its folder is back.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import time

from promptcache.contract.shm import kind_of

log = logging.getLogger("promptcache.sidecar.accesslog")

_U64 = 1 << 64


def log_sampled(root: bytes, rate: float) -> bool:
    """Is the chain under `root` logged? Uses other bytes of the (uniform) key than the curve's sample."""
    return rate >= 1.0 or int.from_bytes(root[:8], "little") < rate * _U64


FLAG = "--access-log-path"
REOPEN_SECONDS = 1.0  # while the file cannot be written (its folder removed), try again at most this often


_LINE_START = re.compile(rb'\{"timestamp":-?\d+,"input_length":-?\d+,"output_length":0,"hash_ids":\[')
_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids", "block_tokens"}
_PEEK = 1 << 16  # how much of a file's first line is read to tell whether it is an access log of ours


def looks_like_access_log(head: bytes) -> bool:
    """Is `head` (the first bytes of a file) the start of an access log this module wrote? Its first line is one
    record (a complete one is parsed; one longer than what was read must start like one)."""
    line, newline, _ = head.partition(b"\n")
    if not _LINE_START.match(line):
        return False
    if not newline:
        return len(head) >= _PEEK  # a line longer than the peek: its start is all that can be told
    try:
        d = json.loads(line)
    except ValueError:
        return False
    return isinstance(d, dict) and set(d) == _FIELDS and isinstance(d["hash_ids"], list)


def _same_file(fd: int, path: str) -> bool:
    """Is `path` (not followed) still the file open on `fd`?"""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_rotation_target(path: str) -> None:
    """ValueError naming the flag unless `path` (a file rotation would overwrite: FILE.1, ...) is absent or an access
    log of ours: rotation never overwrites another file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{FLAG}: {path} (a file rotation would overwrite) is a symbolic link; not replaced") \
                from None
        raise ValueError(f"{FLAG}: {path} (a file rotation would overwrite): {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{FLAG}: {path} (a file rotation would overwrite) is {kind_of(st.st_mode)}, not an "
                             "access log; not replaced")
        if st.st_size and not looks_like_access_log(os.pread(fd, _PEEK, 0)):
            raise ValueError(f"{FLAG}: {path} (a file rotation would overwrite) is not an access log; not replaced "
                             "(move it, or name another --access-log-path)")
    except OSError as exc:
        raise ValueError(f"{FLAG}: {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def open_log_file(path: str) -> int:
    """The log file's descriptor, opened for appending without following a link (O_NOFOLLOW) or blocking
    (O_NONBLOCK: a FIFO without a reader would hang the open forever); only a regular file is accepted. A new file
    is created 0600 (it tells request timing, lengths and prefix sharing); an existing one must be empty or an
    access log of ours (its first line), never another file: an access log of ours is set to 0600 if it was not,
    an empty file readable by others is refused (it is not ours to chmod). ValueError naming the flag and the
    path otherwise."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{FLAG} {path} is a symbolic link; it is not followed (name the file itself)") \
                from None
        if exc.errno == errno.ENXIO:  # O_NONBLOCK on a FIFO without a reader
            raise ValueError(f"{FLAG} {path} is a FIFO, not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise ValueError(f"{FLAG} {path} is a directory, not a regular file") from None
        raise ValueError(f"{FLAG} {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{FLAG} {path} is {kind_of(st.st_mode)}, not a regular file")
        if not created:
            ours = st.st_size > 0
            if ours and not looks_like_access_log(os.pread(fd, _PEEK, 0)):
                raise ValueError(f"{FLAG} {path} is an existing file that is not an access log (its first line is "
                                 "not a record of ours); it is not written to: name a new file, or an access log")
            if stat.S_IMODE(st.st_mode) & 0o077:
                if not ours:
                    raise ValueError(f"{FLAG} {path} is an existing empty file open to others (mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}); the log would tell them request timing and "
                                     "prefix sharing: chmod 600 it, or name a new file (created 0600)")
                if st.st_uid == os.geteuid():
                    os.fchmod(fd, 0o600)
    except OSError as exc:
        os.close(fd)
        raise ValueError(f"{FLAG} {path}: {exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class AccessLog:
    def __init__(self, path: str, max_bytes: int, files: int, secret: bytes | None = None,
                 clock=time.monotonic) -> None:
        if max_bytes <= 0 or files < 1:
            raise ValueError("access log: max_bytes must be positive and files at least 1")
        self.path = path
        self.max_bytes = max_bytes
        self.files = files
        self.clock = clock
        self._secret = secret or secrets.token_bytes(32)
        self.records = 0
        self.dropped = 0
        self.rotations = 0
        self.write_errors = 0
        self._failed_at = 0.0
        self._problem = ""  # what stopped the last write: logged once per kind
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{FLAG} {path}: cannot create its folder {folder}: {exc.strerror or exc}") from None
        self._fd: int | None = open_log_file(path)
        try:
            for i in range(1, files):  # the files rotation would overwrite: refused now, not found out then
                check_rotation_target(f"{path}.{i}")
        except BaseException:
            os.close(self._fd)
            raise
        self._size = os.fstat(self._fd).st_size

    def hash_id(self, key: bytes) -> int:
        h = hashlib.blake2b(key, key=self._secret, digest_size=8).digest()
        return int.from_bytes(h, "big") >> 1

    def record(self, keys: list[bytes], input_length: int, chunk_tokens: int, timestamp_ms: int) -> None:
        line = json.dumps({"timestamp": timestamp_ms, "input_length": input_length, "output_length": 0,
                           "hash_ids": [self.hash_id(k) for k in keys], "block_tokens": chunk_tokens},
                          separators=(",", ":")).encode() + b"\n"
        if len(line) > self.max_bytes:
            self.dropped += 1
            return
        if self._fd is None and not self._reopen():
            self.dropped += 1
            return
        try:
            if self._size + len(line) > self.max_bytes:
                self._rotate()
            os.write(self._fd, line)  # unbuffered: a crash loses at most the line being written
        except (OSError, ValueError) as exc:
            self._fail(exc)
            self.dropped += 1
            return
        self._size += len(line)
        self.records += 1

    def _fail(self, exc: Exception) -> None:
        """The file cannot be written (its folder removed, the disk full, replaced by something else): stop
        writing, say so once, and reopen once the folder is back (record tries every REOPEN_SECONDS)."""
        self.write_errors += 1
        self._failed_at = self.clock()
        why = str(exc) if isinstance(exc, ValueError) else f"{FLAG} {self.path}: {exc.strerror or exc}"
        if why != self._problem:
            self._problem = why
            log.error("access log stopped (%s); lines are dropped until it can be written again", why)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _reopen(self) -> bool:
        if self.clock() - self._failed_at < REOPEN_SECONDS:
            return False
        if not os.path.isdir(os.path.dirname(os.path.abspath(self.path))):  # not recreated by us: an operator's
            self._failed_at = self.clock()
            return False
        try:
            self._fd = open_log_file(self.path)
            self._size = os.fstat(self._fd).st_size
        except (OSError, ValueError) as exc:
            self._fail(exc)
            return False
        log.warning("access log %s is written again", self.path)
        self._problem = ""
        return True

    def _rotate(self) -> None:
        """FILE becomes FILE.1 (...), or is deleted with --access-log-files 1. Only while FILE is still the file
        being written (not replaced behind our back), and no FILE.i that is not an access log is overwritten:
        otherwise ValueError (lines are dropped, said once, until it can be written again)."""
        fd, self._fd = self._fd, None
        try:
            if not _same_file(fd, self.path):
                raise ValueError(f"{FLAG} {self.path} is no longer the file this sidecar was writing (replaced or "
                                 "removed); it is not rotated")
            if self.files == 1:
                os.remove(self.path)
            else:
                for i in range(self.files - 1, 0, -1):
                    check_rotation_target(f"{self.path}.{i}")
                for i in range(self.files - 1, 0, -1):
                    src = self.path if i == 1 else f"{self.path}.{i - 1}"
                    if os.path.lexists(src):
                        os.replace(src, f"{self.path}.{i}")  # the oldest is overwritten: files stay bounded
        finally:
            os.close(fd)
        self._fd = open_log_file(self.path)
        self._size = 0
        self.rotations += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
