"""The operator's configuration: one object built in main from the command line and the environment; importing the
operator reads and writes no environment and registers nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from promptcache.operator import __main__ as operator_main
import datetime

from promptcache.operator.config import OperatorConfig, login_name, peering_identity


def test_config_from_the_command_line_and_the_environment():
    env = {"PROMPTCACHE_OPERATOR_NAMESPACES": "ml,serving", "PROMPTCACHE_OPERATOR_RESYNC_SECONDS": "5",
           "PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS": "3", "PROMPTCACHE_OPERATOR_WORKERS": "4",
           "PROMPTCACHE_OPERATOR_PROMETHEUS_URL": "http://prometheus:9090",
           "PROMPTCACHE_OPERATOR_MONITORING_LABELS": "release=prom", "PROMPTCACHE_AUTOSCALE_INTERVAL_SECONDS": "8",
           "PROMPTCACHE_OPERATOR_SIDECAR_CREDENTIALS_DIR": "/creds"}
    c = OperatorConfig.from_args(["--standalone", "--resync-seconds", "6", "--liveness", ""], env)
    assert c.namespaces == ("ml", "serving") and c.standalone and c.liveness is None
    assert c.resync_seconds == 6          # the flag wins over PROMPTCACHE_OPERATOR_RESYNC_SECONDS
    assert (c.crd_cache_seconds, c.workers, c.prometheus_url) == (3, 4, "http://prometheus:9090")
    assert c.defaults.monitoring_labels == (("release", "prom"),)
    assert c.autoscale.interval_s == 8 and c.autoscale.credentials_dir == "/creds"
    assert c.observation_max_age_s == 3   # half the shorter timer period
    assert OperatorConfig.from_args(["-n", "a"], env).namespaces == ("a",)
    assert OperatorConfig.from_args([], {}) == OperatorConfig()


def _uid_without_passwd_entry() -> int:
    import pwd
    uid = 65532
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def test_peering_identity_needs_no_passwd_entry():
    """kopf's own identity (getpass.getuser()) raises KeyError for a uid without a passwd entry: the chart's 65532
    in the operator image crash-looped. The operator names itself: the pod (POD_NAME, kopf's POD_ID), else
    user@host/time/random with uid<N> where the uid has no name."""
    uid = _uid_without_passwd_entry()
    now = datetime.datetime(2026, 12, 2, 6, 30, 0, tzinfo=datetime.timezone.utc)
    assert login_name({}, uid) is None
    assert peering_identity({}, uid, "node-a", now, "xyz") == f"uid{uid}@node-a/20261202063000/xyz"
    assert peering_identity({"POD_NAME": "op-7d9f-abc"}, uid, "h") == "op-7d9f-abc"
    assert peering_identity({"POD_ID": "op-1"}, uid, "h") == "op-1"
    assert peering_identity({"USER": "nonroot"}, uid, "h", now, "a").startswith("nonroot@h/")
    assert login_name({}, 0) == "root"
    # Two replicas started in the same second on one host still differ (the random part).
    assert len({peering_identity({}, uid, "h", now) for _ in range(20)}) > 1
    c = OperatorConfig.from_args([], {"POD_NAME": "promptcache-operator-5c-x"})
    assert c.identity == "promptcache-operator-5c-x"


@pytest.mark.parametrize("name, value", [("PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE", "Sometimes"),
                                         ("PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS", "ten"),
                                         ("PROMPTCACHE_OPERATOR_CRD_CACHE_SECONDS", "nan"),
                                         ("PROMPTCACHE_OPERATOR_METRICS_PORT", "x"),
                                         ("PROMPTCACHE_OPERATOR_PRIORITY", "1.5"),
                                         ("PROMPTCACHE_OPERATOR_RESYNC_SECONDS", "soon"),
                                         ("PROMPTCACHE_OPERATOR_WORKERS", "0"),
                                         ("PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS", "GPU_Cache")])
def test_a_bad_environment_variable_exits_2_naming_it(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    assert operator_main.main(["--standalone"]) == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--metrics-port", "99999"], "--metrics-port must be in 0..65535 (0: off), got 99999"),
    (["--resync-seconds", "0"], "--resync-seconds must be a number of seconds above 0"),
    (["--resync-seconds", "nan"], "--resync-seconds must be a number of seconds above 0, got nan"),
    (["--namespace", "Inference_Pods"], "--namespace 'Inference_Pods' is not a namespace name"),
    (["--namespace", "a" * 64], "is not a namespace name"),
    (["--peering", ""], "--peering '' is not an object name"),
])
def test_a_bad_option_exits_2_naming_it(capsys, argv, words):
    assert operator_main.main(argv) == 2
    assert words in capsys.readouterr().err


def test_no_kubernetes_configuration_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path):
    (tmp_path / "kubeconfig").write_text("not: [a kubeconfig\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert operator_main.main(["--standalone", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("promptcache operator: no Kubernetes API to talk to: ") and "Traceback" not in err


def test_importing_the_operator_reads_and_writes_no_environment():
    """With a value the configuration refuses in the environment, every module still imports (only main reads the
    environment; the handlers module used to build its settings at import and fail there) and none changes it."""
    code = "\n".join([
        "import os",
        "before = dict(os.environ)",
        "import promptcache.operator.handlers, promptcache.operator.reconcile, promptcache.operator.autoscale",
        "import promptcache.operator.fleet, promptcache.operator.config, promptcache.operator.__main__",
        "assert dict(os.environ) == before",
        "print('imported')",
    ])
    env = {**os.environ, "PROMPTCACHE_AUTOSCALE_VPA_UPDATE_MODE": "Sometimes"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr


def test_namespaces_from_the_environment_are_stripped_and_named_by_their_source(capsys, monkeypatch):
    env = {"PROMPTCACHE_OPERATOR_NAMESPACES": "team-a, team-b ,"}
    assert OperatorConfig.from_args(["--standalone"], env).namespaces == ("team-a", "team-b")
    monkeypatch.setenv("PROMPTCACHE_OPERATOR_NAMESPACES", "team-a,Team_B")
    assert operator_main.main(["--standalone"]) == 2
    assert "PROMPTCACHE_OPERATOR_NAMESPACES 'Team_B' is not a namespace name" in capsys.readouterr().err
    assert operator_main.main(["--standalone", "-n", "Team_B"]) == 2  # the flag wins over the variable
    assert "--namespace 'Team_B' is not a namespace name" in capsys.readouterr().err


@pytest.mark.parametrize("pattern", ["team-*", "team-?", "*", "!kube-*", "team-*,!*-pr-*, *pr-123", "ml"])
def test_kopf_namespace_patterns_are_accepted(pattern):
    """kopf matches --namespace values as globs ('*', '?'), '!' negations and comma-separated lists
    (kopf match_namespace); they were accepted before namespace names were checked, and are again."""
    from kopf._cogs.structs.references import match_namespace  # what kopf does with them

    from promptcache.operator.config import literal_namespaces

    c = OperatorConfig.from_args(["--standalone", "-n", pattern], {})
    assert c.namespaces == (pattern,)
    assert literal_namespaces(c.namespaces) == (["ml"] if pattern == "ml" else [])
    assert match_namespace("team-a", pattern) == (pattern in ("team-*", "team-?", "*", "!kube-*",
                                                                     "team-*,!*-pr-*, *pr-123"))


@pytest.mark.parametrize("pattern", ["Team-*", "team_*", "!", "team-*,", "-team", "a" * 64 + "*"])
def test_bad_namespace_patterns_are_refused(pattern):
    with pytest.raises(ValueError, match="is not a namespace name .* or a kopf namespace pattern"):
        OperatorConfig.from_args(["--standalone", f"--namespace={pattern}"], {})


@pytest.mark.parametrize("value, words", [
    ("GPU_Cache", "is not a PriorityClass name"),
    ("gpu cache", "is not a PriorityClass name"),
    ("-gpu-cache", "is not a PriorityClass name"),
    ("gpu-cache.", "is not a PriorityClass name"),
    ("a" * 254, "is not a PriorityClass name"),
    ("system-node-critical", "system-* PriorityClass that PROMPTCACHE_OPERATOR_SYSTEM_PRIORITY_CLASSES does not allow"),
])
def test_default_priority_class_is_validated_at_start(monkeypatch, capsys, value, words):
    """PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS (the chart's priorityClass.name) is the PriorityClass of every
    PromptCache that names none: a name no PriorityClass can have stops the operator at start, naming the variable,
    instead of every such cache's pods being refused."""
    env = {"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": value}
    with pytest.raises(ValueError, match=r"^PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS=.*" + re.escape(words)):
        OperatorConfig.from_args(["--standalone"], env)
    monkeypatch.setenv("PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS", value)
    assert operator_main.main(["--standalone"]) == 2
    err = capsys.readouterr().err
    assert "PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS" in err and words in err and "Traceback" not in err


def test_default_priority_class_from_the_environment():
    get = lambda env: OperatorConfig.from_args(["--standalone"], env).defaults.priority_class  # noqa: E731
    assert get({}) == "promptcache-node-cache"
    assert get({"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": ""}) == "promptcache-node-cache"  # empty: unset
    assert get({"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": " gpu-cache "}) == "gpu-cache"
    assert get({"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": "a" * 253}) == "a" * 253
    assert get({"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": "ml.gpu-cache"}) == "ml.gpu-cache"
    # A system-* one only where the operator allows PromptCaches to name it.
    assert get({"PROMPTCACHE_OPERATOR_DEFAULT_PRIORITY_CLASS": "system-node-critical",
                "PROMPTCACHE_OPERATOR_SYSTEM_PRIORITY_CLASSES": "system-node-critical"}) == "system-node-critical"
