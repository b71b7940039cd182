"""The cache alerts (promptcache.operator.alerts): `promtool check rules` and `promtool test rules` on the operator's
per-cache PrometheusRule and on the chart's cluster-wide one; every alert has a case where it fires and one where it
stays silent. Also: every alert has summary, description and a runbook_url whose anchor exists in docs/runbooks.md,
and the chart's template is what alerts.py generates."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from promptcache.operator import alerts, builders
from promptcache.operator.builders import OperatorDefaults, Owner
from promptcache.operator.model import PromptCacheSpec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "promptcache-operator"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
NS, NAME = "ml", "llama"
SVC = f"{NAME}-metrics"
BASE = {"namespace": NS, "service": SVC}
POD = {**BASE, "pod": "llama-abcde"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


# alert -> (eval time, firing input, expected labels of the firing alert, silent input)
CASES = {
    "PromptCacheHitRatioLow": (
        "30m",
        [series("promptcache_hit_tokens_total", {**POD, "rpc": "Lookup", "tier": "device"}, "0+6000x40"),
         series("promptcache_missed_tokens_total", {**POD, "rpc": "Lookup"}, "0+54000x40")],
        {**BASE, "severity": "warning"},
        # 50 % hits; an idle cache (no lookups at all); and a trickle (one missed token a minute, hit ratio 0):
        # none is alerted on.
        [series("promptcache_hit_tokens_total", {**POD, "rpc": "Lookup", "tier": "device"}, "0+30000x40"),
         series("promptcache_missed_tokens_total", {**POD, "rpc": "Lookup"}, "0+30000x40"),
         series("promptcache_hit_tokens_total", {**POD, "service": "trickle-metrics", "rpc": "Lookup",
                                                 "tier": "device"}, "0x40"),
         series("promptcache_missed_tokens_total", {**POD, "service": "trickle-metrics", "rpc": "Lookup"},
                "0+1x40"),
         series("promptcache_hit_tokens_total", {**POD, "service": "idle-metrics", "rpc": "Lookup",
                                                 "tier": "device"}, "0x40"),
         series("promptcache_missed_tokens_total", {**POD, "service": "idle-metrics", "rpc": "Lookup"}, "0x40")]),
    "PromptCacheEvictionStorm": (
        "30m",
        [series("promptcache_evictions_total", {**POD, "tier": "device", "reason": "capacity"}, "0+12000x40")],
        {**POD, "severity": "warning"},
        # 1/s capacity evictions, and a TTL storm (not capacity).
        [series("promptcache_evictions_total", {**POD, "tier": "device", "reason": "capacity"}, "0+60x40"),
         series("promptcache_evictions_total", {**POD, "tier": "device", "reason": "ttl"}, "0+12000x40")]),
    "PromptCacheMemoryNearLimit": (
        "30m",
        [series("promptcache_committed_bytes", {**POD, "tier": "device"}, "99x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x40")],
        {**POD, "tier": "device", "severity": "warning"},
        # half full in memory; a full disk tier is another alert's business.
        [series("promptcache_committed_bytes", {**POD, "tier": "device"}, "50x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x40"),
         series("promptcache_committed_bytes", {**POD, "tier": "disk"}, "100x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "disk"}, "100x40")]),
    "PromptCacheContainerMemoryNearLimit": (
        "30m",
        [series("container_memory_working_set_bytes", {"namespace": NS, "pod": POD["pod"], "container": "sidecar"},
                "95x40"),
         series("kube_pod_container_resource_limits", {"namespace": NS, "pod": POD["pod"], "container": "sidecar",
                                                       "resource": "memory"}, "100x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "80x40")],
        {"namespace": NS, "pod": POD["pod"], "severity": "critical"},
        # well under the limit; and a container named sidecar in a pod that is not a PromptCache sidecar.
        [series("container_memory_working_set_bytes", {"namespace": NS, "pod": POD["pod"], "container": "sidecar"},
                "50x40"),
         series("kube_pod_container_resource_limits", {"namespace": NS, "pod": POD["pod"], "container": "sidecar",
                                                       "resource": "memory"}, "100x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "80x40"),
         series("container_memory_working_set_bytes", {"namespace": NS, "pod": "other", "container": "sidecar"},
                "99x40"),
         series("kube_pod_container_resource_limits", {"namespace": NS, "pod": "other", "container": "sidecar",
                                                       "resource": "memory"}, "100x40")]),
    "PromptCacheDiskTierNearlyFull": (
        "30m",
        [series("promptcache_committed_bytes", {**POD, "tier": "disk"}, "95x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "disk"}, "100x40")],
        {**POD, "severity": "warning"},
        # disk tier disabled (budget 0) and a nearly empty one.
        [series("promptcache_committed_bytes", {**POD, "tier": "disk"}, "0x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "disk"}, "0x40"),
         series("promptcache_committed_bytes", {**POD, "pod": "other", "tier": "disk"}, "10x40"),
         series("promptcache_budget_bytes", {**POD, "pod": "other", "tier": "disk"}, "100x40")]),
    "PromptCacheSidecarDown": (
        "30m",
        [series("up", POD, "1x10 0x30"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x10 _x30")],
        {**POD, "severity": "critical"},
        # up, and a down target that never was a PromptCache sidecar.
        [series("up", POD, "1x40"),
         series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x40"),
         series("up", {**POD, "pod": "unrelated"}, "0x40")]),
    "PromptCacheSidecarAbsent": (
        "30m",
        [series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x10 _x30")],
        {**BASE, "severity": "critical"},
        # still reporting (one pod replaced by another in a rollout).
        [series("promptcache_budget_bytes", {**POD, "tier": "device"}, "100x10 _x30"),
         series("promptcache_budget_bytes", {**POD, "pod": "llama-new", "tier": "device"}, "_x10 100x30")]),
    "PromptCacheErrorRateHigh": (
        "30m",
        [series("promptcache_requests_total", {**POD, "rpc": "Get", "code": "OK"}, "0+90x40"),
         series("promptcache_requests_total", {**POD, "rpc": "Get", "code": "INTERNAL"}, "0+10x40")],
        {**BASE, "severity": "warning"},
        # client mistakes are not server errors.
        [series("promptcache_requests_total", {**POD, "rpc": "Get", "code": "OK"}, "0+90x40"),
         series("promptcache_requests_total", {**POD, "rpc": "Put", "code": "INVALID_ARGUMENT"}, "0+30x40")]),
    "PromptCacheChecksumFailures": (
        "12m",
        [series("promptcache_checksum_failures_total", {**POD, "tier": "disk"}, "0x10 1x30")],
        {**POD, "tier": "disk", "severity": "warning"},
        [series("promptcache_checksum_failures_total", {**POD, "tier": "disk"}, "0x40")]),
    "PromptCacheGCPausesLong": (
        "50m",
        # a full collection a minute, each between 0.5 and 1 s
        [*(series("promptcache_gc_pause_seconds_bucket", {**POD, "generation": "2", "le": le}, values)
           for le, values in (("0.25", "0x60"), ("0.5", "0x60"), ("1", "0+1x60"), ("+Inf", "0+1x60")))],
        {**POD, "severity": "warning"},
        # as many, each under 50 ms; and young collections, however long, do not count
        [*(series("promptcache_gc_pause_seconds_bucket", {**POD, "generation": "2", "le": le}, "0+1x60")
           for le in ("0.05", "0.25", "0.5", "1", "+Inf")),
         *(series("promptcache_gc_pause_seconds_bucket", {**POD, "generation": "0", "le": le}, values)
           for le, values in (("0.25", "0x60"), ("1", "0+1x60"), ("+Inf", "0+1x60")))]),
}


def test_every_alert_has_cases():
    assert set(CASES) == set(alerts.ALERTS)


def operator_rule_groups(labels: dict[str, str] | None = None) -> list[dict]:
    spec = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"}})
    d = OperatorDefaults(monitoring_labels=tuple((labels or {}).items()))
    return builders.prometheus_rule(spec, Owner(NAME, NS, "uid"), d)["spec"]["groups"]


def chart_rule_groups(helm_offline) -> list[dict]:
    out = helm_offline("template", "x", str(CHART), "--set", "cacheAlerts.enabled=true",
                       "--show-only", "templates/cache-alerts.yaml")
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    return doc["spec"]["groups"]


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if not Path(PROMTOOL).exists():
        pytest.fail("promtool not found (Debian: apt-get install prometheus)", pytrace=False)
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def check_and_test(groups: list[dict], tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False, width=10000))
    r = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts.ALERTS)} rules found" in r.stdout, r.stdout
    tests = []
    for name, (at, firing, want, silent) in CASES.items():
        tests.append({"name": f"{name} fires", "interval": "1m", "input_series": firing,
                      "alert_rule_test": [{"eval_time": at, "alertname": name,
                                           "exp_alerts": [{"exp_labels": want}]}]})
        tests.append({"name": f"{name} silent", "interval": "1m", "input_series": silent,
                      "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": []}]})
    # promtool compares annotations too; they are template-checked by `check rules`, so the test copy drops them.
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"groups": bare}, sort_keys=False, width=10000))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["bare.yaml"], "evaluation_interval": "1m", "tests": tests}, sort_keys=False, width=10000))
    r = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.tools
def test_operator_rule_promtool(tmp_path):
    check_and_test(operator_rule_groups(), tmp_path)


@pytest.mark.tools
def test_chart_rule_promtool(helm_offline, tmp_path):
    check_and_test(chart_rule_groups(helm_offline), tmp_path)


def test_annotations_and_runbooks():
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", runbooks, re.M)}
    for g in operator_rule_groups():
        for r in g["rules"]:
            a = r["annotations"]
            assert a["summary"] and a["description"], r["alert"]
            url, anchor = a["runbook_url"].split("#")
            assert url == alerts.RUNBOOK_BASE and anchor == r["alert"].lower()
            assert anchor in anchors, f"docs/runbooks.md has no section {r['alert']}"


def test_operator_monitoring_labels_from_env():
    assert alerts.monitoring_labels_from_env({}) == {"release": "kube-prometheus-stack"}
    assert alerts.monitoring_labels_from_env({"PROMPTCACHE_OPERATOR_MONITORING_LABELS": "release=prom,team=ml"}) == {
        "release": "prom", "team": "ml"}
    assert alerts.monitoring_labels_from_env({"PROMPTCACHE_OPERATOR_MONITORING_LABELS": ""}) == {}
    d = OperatorDefaults.from_env({"PROMPTCACHE_OPERATOR_MONITORING_LABELS": "release=prom"})
    spec = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"}})
    owner = Owner(NAME, NS, "u")
    assert builders.prometheus_rule(spec, owner, d)["metadata"]["labels"]["release"] == "prom"
    assert builders.service_monitor(spec, owner, d)["metadata"]["labels"]["release"] == "prom"


def test_chart_template_is_generated():
    got = (CHART / "templates" / "cache-alerts.yaml").read_text()
    assert got == alerts.helm_template(), (
        "charts/promptcache-operator/templates/cache-alerts.yaml is stale: run "
        "python -m promptcache.operator.alerts --helm > charts/promptcache-operator/templates/cache-alerts.yaml")


# --- the Grafana dashboard (charts/promptcache-operator/dashboards/promptcache.json) -----------------------------
def _dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]


@pytest.mark.tools
def test_dashboard_configmap_and_promql(helm_offline, tmp_path):
    out = helm_offline("template", "x", str(CHART), "--show-only", "templates/grafana-dashboard.yaml")
    (cm,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["promptcache.json"])
    titles = {p["title"] for p in dash["panels"]}
    assert {"Hit ratio per tier", "Bytes served and stored", "Evictions by reason", "Request latency",
            "Memory against budget", "Tuning decisions (Resize)"} <= titles
    # Every query is valid PromQL (promtool parses them as recording rules, with the dashboard variables filled in)
    # and names only series the sidecar exports.
    exprs = _dashboard_exprs(dash)
    filled = [e.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$cache", ".*") for e in exprs]
    (tmp_path / "dash.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(filled)]}]}, width=10000))
    r = promtool("check", "rules", "dash.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    exported = sidecar_series() | client_series()
    used = {n for e in exprs for n in re.findall(r"\b(promptcache_[a-z_]+)", e)}
    assert used <= exported, used - exported
    # The inference pods' side is on it: fallbacks, and load/save latency.
    assert {"promptcache_client_fallbacks_total", "promptcache_client_load_seconds_bucket",
            "promptcache_client_save_seconds_bucket"} <= used


def client_series() -> set[str]:
    """Names of the series the client integrations export in the inference pods (transformers, vLLM)."""
    import prometheus_client

    pytest.importorskip("promptcache.client.metrics")
    return {f.name + suffix for f in prometheus_client.REGISTRY.collect() if f.name.startswith("promptcache_client_")
            for suffix in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(f.type, ("",))}


def sidecar_series() -> set[str]:
    """Names of the series the sidecar exports (from its metrics module)."""
    sidecar_metrics = pytest.importorskip("promptcache.sidecar.metrics")
    m = sidecar_metrics.Metrics()

    class Tier:
        def usage(self):
            return {"entries": 0, "used": 0, "budget": 1}
    m.watch({"device": Tier()})
    exported = set()
    for f in m.registry.collect():
        if f.type == "counter":
            exported.add(f.name + "_total")
        elif f.type == "histogram":
            exported |= {f.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            exported.add(f.name)
    return exported


def test_alerts_use_only_sidecar_series():
    used = {n for g in operator_rule_groups() for r in g["rules"]
            for n in re.findall(r"\b(promptcache_[a-z_]+)", r["expr"])}
    # besides: up (Prometheus), container_memory_working_set_bytes (cAdvisor), kube_pod_container_resource_limits
    # (kube-state-metrics), all in kube-prometheus-stack
    assert used and used <= sidecar_series(), used - sidecar_series()


@pytest.mark.tools
def test_chart_operator_rule_degraded_reads_the_operators_own_series(helm_offline, tmp_path):
    """PromptCacheDegraded reads promptcache_operator_cache_condition (tests/operator/test_operator_apiserver.py
    checks the operator exports it); a standby replica's missing series or a healthy cache stays silent."""
    out = helm_offline("template", "x", str(CHART), "--set", "prometheusRule.enabled=true",
                       "--show-only", "templates/prometheusrule.yaml")
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}, sort_keys=False))
    r = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    cond = "promptcache_operator_cache_condition"
    degraded = {"namespace": NS, "name": NAME, "condition": "Degraded", "pod": "op-1"}
    tests = [
        {"name": "degraded fires", "interval": "1m",
         "input_series": [series(cond, degraded, "1x30"), series(cond, {**degraded, "pod": "op-2"}, "0x30")],
         "alert_rule_test": [{"eval_time": "20m", "alertname": "PromptCacheDegraded",
                              "exp_alerts": [{"exp_labels": {"namespace": NS, "name": NAME,
                                                             "severity": "warning"}}]}]},
        {"name": "healthy or briefly degraded stays silent", "interval": "1m",
         "input_series": [series(cond, degraded, "0x30"),
                          series(cond, {**degraded, "name": "blip"}, "0x10 1x5 0x15")],
         "alert_rule_test": [{"eval_time": "20m", "alertname": "PromptCacheDegraded", "exp_alerts": []}]}]
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in doc["spec"]["groups"]]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"groups": bare}, sort_keys=False, width=10000))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["bare.yaml"], "evaluation_interval": "1m", "tests": tests}, sort_keys=False, width=10000))
    r = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.tools
@pytest.mark.parametrize("duration", ["1h30m", "1d", "1w", "0"])
def test_every_prometheus_duration_the_crd_admits_passes_promtool(helm_offline, tmp_path, duration):
    """spec.alerts.for (and the chart's cacheAlerts.for) take Prometheus' duration grammar, not only N(ms|s|m|h):
    the operator's rule and the chart's both pass `promtool check rules` with it."""
    spec = PromptCacheSpec.from_dict({"model": {"name": "m", "revision": "r"}, "memory": {"host": "4Gi"},
                                      "alerts": {"for": duration}})
    groups = builders.prometheus_rule(spec, Owner(NAME, NS, "uid"))["spec"]["groups"]
    out = helm_offline("template", "x", str(CHART), "--set", "cacheAlerts.enabled=true",
                       "--set-string", f"cacheAlerts.for={duration}", "--show-only", "templates/cache-alerts.yaml")
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    for name, g in (("operator", groups), ("chart", doc["spec"]["groups"])):
        assert duration in {r.get("for") for grp in g for r in grp["rules"]}, name
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"groups": g}, sort_keys=False, width=10000))
        r = promtool("check", "rules", f"{name}.yaml", cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
