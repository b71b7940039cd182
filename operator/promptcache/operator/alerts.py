"""The PromptCache alert rules, as data: one source for the operator's per-cache PrometheusRule (builders) and the
chart's cluster-wide one (charts/promptcache-operator/templates/cache-alerts.yaml, generated from here:
`python -m promptcache.operator.alerts --helm > charts/promptcache-operator/templates/cache-alerts.yaml`;
tests/operator/test_alerts.py checks that the committed template is what this module generates, and runs
`promtool check rules` and `promtool test rules` on both forms).

Every alert carries `summary`, `description` and a `runbook_url` into docs/runbooks.md (anchor = alert name in
lower case). Series come from the sidecar's /metrics (sidecar/promptcache/sidecar/metrics.py) as scraped by the
ServiceMonitor, which adds the `namespace`, `service` and `pod` target labels; `selector` narrows them to one cache
(`namespace="ns",service="name-metrics"`) or to all caches (the chart's default `service=~".+-metrics"`).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import yaml

RUNBOOK_BASE = "https://github.com/promptcache/promptcache/blob/main/docs/runbooks.md"
# kube-prometheus-stack selects ServiceMonitors and PrometheusRules by its release label (serviceMonitorSelector,
# ruleSelector: release=<its Helm release>, kube-prometheus-stack by default).
DEFAULT_MONITORING_LABELS = {"release": "kube-prometheus-stack"}
CHART_SELECTOR = 'service=~".+-metrics"'
# gRPC codes that say the server failed (client mistakes such as INVALID_ARGUMENT or NOT_FOUND do not count).
SERVER_ERROR_CODES = "INTERNAL|UNKNOWN|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED"

ALERTS = ("PromptCacheHitRatioLow", "PromptCacheEvictionStorm", "PromptCacheMemoryNearLimit",
          "PromptCacheContainerMemoryNearLimit", "PromptCacheDiskTierNearlyFull", "PromptCacheSidecarDown", "PromptCacheSidecarAbsent",
          "PromptCacheErrorRateHigh", "PromptCacheChecksumFailures", "PromptCacheGCPausesLong")
# A sidecar's full garbage collections stop every thread (docs/operating.md, "Garbage collection pauses"): this
# long, at the 90th percentile over half an hour, shows in every call's tail.
GC_PAUSE_SECONDS_ABOVE = 0.25


@dataclass(frozen=True)
class Thresholds:
    """Alert thresholds. The first four are spec.alerts of a PromptCache; the others have fixed defaults."""

    hit_ratio_below: float = 0.2
    memory_utilization_above: float = 0.95
    evictions_per_second_above: float = 100.0
    for_: str = "10m"
    disk_utilization_above: float = 0.9
    error_ratio_above: float = 0.05
    container_memory_above: float = 0.9
    # The hit-ratio alert needs this much traffic (tokens looked up per second over its window): a cache that
    # sees one prompt an hour has a hit ratio that says nothing.
    min_lookup_tokens_per_second: float = 10.0


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float | int) else str(v)


def rules(selector: str, th: Thresholds | dict[str, str] = Thresholds(), runbook_base: str = RUNBOOK_BASE,
          extra_labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The alerting rules for the series matching `selector` (PromQL label matchers without braces).
    `th` may map the Thresholds field names to literal PromQL text instead (the chart passes Helm placeholders)."""
    t = {f.name: _num(getattr(th, f.name)) for f in fields(Thresholds)} if isinstance(th, Thresholds) else th
    s = selector
    by = "namespace, service"
    win = "10m"
    hits = f"sum by ({by}) (rate(promptcache_hit_tokens_total{{{s}}}[{win}]))"
    misses = f"sum by ({by}) (rate(promptcache_missed_tokens_total{{{s}}}[{win}]))"
    cache = "{{ $labels.namespace }}/{{ $labels.service }}"
    pod = "{{ $labels.namespace }}/{{ $labels.pod }}"

    def rule(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
        return {"alert": name, "expr": expr, "for": for_,
                "labels": {"severity": severity, **(extra_labels or {})},
                "annotations": {"summary": summary, "description": description,
                                "runbook_url": f"{runbook_base}#{name.lower()}"}}

    out = [
        rule("PromptCacheHitRatioLow",
             # Only with real traffic: an idle cache (0/0 is NaN, dropped) or a trickle of lookups is not a bad cache.
             f"({hits} / ({hits} + {misses}) < {t['hit_ratio_below']}) and "
             f"({hits} + {misses} > {t['min_lookup_tokens_per_second']})",
             t["for_"], "warning",
             f"PromptCache {cache}: hit ratio below {t['hit_ratio_below']}",
             f"Only {{{{ $value | humanizePercentage }}}} of the prompt tokens looked up in {cache} over {win} were "
             "found cached. Prefills recompute what the cache should have served."),
        rule("PromptCacheEvictionStorm",
             f"sum by (namespace, service, pod) (rate(promptcache_evictions_total{{{s},reason=\"capacity\"}}[5m]))"
             f" > {t['evictions_per_second_above']}",
             t["for_"], "warning",
             f"PromptCache {pod}: capacity-eviction storm",
             f"{{{{ $value | humanize }}}} entries/s are evicted for room on {pod} (threshold "
             f"{t['evictions_per_second_above']}/s): the working set does not fit the budget and the cache churns."),
        rule("PromptCacheMemoryNearLimit",
             f"max by (namespace, service, pod, tier) (promptcache_committed_bytes{{{s},tier!=\"disk\"}} / "
             f"(promptcache_budget_bytes{{{s},tier!=\"disk\"}} > 0)) > {t['memory_utilization_above']}",
             t["for_"], "warning",
             f"PromptCache {pod}: memory near its budget",
             f"The {{{{ $labels.tier }}}} tier of {pod} has committed {{{{ $value | humanizePercentage }}}} of "
             "its budget: Puts wait for or trigger evictions."),
        rule("PromptCacheContainerMemoryNearLimit",
             # cAdvisor's working set against the limit kube-state-metrics reports, for PromptCache pods only.
             f"(max by (namespace, pod) (container_memory_working_set_bytes{{container=\"sidecar\"}}) / "
             f"max by (namespace, pod) (kube_pod_container_resource_limits{{container=\"sidecar\",resource=\"memory\"}})"
             f" > {t['container_memory_above']}) and on (namespace, pod) "
             f"count by (namespace, pod) (promptcache_budget_bytes{{{s}}})",
             "5m", "critical",
             f"PromptCache {pod}: sidecar memory near its container limit",
             f"The sidecar container of {pod} uses {{{{ $value | humanizePercentage }}}} of its memory limit: an OOM "
             "kill would throw its whole cache away."),
        rule("PromptCacheDiskTierNearlyFull",
             f"max by (namespace, service, pod) (promptcache_committed_bytes{{{s},tier=\"disk\"}} / "
             f"(promptcache_budget_bytes{{{s},tier=\"disk\"}} > 0)) > {t['disk_utilization_above']}",
             t["for_"], "warning",
             f"PromptCache {pod}: disk tier nearly full",
             f"The disk tier of {pod} holds {{{{ $value | humanizePercentage }}}} of its byte budget."),
        rule("PromptCacheSidecarDown",
             # Only targets that were PromptCache sidecars within the last hour (their budget series existed).
             f"(up{{{s}}} == 0) and on (namespace, pod) "
             f"count by (namespace, pod) (max_over_time(promptcache_budget_bytes{{{s}}}[1h]))",
             "5m", "critical",
             f"PromptCache {pod}: sidecar down",
             f"Prometheus cannot scrape the cache sidecar {pod}: inference pods on its node run without a cache "
             "(or it is restarting and has lost its memory tier)."),
        rule("PromptCacheSidecarAbsent",
             f"count by ({by}) (max_over_time(promptcache_budget_bytes{{{s}}}[1h])) unless on ({by}) "
             f"count by ({by}) (promptcache_budget_bytes{{{s}}})",
             "5m", "critical",
             f"PromptCache {cache}: no sidecar reports metrics",
             f"No sidecar of {cache} has reported metrics for 5 minutes although some did within the last hour: "
             "the DaemonSet has no running pods, or nothing scrapes them."),
        rule("PromptCacheErrorRateHigh",
             f"sum by ({by}) (rate(promptcache_requests_total{{{s},code=~\"{SERVER_ERROR_CODES}\"}}[5m])) / "
             f"sum by ({by}) (rate(promptcache_requests_total{{{s}}}[5m])) > {t['error_ratio_above']}",
             t["for_"], "warning",
             f"PromptCache {cache}: elevated server error rate",
             f"{{{{ $value | humanizePercentage }}}} of the gRPC calls to {cache} failed with a server-side code "
             f"({SERVER_ERROR_CODES.replace('|', ', ')})."),
        rule("PromptCacheChecksumFailures",
             f"sum by (namespace, service, pod, tier) (increase(promptcache_checksum_failures_total{{{s}}}[15m]))"
             " > 0",
             "0m", "warning",
             f"PromptCache {pod}: chunks failed checksum verification",
             f"{{{{ $value | humanize }}}} chunks in the {{{{ $labels.tier }}}} tier of {pod} failed verification "
             "in 15 minutes (dropped, never served): memory or disk corruption."),
        rule("PromptCacheGCPausesLong",
             "histogram_quantile(0.9, sum by (namespace, service, pod, le) "
             f"(rate(promptcache_gc_pause_seconds_bucket{{{s},generation=\"2\"}}[30m]))) > {GC_PAUSE_SECONDS_ABOVE}",
             "15m", "warning",
             f"PromptCache {pod}: long garbage-collection pauses",
             f"A tenth of the full garbage collections of {pod} over 30 minutes stopped the sidecar for more than "
             "{{ $value | humanizeDuration }}: every call waits meanwhile. It holds many small chunks."),
    ]
    assert tuple(r["alert"] for r in out) == ALERTS
    return out


def thresholds_from_spec(alerts_spec: Any) -> Thresholds:
    """From a model.Alerts (spec.alerts)."""
    return Thresholds(hit_ratio_below=alerts_spec.hitRatioBelow,
                      memory_utilization_above=alerts_spec.memoryUtilizationAbove,
                      evictions_per_second_above=float(alerts_spec.evictionsPerSecondAbove),
                      for_=alerts_spec.for_)


def monitoring_labels_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """Labels of the ServiceMonitors and PrometheusRules the operator creates:
    PROMPTCACHE_OPERATOR_MONITORING_LABELS="release=kube-prometheus-stack,team=ml" (empty string: none)."""
    raw = env.get("PROMPTCACHE_OPERATOR_MONITORING_LABELS")
    if raw is None:
        return dict(DEFAULT_MONITORING_LABELS)
    return dict(kv.split("=", 1) for kv in raw.split(",") if "=" in kv)


# --- the chart's template ---------------------------------------------------------------------------------------
HELM_VALUES = ".Values.cacheAlerts"
HELM_THRESHOLDS = {"hit_ratio_below": "hitRatioBelow", "memory_utilization_above": "memoryUtilizationAbove",
                   "evictions_per_second_above": "evictionsPerSecondAbove", "for_": "for",
                   "disk_utilization_above": "diskUtilizationAbove", "error_ratio_above": "errorRatioAbove",
                   "container_memory_above": "containerMemoryAbove",
                   "min_lookup_tokens_per_second": "minLookupTokensPerSecond"}
_PROM_TEMPLATE = re.compile(r"\{\{[^}]*\}\}")


def helm_template() -> str:
    """templates/cache-alerts.yaml: the same rules with the thresholds and selector as chart values."""
    sentinel = {k: f"@@{v}@@" for k, v in HELM_THRESHOLDS.items()}
    doc = rules("@@selector@@", sentinel, "@@runbookBaseUrl@@")
    text = yaml.safe_dump(doc, sort_keys=False, width=10000, default_style=None)
    # Prometheus' own templates ({{ $labels.x }}) must reach the output verbatim: Helm raw strings.
    text = _PROM_TEMPLATE.sub(lambda m: "{{`" + m.group(0) + "`}}", text)
    text = text.replace("{@@selector@@", '{{ "{" }}@@selector@@')  # "{{{" would open a Helm action
    text = re.sub(r"@@(\w+)@@", lambda m: "{{ " + HELM_VALUES + "." + m.group(1) + " }}", text)
    text = text.replace("{{ .Values.cacheAlerts.for }}", '{{ index .Values.cacheAlerts "for" }}')
    rules_yaml = "\n".join("      " + line if line else line for line in text.rstrip("\n").split("\n"))
    return (
        "{{- /* GENERATED by `python -m promptcache.operator.alerts --helm` from operator/promptcache/operator/"
        "alerts.py; do not edit. */ -}}\n"
        "{{- if .Values.cacheAlerts.enabled }}\n"
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        "  name: {{ include \"promptcache-operator.fullname\" . }}-caches\n"
        "  namespace: {{ .Release.Namespace }}\n"
        "  labels:\n"
        "    {{- include \"promptcache-operator.labels\" . | nindent 4 }}\n"
        "    {{- with merge (dict) (.Values.cacheAlerts.labels | default dict) (.Values.monitoring.labels | default dict) }}\n"
        "    {{- toYaml . | nindent 4 }}\n"
        "    {{- end }}\n"
        "spec:\n"
        "  groups:\n"
        "    - name: promptcache-caches\n"
        "      rules:\n"
        f"{rules_yaml}\n"
        "{{- end }}\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--helm", action="store_true", help="print the chart's templates/cache-alerts.yaml")
    ap.add_argument("--selector", default=CHART_SELECTOR, help="PromQL label matchers (rule file mode)")
    args = ap.parse_args(argv)
    if args.helm:
        sys.stdout.write(helm_template())
    else:
        sys.stdout.write(yaml.safe_dump({"groups": [{"name": "promptcache", "rules": rules(args.selector)}]},
                                        sort_keys=False, width=10000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
