"""The /metrics endpoint's bounds (promptcache.sidecar.metricsserver): idle connections cannot pile up threads in
the sidecar, and scrapes are served again once the idle ones time out."""
from __future__ import annotations

import os
import socket
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from promptcache.sidecar import metricsserver


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read()


def test_idle_connections_are_bounded_and_dropped(monkeypatch):
    monkeypatch.setattr(metricsserver.BoundedMetricsServer, "max_connections", 4)
    monkeypatch.setattr(metricsserver._Handler, "timeout", 1.0)
    registry = CollectorRegistry()
    Counter("promptcache_probe", "a probe", registry=registry).inc()
    httpd, thread = metricsserver.serve(0, "127.0.0.1", registry)
    port = httpd.server_port
    try:
        assert b"promptcache_probe_total 1.0" in _scrape(port)
        threads_before = len(os.listdir("/proc/self/task"))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]  # each sends nothing
        deadline = time.monotonic() + 20  # (the accept loop may lag on a loaded machine)
        while httpd.refused < 46 and time.monotonic() < deadline:
            assert len(os.listdir("/proc/self/task")) <= threads_before + 4  # a thread per slot, not per connection
            time.sleep(0.05)
        assert httpd.refused >= 30  # (most of the 46 beyond the slots; some may still sit in the listen queue)
        for s in idle:
            s.close()
        while time.monotonic() < deadline:  # the idle ones time out (or see their close) and give their slots back
            try:
                assert b"promptcache_probe_total 1.0" in _scrape(port)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("no scrape was served after the idle connections went")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_a_sidecar_serves_metrics_through_the_bounded_server(sidecar):
    assert isinstance(sidecar._http, metricsserver.BoundedMetricsServer)
    assert b"promptcache_" in _scrape(sidecar.metrics_port)
