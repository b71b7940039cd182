"""The autoscaler's Prometheus source against a real Prometheus server (Debian's `prometheus` package, the same one
that ships promtool) scraping a real sidecar under load: the PromQL of fleet.PrometheusSource returns
what the sidecar's own counters say. The scrape job sets the target labels a ServiceMonitor would
(namespace, service, pod)."""
from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from opharness import free_port, wait_for
from promptcache.operator import fleet
from promptcache.operator.builders import CONTAINER, Owner
from support import SidecarProcess
from test_closed_loop import CHUNK_TOKENS, Workload

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = pytest.mark.tools  # the Prometheus server (Debian, hack/system-deps.sh)
Mi = 1 << 20


class Pod:
    """The API server's listing of the one cache pod, the local sidecar (what fleet.discover reads)."""

    def __init__(self, name: str, metrics_port: int):
        self.pod = {"metadata": {"name": name},
                    "spec": {"nodeName": "node-1", "containers": [
                        {"name": CONTAINER, "ports": [{"name": "metrics", "containerPort": metrics_port}]}]},
                    "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}

    def request(self, method, path, query=None, **_):
        return {"items": [self.pod]}


def test_prometheus_source_against_real_prometheus(tmp_path: Path):
    if not Path(PROMETHEUS).exists():
        pytest.fail("prometheus not found (Debian: apt-get install prometheus)", pytrace=False)
    sidecar = SidecarProcess("--memory-bytes", str(4 * Mi), "--chunk-tokens", str(CHUNK_TOKENS), "--device", "cpu",
                             "--data-dir", str(tmp_path / "data"), "--log-level", "warning").wait_ready()
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "c-metrics", "static_configs": [{
            "targets": [f"127.0.0.1:{sidecar.metrics_port}"],
            "labels": {"namespace": "ml", "service": "c-metrics", "pod": "c-abcde"}}]}]}))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    workload = Workload(sidecar.address)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200, timeout=30,
                 what="prometheus ready")
        workload.start()
        time.sleep(8)
        src = fleet.PrometheusSource(url, window_s=5)
        observed = fleet.Observation("ml", "c", 0.0, (), {})   # Prometheus' own labels say which pods

        def answered():
            s, latest = src.signal(observed)
            return (s, latest) if s is not None and s.hit_ratio is not None and s.capacity_evictions_per_s > 0 \
                else None
        s, latest = wait_for(answered, timeout=20, interval=1, what="a signal from Prometheus")
        # A 24 MiB working set in a 4 MiB budget: mostly misses, steady capacity evictions of young entries.
        assert 0 <= s.hit_ratio < 0.6 and s.lookup_tokens_per_s > 0
        assert s.eviction_age_s is not None and s.eviction_age_s < 60
        assert latest["c-abcde"].budget_bytes == 4 * Mi and 0 < s.stored_bytes <= 4 * Mi
        # Same window, read from the sidecar directly: the rates agree within scrape jitter.
        scraped = fleet.Fleet(window_s=3, max_age_s=0)
        pods = Pod("c-abcde", sidecar.metrics_port)
        owner = Owner("c", "ml", "uid")
        scraped.observe(pods, owner)
        time.sleep(3)
        direct, _ = scraped.signal(scraped.observe(pods, owner))
        assert abs(direct.hit_ratio - s.hit_ratio) < 0.25, (direct, s)
    finally:
        workload.stop.set()
        workload.join(10)
        prom.terminate()
        prom.wait(10)
        sidecar.stop()
