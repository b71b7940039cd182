"""The configuration table and metrics list of docs/configuration.md (linked from the README) are generated from the
code (hack/gen-readme-tables.py): the committed doc is current, the generator notices drift, and what a running sidecar
exposes is all listed."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from support import REPO

SCRIPT = REPO / "hack" / "gen-readme-tables.py"
DOC = REPO / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_readme_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_committed_tables_are_current_and_linked_from_the_readme():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr + "docs/configuration.md is stale: run hack/gen-readme-tables.py"
    assert "(docs/configuration.md)" in (REPO / "README.md").read_text()


def test_check_notices_a_hand_edit_and_regenerating_undoes_it(gen):
    doc = DOC.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `--ttl-seconds` |"))
    edited = doc.replace(row, "| `--ttl-seconds` | `60` | edited by hand |")
    dropped = doc.replace(next(line for line in doc.splitlines()
                               if line.startswith("| `promptcache_demotions_total` |")) + "\n", "")
    for stale in (edited, dropped):
        assert stale != doc and gen.render(stale, gen.blocks()) == doc


def test_every_setting_and_every_word_choice_is_in_the_table(gen):
    import dataclasses

    from promptcache.sidecar import config

    table = gen.settings_block()
    for f in dataclasses.fields(config.Settings):
        assert f"| `--{f.name.replace('_', '-')}` |" in table, f.name
    assert "| `--memory-bytes` | `1Gi` |" in table and "| `--shm-dir` | `(empty)` |" in table


def test_metrics_named_in_the_issue_are_documented(gen):
    names = {m.name for m in gen.declared_metrics()}
    assert {"promptcache_demotions_total", "promptcache_promotions_total",
            "promptcache_calls_cancelled_total"} <= names


def test_a_metric_name_the_generator_cannot_read_is_an_error(gen, tmp_path):
    pkg = tmp_path / "sidecar" / "promptcache" / "sidecar"
    pkg.mkdir(parents=True)
    (tmp_path / "operator" / "promptcache").mkdir(parents=True)
    (pkg / "m.py").write_text('from prometheus_client import Counter\nX = Counter("promptcache_x", "an x")\n')
    assert [(m.name, m.type, m.source) for m in gen.declared_metrics(tmp_path)] == [
        ("promptcache_x_total", "counter", "sidecar/promptcache/sidecar/m.py:2")]
    (pkg / "n.py").write_text('from prometheus_client import Gauge\nkind = "y"\nY = Gauge(f"promptcache_{kind}", "y")\n')
    with pytest.raises(SystemExit, match="n.py:3: a metric name that is not a plain string literal"):
        gen.declared_metrics(tmp_path)


def _exposed(registry) -> dict[str, str]:
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    names = {f.name for f in families}
    # prometheus_client's _created timestamps parse as gauges of their own: they belong to their metric
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in families
            if not (f.name.endswith("_created") and f.name.removesuffix("_created") in names)}


def test_everything_a_running_sidecar_and_the_client_expose_is_documented(gen, sidecar_factory, tmp_path):
    """What the AST scan finds is checked against what is really exposed: a sidecar with the disk tier, the miss-ratio
    curve and the access log on, the client's registry and the operator's."""
    from promptcache.client import metrics as client_metrics  # noqa: F401 - registers the client's metrics
    from prometheus_client import REGISTRY

    documented = {m.name: m.type for m in gen.declared_metrics()}
    sidecar = sidecar_factory(disk_bytes=16 << 20, data_dir=str(tmp_path / "data"), mrc_sample_rate=1.0,
                              access_log_path=str(tmp_path / "access.jsonl"))
    exposed = _exposed(sidecar.metrics.registry)
    exposed.update({k: v for k, v in _exposed(REGISTRY).items() if k.startswith("promptcache_")})
    from promptcache.operator import telemetry

    exposed.update(_exposed(telemetry.REGISTRY))
    assert len(exposed) > 40
    assert {k: v for k, v in exposed.items() if documented.get(k) != v} == {}
