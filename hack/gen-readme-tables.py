#!/usr/bin/env python3
"""Write the generated blocks of docs/configuration.md from the code, the one source of truth:

* `settings`: the sidecar's configuration table, from `Settings` and `HELP` in promptcache.sidecar.config;
* `metrics`: every Prometheus metric the sidecar, the client and the operator declare, found by reading their source
  (each `Counter(`, `Gauge(`, `Histogram(`, `Summary(` and `*MetricFamily(` call whose name is a `promptcache_`
  literal): name as scraped, type, labels and its help text.

Each block sits between `<!-- BEGIN GENERATED <block> ... -->` and `<!-- END GENERATED <block> -->` in
docs/configuration.md (the README links it; the script keeps the name it had when they were in the README); the text
around them is hand-written. tests/test_readme_tables.py runs `--check` (and compares the metrics with what a running
sidecar exposes).

Usage: .venv/bin/python hack/gen-readme-tables.py [--check]
"""
from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"

# Where metrics are declared, and the heading each package's metrics go under (first match wins).
METRIC_SOURCES = (
    ("sidecar/promptcache/sidecar", "Sidecar (`promptcache serve`, its `/metrics`)"),
    ("sidecar/promptcache/client", "Client, in the inference pod's registry (transformers integration and vLLM "
                                   "connector)"),
    ("operator/promptcache/operator", "Operator (its own `/metrics`; only the active replica reports a cache)"),
)
SEARCHED = ("sidecar/promptcache", "operator/promptcache")  # a metric anywhere else here is an error
CONSTRUCTORS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
                "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
                "HistogramMetricFamily": "histogram", "SummaryMetricFamily": "summary"}


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str  # as scraped: counters end in _total
    type: str
    labels: tuple[str, ...]
    help: str
    source: str  # path:line of the declaration


def _literal(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _words(node) -> tuple[str, ...] | None:
    if isinstance(node, (ast.List, ast.Tuple)) and all(_literal(e) is not None for e in node.elts):
        return tuple(e.value for e in node.elts)
    return None


def declared_metrics(root: Path = ROOT) -> list[Metric]:
    found: dict[str, Metric] = {}
    for top in SEARCHED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func not in CONSTRUCTORS or not node.args:
                    continue
                where = f"{rel}:{node.lineno}"
                name = _literal(node.args[0])
                if name is None:
                    if "promptcache_" in ast.unparse(node.args[0]):
                        raise SystemExit(f"{where}: a metric name that is not a plain string literal; this "
                                         "generator cannot document it")
                    continue
                if not name.startswith("promptcache_"):
                    continue
                kwargs = {k.arg: k.value for k in node.keywords}
                doc = _literal(node.args[1]) if len(node.args) > 1 else _literal(kwargs.get("documentation"))
                family = func.endswith("MetricFamily")
                label_node = kwargs.get("labels" if family else "labelnames")
                if label_node is None and not family and len(node.args) > 2:
                    label_node = node.args[2]
                labels = () if label_node is None else _words(label_node)
                if not doc or labels is None:
                    raise SystemExit(f"{where}: metric {name} needs a literal help text and literal label names")
                kind = CONSTRUCTORS[func]
                if kind == "counter" and not name.endswith("_total"):
                    name += "_total"  # prometheus_client exposes counters with the suffix
                metric = Metric(name, kind, labels, " ".join(doc.split()), where)
                if name in found and dataclasses.replace(found[name], source="") != dataclasses.replace(metric,
                                                                                                        source=""):
                    raise SystemExit(f"{where}: {name} is also declared, differently, at {found[name].source}")
                found.setdefault(name, metric)
    return sorted(found.values(), key=lambda m: m.name)


def _group(metric: Metric) -> str:
    for prefix, heading in METRIC_SOURCES:
        if metric.source.startswith(prefix + "/"):
            return heading
    raise SystemExit(f"{metric.source}: metric {metric.name} is declared outside {[p for p, _ in METRIC_SOURCES]}; "
                     "add its package to METRIC_SOURCES in hack/gen-readme-tables.py")


def metrics_block(metrics: list[Metric]) -> str:
    parts = []
    for _, heading in METRIC_SOURCES:
        rows = [m for m in metrics if _group(m) == heading]
        if not rows:
            continue
        parts.append(f"{heading}:\n\n| metric | type | labels | meaning |\n|---|---|---|---|")
        parts[-1] += "".join(f"\n| `{m.name}` | {m.type} | {', '.join(f'`{x}`' for x in m.labels)} | "
                             f"{_cell(m.help)} |" for m in rows)
    return "\n\n".join(parts)


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, docs/*.md named in the text linked (from docs/, where the table is)."""
    text = text.replace("|", "\\|")
    return re.sub(r"(?<!\]\()(?<![\[/\w])docs/([\w.-]+\.md)", r"[docs/\1](\1)", text)


def quantity(n: int) -> str:
    """A byte count as the Kubernetes quantity a user would write (1Gi, 256Mi), exact or as a plain integer."""
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def settings_block() -> str:
    sys.path[:0] = [str(ROOT / "sidecar")]  # a source checkout without the package installed works too
    from promptcache.sidecar import config

    rows = ["| flag (env `PROMPTCACHE_<FLAG>`) | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(config.Settings):
        default = f.default
        if f.name in config._BYTE_FIELDS:
            shown = quantity(default)
        elif default == "":
            shown = "(empty)"
        else:
            shown = str(default)
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{shown}` | {_cell(config.HELP[f.name])} |")
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    return {"settings": settings_block(), "metrics": metrics_block(declared_metrics())}


def render(doc: str, generated: dict[str, str]) -> str:
    for name, body in generated.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED {name}\b[^\n]*-->\n).*?(\n<!-- END GENERATED {name} -->)",
                             re.S)
        if not pattern.search(doc):
            raise SystemExit(f"docs/configuration.md has no <!-- BEGIN GENERATED {name} ... --> ... "
                             f"<!-- END GENERATED {name} --> block")
        doc = pattern.sub(lambda m: m.group(1) + "\n" + body + "\n" + m.group(2), doc)
    return doc


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    text = render(current, blocks())
    if "--check" in argv:
        if text != current:
            print("docs/configuration.md's generated tables are stale: run "
                  ".venv/bin/python hack/gen-readme-tables.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
