"""Short runs of the throughput and latency benchmarks (`make bench` runs them in full): they keep working and
print what docs/benchmarks.md quotes. Real sidecar and real redis-server subprocesses; the figures are not checked."""
from __future__ import annotations

import shutil

import pytest

from promptcache.cli import main

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is installed by `make test` (hack/system-deps.sh)")


@pytest.mark.slow  # a sidecar process per transport and a Redis server
def test_throughput_bench_prints_every_transport_against_redis(tmp_path, capsys):
    out = tmp_path / "throughput.md"
    assert main(["bench", "throughput", "--sizes-mb", "1", "--repeats", "1", "--transports",
                 "tcp,shm,bulk-tcp,bulk-shm,bulk-lent", "--output", str(out)]) == 0
    throughput, profile = out.read_text().split("CPU ms per call")
    rows = [line for line in throughput.splitlines() if line.startswith("| 1 MiB")]
    assert [r.split("|")[2].strip() for r in rows] == ["tcp", "shm", "shm, views", "bulk-tcp", "bulk-tcp, views",
                                                       "bulk-shm", "bulk-shm, views", "bulk-lent", "bulk-lent, views"]
    for r in rows:
        for column in (9, 12):  # Get / Redis; Put / Redis used as a cache (new keys)
            ratio = r.split("|")[column].strip()
            assert ratio.endswith("x") and float(ratio[:-1]) > 0
    # Where each call's CPU goes: the client (this process) and the server that answered it, both at work.
    cpu = {r.split("|")[2].strip(): [float(x) for x in r.split("|")[3:6]]
           for r in profile.splitlines() if r.startswith("| 1 MiB")}
    for call in ("bulk-tcp Put", "bulk-tcp Redis SET", "bulk-tcp Redis SET, new keys", "bulk-tcp Get, owned",
                 "bulk-tcp Redis GET", "bulk-lent Get, views", "shm Redis SET, new keys"):
        client, server, total = cpu[call]
        assert client > 0 and server > 0 and total == pytest.approx(client + server, abs=0.011)


@pytest.mark.slow  # a benchmark run
def test_latency_bench_reports_grpc_floor_and_bulk_share(capsys):
    assert main(["bench", "latency", "--rounds", "5"]) == 0
    text = capsys.readouterr().out
    assert "empty gRPC call" in text and "lent (zero copy), back to back" in text and "between Redis GETs" in text
    assert "lent bulk Get / Redis GET:" in text


@pytest.mark.slow  # a sidecar process and a Redis server
def test_throughput_bench_splits_the_same_bytes_into_other_chunk_sizes(tmp_path):
    """--chunk-kib: 4 MiB as 16 chunks of 256 KiB and as one of 4 MiB (Redis: as many keys), each stored and read
    back whole (the bench asserts every chunk stored and served); a size that is not whole chunks is refused."""
    for kib in (256, 4096):
        out = tmp_path / f"throughput-{kib}.md"
        assert main(["bench", "throughput", "--sizes-mb", "4", "--repeats", "1", "--transports", "bulk-tcp",
                     "--chunk-kib", str(kib), "--output", str(out)]) == 0
        text = out.read_text()
        assert f"chunks of {kib} KiB" in text.splitlines()[0]
        assert any(line.startswith("| 4 MiB | bulk-tcp |") for line in text.splitlines())
    assert main(["bench", "throughput", "--sizes-mb", "1", "--chunk-kib", "4096", "--transports", "bulk-tcp",
                 "--output", str(tmp_path / "refused.md")]) == 2


def test_cpu_meter_does_not_count_its_own_reads_as_the_clients():
    """The meter reads /proc for every thread of three processes twice per block of calls (about 0.5 ms a read
    here): that is the benchmark's cost, not the client library's, so two reads with nothing between them show
    the client (this process) spending about nothing, where they showed a whole read's CPU before."""
    import os
    import time

    from promptcache_devtools.bench.throughput import CpuMeter

    meter = CpuMeter({"sidecar": os.getpid(), "redis": os.getpid()})  # this process thrice: reads that cost
    start, pairs, delta = time.thread_time(), 50, 0.0
    for _ in range(pairs):
        before = meter.snapshot()
        delta += meter.snapshot()["client"] - before["client"]
    per_read = (time.thread_time() - start) / (2 * pairs)
    assert per_read > 0
    assert abs(delta / pairs) < 0.5 * per_read, (delta / pairs, per_read)


def test_the_throughput_bench_pins_the_clients_allocator_so_large_buffers_reuse_memory():
    """steady_allocator(): after one large buffer is freed, the next of that size comes from memory the process
    already has (no page faults), whichever call it is, as in a long-running client; without it glibc maps and
    faults in every buffer past its mmap threshold (a fresh process's first calls: the Redis client of the first
    transport measured 2.5x slower than of the second). Each case in a fresh process, so nothing leaks here."""
    import subprocess
    import sys

    probe = ("import resource, sys\n"
             "from promptcache_devtools.bench.throughput import steady_allocator\n"
             "if sys.argv[1] == 'pinned':\n"
             "    assert steady_allocator()\n"
             "b = b'\\x01' * (64 << 20)\n"
             "del b\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "b = b'\\x02' * (64 << 20)\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = {case: int(subprocess.run([sys.executable, "-c", probe, case], capture_output=True, text=True,
                                       check=True).stdout) for case in ("default", "pinned")}
    # The control: a fresh mapping, faulted in page by page (or by huge page where THP is "always").
    assert faults["default"] > 4 * faults["pinned"], faults
    assert faults["pinned"] < (64 << 20) // 4096 // 16, faults
