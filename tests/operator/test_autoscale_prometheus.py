"""The autoscaler's Prometheus source against a real Prometheus server (Debian's `prometheus` package, the same one
that ships promtool) scraping a real sidecar under load: the PromQL of metrics_source.PrometheusSource returns
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
from promptcache.operator import metrics_source
from support import SidecarProcess
from test_closed_loop import CHUNK_TOKENS, Workload

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
pytestmark = pytest.mark.tools  # the Prometheus server (Debian, hack/system-deps.sh)
Mi = 1 << 20


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
        src = metrics_source.PrometheusSource(url, window_s=5)

        def answered():
            s, latest = src.signal("ml/c", [])
            return (s, latest) if s is not None and s.hit_ratio is not None and s.capacity_evictions_per_s > 0 \
                else None
        s, latest = wait_for(answered, timeout=20, interval=1, what="a signal from Prometheus")
        # A 24 MiB working set in a 4 MiB budget: mostly misses, steady capacity evictions of young entries.
        assert 0 <= s.hit_ratio < 0.6 and s.lookup_tokens_per_s > 0
        assert s.eviction_age_s is not None and s.eviction_age_s < 60
        assert latest["c-abcde"].budget_bytes == 4 * Mi and 0 < s.stored_bytes <= 4 * Mi
        # Same window, read from the sidecar directly: the rates agree within scrape jitter.
        scraped = metrics_source.ScrapeSource(window_s=3)
        ep = [metrics_source.Endpoint("c-abcde", "127.0.0.1", f"http://127.0.0.1:{sidecar.metrics_port}/metrics")]
        scraped.signal("ml/c", ep)
        time.sleep(3)
        direct, _ = scraped.signal("ml/c", ep)
        assert abs(direct.hit_ratio - s.hit_ratio) < 0.25, (direct, s)
    finally:
        workload.stop.set()
        workload.join(10)
        prom.terminate()
        prom.wait(10)
        sidecar.stop()
