"""The `promptcache serve` command as users run it: flags, environment, help, errors, signals."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import typing

import pytest

from support import REPO, SidecarProcess
from promptcache.client import PromptCacheClient
from promptcache.contract.keys import QUANT_MODES
from promptcache.sidecar import config


def parse(argv, env=None):
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return config.settings_from_args(p.parse_args(argv), environ=env or {})


def test_defaults_are_the_embedded_ones():
    assert parse([]) == config.Settings()
    assert config.Settings().grpc_address.startswith("127.0.0.1:")  # loopback unless told otherwise


# A valid value for the settings whose generic sample ("7", "1.5", "json") their validation would refuse.
VALID_SAMPLES = {"memory_bytes": "8192", "max_chunk_bytes": "8192", "disk_bytes": "8192", "frame_bytes": "8192",
                 "disk_index_bytes": "2097152",
                 "log_level": "debug", "device": "cpu", "eviction_policy": "lru", "chunk_tokens": "64",
                 "bulk_address": "unix:/run/promptcache/bulk.sock", "quantization": "k8v4", "tenancy": "shared",
                 "bulk_zero_copy": "off", "bulk_socket_mode": "0660", "max_put_reserved_fraction": "0.25",
                 "max_pinned_fraction": "0.25", "shm_dir": "/tmp",
                 "warmup_snapshot": __file__, "pinned_prefixes_file": __file__,  # (existing files)
                 "mrc_sample_rate": "0.5", "mrc_sizes": "1Mi,2Mi",
                 "access_log_sample_rate": "0.5", "access_log_max_bytes": "8192",
                 "cluster_master": "10.0.0.1:50051", "cluster_protocol": "rdma",
                 "kv_events_address": "tcp://127.0.0.1:5557", "grpc_address": "unix:/run/promptcache/grpc.sock"}
# Settings that are valid only together with others (Settings.validate checks them as a whole).
COMPANIONS = {"tls_cert_file": ["--tls-key-file", "key.pem"], "tls_key_file": ["--tls-cert-file", "cert.pem"],
              "tls_client_ca_file": ["--tls-cert-file", "cert.pem", "--tls-key-file", "key.pem", "--token-file",
                                     "tokens"],
              "bulk_socket_mode": ["--bulk-address", "unix:/run/promptcache/bulk.sock"]}


def test_every_setting_is_a_flag_and_an_environment_variable():
    hints = typing.get_type_hints(config.Settings)
    for f in dataclasses.fields(config.Settings):
        typ = hints[f.name]
        if typ is bool:
            flag_value, env_value, expected = [], "true", True
            argv = ["--" + f.name.replace("_", "-")]
        else:
            if typing.get_origin(typ) is typing.Literal:  # the last word: never the default
                value, typ = typing.get_args(typ)[-1], str
            else:
                value = {int: "7", float: "1.5", str: "json"}[typ]
            value = VALID_SAMPLES.get(f.name, value)
            argv, env_value = ["--" + f.name.replace("_", "-"), value], value
            expected = typ(value)
        companions = COMPANIONS.get(f.name, [])
        from_flag = getattr(parse(argv + companions), f.name)
        from_env = getattr(parse(companions, {config.env_name(f.name): env_value}), f.name)
        assert from_flag == from_env == expected, f.name


def test_flag_beats_environment_and_quantities_parse():
    s = parse(["--memory-bytes", "2Gi"], {"PROMPTCACHE_MEMORY_BYTES": "1Gi", "PROMPTCACHE_TTL_SECONDS": "60"})
    assert s.memory_bytes == 2 << 30 and s.ttl_seconds == 60


@pytest.mark.parametrize("argv,env,fragment", [
    (["--memory-bytes", "0"], {}, "--memory-bytes must be positive"),
    (["--memory-bytes", "lots"], {}, "--memory-bytes='lots': 'lots' is not a Kubernetes quantity"),
    ([], {"PROMPTCACHE_MEMORY_BYTES": "-5"}, "PROMPTCACHE_MEMORY_BYTES='-5'"),
    (["--chunk-tokens", "100"], {}, "--chunk-tokens must be a positive power of two, got 100"),
    (["--chunk-tokens", "65536", "--max-chunk-bytes", "64Ki"], {}, "no Put could ever store one"),
    (["--tls-cert-file", "cert.pem"], {}, "--tls-cert-file and --tls-key-file go together"),
    (["--tenancy", "isolated"], {}, "--tenancy isolated needs authentication"),
    (["--bulk-zero-copy", "on"], {}, "--bulk-zero-copy on needs a unix-socket --bulk-address"),
    (["--ttl-seconds", "0"], {}, "--ttl-seconds must be positive"),
    (["--ttl-seconds", "-5"], {}, "--ttl-seconds must be positive"),
    (["--ttl-seconds", "nan"], {}, "--ttl-seconds must be a finite number, got nan"),
    (["--ttl-seconds", "inf"], {}, "--ttl-seconds must be a finite number, got inf"),
    ([], {"PROMPTCACHE_TTL_SECONDS": "-inf"}, "--ttl-seconds must be a finite number, got -inf"),
    (["--stream-idle-seconds", "nan"], {}, "--stream-idle-seconds must be a finite number"),
    (["--token-reload-seconds", "inf"], {}, "--token-reload-seconds must be a finite number"),
    (["--shm-dir", "/nonexistent/promptcache-shm"], {}, "--shm-dir /nonexistent/promptcache-shm is not an existing folder"),
    (["--shm-dir", "/etc/passwd"], {}, "--shm-dir /etc/passwd is not an existing folder"),
    (["--eviction-policy", "random"], {}, "--eviction-policy must be one of"),
    (["--device", "tpu"], {}, "--device must be auto, cpu, cuda or cuda:N"),
    ([], {"PROMPTCACHE_ALLOW_INSECURE_REMOTE": "maybe"}, "PROMPTCACHE_ALLOW_INSECURE_REMOTE='maybe'"),
    (["--workers", "x"], {}, "--workers='x'"),
    (["--cluster-master", "master"], {}, "--cluster-master 'master': 'master' is not HOST:PORT"),
    (["--cluster-master", "etcd://10.0.0.1:2379;10.0.0.2"], {}, "'10.0.0.2' is not HOST:PORT"),
    (["--cluster-master", "etcd://"], {}, "'' is not HOST:PORT"),
    (["--cluster-master", "10.0.0.1:99999"], {}, "'10.0.0.1:99999' is not HOST:PORT"),
    (["--cluster-master", "etcd://a:2379,b:2379"], {}, "'a:2379,b:2379' is not HOST:PORT"),  # ';' separates
    (["--cluster-master", "http://master:50051"], {}, "'http://master:50051' is not HOST:PORT"),
    (["--cluster-id", "a/b"], {}, "--cluster-id must be letters, digits"),
    (["--cluster-hot-list-seconds", "-1"], {}, "--cluster-hot-list-seconds must be 0 (off) or a positive number"),
    # beyond what socket timeouts take: every bulk connection failed at run time
    (["--stream-idle-seconds", "1e10"], {}, "--stream-idle-seconds 1e+10 is more than 1e+09 seconds"),
    ([], {"PROMPTCACHE_WARMUP_SECONDS": "1e18"}, "--warmup-seconds 1e+18 is more than 1e+09 seconds"),
    ([], {"PROMPTCACHE_CLUSTER_HOT_LIST_SECONDS": "nan"}, "--cluster-hot-list-seconds must be a finite number"),
    # gRPC would listen on 99999 % 65536 = 34463, on 443 for an empty port, on 65531 for -5
    (["--grpc-address", "127.0.0.1:99999"], {}, "--grpc-address '127.0.0.1:99999': the port '99999' is not a number"),
    (["--grpc-address", "127.0.0.1:"], {}, "the port '' is not a number within 0..65535"),
    (["--grpc-address", "127.0.0.1:-5"], {}, "the port '-5' is not a number"),
    (["--grpc-address", "127.0.0.1:5x"], {}, "the port '5x' is not a number"),
    (["--grpc-address", "unix:"], {}, "--grpc-address 'unix:': unix: needs a path"),
    (["--grpc-address", "localhost"], {}, "it is neither HOST:PORT nor unix:PATH"),
    (["--grpc-address", "::1:50051"], {}, "an IPv6 host goes in brackets, as in [::1]:50051"),
    ([], {"PROMPTCACHE_GRPC_ADDRESS": "127.0.0.1:\u0665"}, "is not a number"),
    (["--kv-events-address", "tcp://127.0.0.1:99999"], {}, "the port '99999' is not a number"),
    (["--bulk-address", "unix:/run/pc/bulk.sock,127.0.0.1:\u0665"], {}, "is not HOST:PORT or unix:/PATH"),
    (["--cluster-master", "10.0.0.1:\u0665"], {}, "is not HOST:PORT"),
    (["--kv-events-address", "tcp://:5557"], {}, "tcp:// needs HOST:PORT"),
    (["--kv-events-address", "ipc://"], {}, "ipc:// needs a path"),
    (["--kv-events-address", "tcp://127.0.0.1:5557 "], {}, "it contains white space"),
    (["--kv-events-address", "udp://127.0.0.1:5557"], {}, "it is neither tcp://HOST:PORT nor ipc://PATH"),
])
def test_bad_settings_name_the_flag_or_variable(argv, env, fragment):
    with pytest.raises(ValueError) as info:
        parse(argv, env)
    assert fragment in str(info.value)


@pytest.mark.parametrize("grpc,events", [("127.0.0.1:0", "tcp://127.0.0.1:*"), ("[::1]:50051", "tcp://*:5557"),
                                         ("0.0.0.0:65535", "tcp://127.0.0.1:0"), ("unix:/run/pc/grpc.sock", "ipc:///x"),
                                         ("unix:///run/pc/grpc.sock", "tcp://[::1]:5557"), ("[::]:50051", "ipc://rel")])
def test_listen_addresses_gRPC_and_ZMQ_take(grpc, events):
    settings = parse(["--grpc-address", grpc, "--kv-events-address", events, "--allow-insecure-remote"])
    assert (settings.grpc_address, settings.kv_events_address) == (grpc, events)


@pytest.mark.parametrize("address", ["10.0.0.1:50051", "master.ns.svc:50051", "etcd://127.0.0.1:2379",
                                     "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379;etcd-2.etcd:2379"])
def test_a_master_or_the_etcd_of_an_ha_master_set_is_a_cluster_master(address):
    assert parse(["--cluster-master", address]).cluster_master == address


def test_word_settings_take_the_words_of_their_literal_and_name_them_when_wrong():
    hints = typing.get_type_hints(config.Settings)
    words = {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(config.Settings)
             if typing.get_origin(hints[f.name]) is typing.Literal}
    assert set(words) == {"quantization", "tenancy", "bulk_zero_copy", "log_level", "log_format", "cluster_protocol"}
    for name, choices in words.items():
        flag = "--" + name.replace("_", "-")
        assert getattr(config.Settings(), name) in choices, name
        for word in choices:
            # words valid only with another setting (Settings.validate checks them together)
            extra = {("tenancy", "isolated"): ["--token-file", "tokens"],
                     ("bulk_zero_copy", "on"): ["--bulk-address", "unix:/run/promptcache/bulk.sock"]}
            assert getattr(parse([flag, word, *extra.get((name, word), [])]), name) == word
        with pytest.raises(ValueError) as info:
            parse([flag, "bogus"])
        assert str(info.value) == f"{flag} must be {config.one_of(choices)}, got 'bogus'"
    # --quantization accepts "any" and exactly the modes clients key chunks by
    assert words["quantization"] == ("any",) + QUANT_MODES


def run_cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "promptcache.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_explains_every_flag_and_its_variable():
    out = run_cli("serve", "--help").stdout
    for f in dataclasses.fields(config.Settings):
        assert "--" + f.name.replace("_", "-") in out and config.env_name(f.name) in out


def test_bad_flag_exits_nonzero_with_a_message():
    result = run_cli("serve", "--memory-bytes", "0", "--metrics-port", "0")
    assert result.returncode == 2 and "--memory-bytes must be positive" in result.stdout + result.stderr


@pytest.mark.slow  # a process; test_auth.py checks the same refusal in process
def test_plaintext_on_a_public_address_needs_an_explicit_flag():
    result = run_cli("serve", "--grpc-address", "0.0.0.0:0", "--metrics-port", "0")
    assert result.returncode == 2 and "--allow-insecure-remote" in result.stdout + result.stderr


def test_serve_logs_json_and_stops_cleanly_on_sigterm(tmp_path):
    proc = SidecarProcess("--memory-bytes", "16Mi", "--log-format", "json")
    try:
        proc.wait_ready()
        with PromptCacheClient(proc.address) as c:
            assert c.stats().device == "cpu"
        proc.proc.send_signal(signal.SIGTERM)
        out, _ = proc.proc.communicate(timeout=20)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0
    import json

    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    serving = next(r for r in records if r["msg"] == "promptcache sidecar serving")
    assert serving["grpc"] == proc.address and serving["metrics"].endswith(f":{proc.metrics_port}/metrics")
    assert any(r["msg"] == "shutting down" for r in records)


def test_make_run_target_uses_embedded_defaults():
    """`make run` is the README's first command: check it asks for nothing but embedded defaults."""
    out = subprocess.run(["make", "-n", "run"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert "promptcache serve" in out and "127.0.0.1:50051" in out


@pytest.mark.parametrize("flag, value, named", [
    ("--disk-index-bytes", "4096", "at least 1Mi"),
    ("--disk-index-bytes", "-1", "--disk-index-bytes"),
    ("--kv-events-id", "node@llama", "no '@'"),
    ("--kv-events-id", "node\nx", "--kv-events-id"),
])
def test_values_that_cannot_work_are_refused_naming_the_flag(flag, value, named):
    """A disk index bound of a few KiB holds a few records and refuses every other demotion; an id with '@' makes the
    node topic kv@node@llama@MODEL, which subscribers of model `llama` on node `node` receive too."""
    with pytest.raises(ValueError, match=re.escape(named)):
        parse([flag, value]).validate()
    assert parse(["--disk-index-bytes", "1Mi", "--kv-events-id", "gpu-node-7.example"]).validate().kv_events_id == "gpu-node-7.example"
