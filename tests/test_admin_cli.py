"""`promptcache stats|lookup|purge|resize|top` and `--version` against a real sidecar (gRPC on loopback), with and
without bearer tokens; the formatting functions on their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from promptcache import admin, cli
from promptcache.client import PromptCacheClient
from support import CHUNK, SMALL, make_kv
from test_auth import write_secret_dir

MODEL_ARGS = ["--model", SMALL.model_id, "--revision", SMALL.revision, "--kv-dtype", SMALL.kv_dtype,
              "--layers", str(SMALL.num_layers), "--kv-heads", str(SMALL.num_kv_heads),
              "--head-dim", str(SMALL.head_dim)]
TOKENS = list(range(1000, 1000 + 3 * CHUNK + 5))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def fill(address: str, **client_kwargs) -> None:
    with PromptCacheClient(address, timeout=10, **client_kwargs) as c:
        c.put(SMALL, TOKENS, make_kv(SMALL, len(TOKENS)))


def test_version_is_the_installed_distribution():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "promptcache.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"promptcache {version('promptcache')}"


def test_stats_lookup_purge_resize_against_a_sidecar(sidecar, capsys):
    fill(sidecar.address)
    code, out, _ = run_cli(capsys, "lookup", "--address", sidecar.address, *MODEL_ARGS,
                           "--tokens", ",".join(map(str, TOKENS)), "-o", "json")
    assert code == 0
    got = json.loads(out)
    assert got["cached_tokens"] == 3 * CHUNK and [c["tier"] for c in got["chunks"]] == ["device"] * 3

    code, out, _ = run_cli(capsys, "stats", "--address", sidecar.address, "-o", "json")
    s = json.loads(out)
    assert code == 0 and s["hit_tokens"] == 3 * CHUNK and s["missed_tokens"] == len(TOKENS) - 3 * CHUNK
    (device,) = s["tiers"]
    assert device["tier"] == "device" and device["entries"] == 3 and device["bytes_budget"] == 8 << 20
    code, out, _ = run_cli(capsys, "stats", "--address", sidecar.address)
    assert code == 0 and "device" in out and "3 entries" in out.replace("        ", " ").replace("  ", " ")

    code, out, _ = run_cli(capsys, "resize", "--address", sidecar.address, "4Mi", "-o", "json")
    assert code == 0 and json.loads(out)["memory_bytes"] == 4 << 20
    assert sidecar.tier.usage()["budget"] == 4 << 20

    code, out, _ = run_cli(capsys, "purge", "--address", sidecar.address, *MODEL_ARGS)
    assert code == 0 and out.startswith("deleted 3 chunks")
    assert sidecar.tier.usage()["entries"] == 0


def test_top_prints_interval_rates(sidecar, capsys):
    fill(sidecar.address)
    code, out, _ = run_cli(capsys, "top", "--address", sidecar.address, "--interval", "0.05", "--iterations", "2")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0] == admin.TOP_HEADER and len(lines) == 3


def test_tokens_are_required_when_the_sidecar_authenticates(sidecar_factory, tmp_path, capsys, monkeypatch):
    tokens = tmp_path / "tokens"
    write_secret_dir(tokens, {"ops": "ops-token-1"})
    sidecar = sidecar_factory(token_file=str(tokens), admin_tenants="ops")
    fill(sidecar.address, token="ops-token-1")
    code, _, err = run_cli(capsys, "stats", "--address", sidecar.address)
    assert code == 1 and "UNAUTHENTICATED" in err and sidecar.address in err
    mine = tmp_path / "token"
    mine.write_text("ops-token-1\n")
    code, out, _ = run_cli(capsys, "stats", "--address", sidecar.address, "--token-file", str(mine), "-o", "json")
    assert code == 0 and json.loads(out)["tiers"][0]["entries"] == 3
    monkeypatch.setenv("PROMPTCACHE_TOKEN", "ops-token-1")  # the token from the environment, never a flag
    code, out, _ = run_cli(capsys, "resize", "--address", sidecar.address, "6Mi", "-o", "json")
    assert code == 0 and json.loads(out)["memory_bytes"] == 6 << 20


@pytest.mark.parametrize("argv, message", [
    (["resize", "lots"], "lots"),
    (["lookup", *MODEL_ARGS, "--tokens", "1,two"], "token ids must be integers"),
    (["lookup", *MODEL_ARGS, "--tokens", "-1"], "0..4294967295"),
    (["lookup", *MODEL_ARGS, "--tokens", "[1.9, 2]"], "token ids must be integers"),  # was read as 1
    (["lookup", *MODEL_ARGS, "--tokens", "[true]"], "token ids must be integers"),
    (["lookup", *MODEL_ARGS, "--tokens", "1_000"], "token ids must be integers"),
    (["lookup", *MODEL_ARGS, "--tokens", "\u0661"], "token ids must be integers"),  # an Arabic-Indic 1
    (["lookup", *MODEL_ARGS, "--tokens", "[" * 100000], "not a JSON list of integers"),
    (["lookup", *MODEL_ARGS[:4], "--kv-dtype", "int3", *MODEL_ARGS[6:], "--tokens", "1"], "kv_dtype"),
    (["stats", "--timeout", "nan"], "--timeout must be a number of seconds above 0, got nan"),
    (["top", "--interval", "0"], "--interval must be a number of seconds above 0, got 0.0"),
    (["top", "--iterations", "-1"], "--iterations must be 0 (never stop) or more"),
])
def test_bad_input_is_refused_before_any_call(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv, "--address", "127.0.0.1:1")
    assert code == 2 and message in err


def test_a_tokens_file_that_never_ends_is_refused(capsys):
    code, _, err = run_cli(capsys, "lookup", *MODEL_ARGS, "--tokens-file", "/dev/zero", "--address", "127.0.0.1:1")
    assert code == 2 and "--tokens-file /dev/zero: more than 67108864 bytes" in err


@pytest.mark.parametrize("command", [["stats"], ["top"], ["resize", "1Gi"], ["purge", *MODEL_ARGS]])
@pytest.mark.parametrize("address,message", [
    ("127.0.0.1:99999", "--address '127.0.0.1:99999': the port '99999' is not a number within 0..65535"),
    ("sidecar", "--address 'sidecar': it is not HOST:PORT"),
])
def test_an_address_grpc_would_dial_elsewhere_is_refused(capsys, command, address, message):
    code, _, err = run_cli(capsys, *command, "--address", address)
    assert code == 2 and message in err and "Traceback" not in err


def test_unreachable_sidecar_is_one_line(capsys):
    code, _, err = run_cli(capsys, "stats", "--address", "127.0.0.1:1", "--timeout", "0.5")
    assert code == 1 and "UNAVAILABLE" in err and "Traceback" not in err


def test_top_row_rates_and_restart():
    tier = {"tier": "device", "entries": 4, "bytes_used": 1 << 20, "bytes_budget": 4 << 20}
    prev = {"hit_tokens": 100, "missed_tokens": 100, "tiers": [tier]}
    cur = {"hit_tokens": 400, "missed_tokens": 200, "tiers": [tier]}
    row = admin.top_row(prev, cur, 2.0, "12:00:00").split()
    assert row[:4] == ["12:00:00", "0.750", "150", "50"]
    restarted = admin.top_row(cur, {**prev, "hit_tokens": 10, "missed_tokens": 30}, 1.0, "t").split()
    assert restarted[1] == "0.250"


def _credential_cases(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * (2 << 20))
    return [("--token-file", str(tmp_path / "missing"), "No such file"), ("--token-file", str(tmp_path), "a directory"),
            ("--token-file", "/dev/zero", "not a regular file"), ("--token-file", str(fifo), "not a regular file"),
            ("--token-file", str(empty), "holds no token"), ("--token-file", str(huge), "larger than"),
            ("--tls-ca", str(tmp_path / "missing"), "No such file"), ("--tls-ca", "/dev/zero", "not a regular file"),
            ("--tls-cert", str(tmp_path), "a directory"), ("--tls-key", str(fifo), "not a regular file")]


def test_credential_file_errors_are_one_line_naming_flag_and_file(tmp_path):
    """Issue 27 #6: a missing or directory --token-file was a traceback, /dev/zero was read until MemoryError.
    Each bad credential file is now one line naming the flag and the path, read bounded and without blocking
    (a FIFO with no writer), in a real CLI process with a 5 GiB address-space limit."""
    # The limit is set by the child itself, not by a preexec_fn: this test process has used gRPC (the in-process
    # CLI tests), and a fork that runs Python before exec ran gRPC's fork handlers, which once aborted the child
    # (-6, "epoll_wait error: Bad file descriptor") before it ever reached the CLI.
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (5 << 30, 5 << 30)); "
               "sys.argv = ['promptcache'] + sys.argv[1:]; runpy.run_module('promptcache.cli', run_name='__main__')")
    for flag, path, why in _credential_cases(tmp_path):
        out = subprocess.run([sys.executable, "-c", limited, "stats", "--address", "127.0.0.1:1",
                              "--timeout", "0.5", flag, path], capture_output=True, text=True, timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (flag, path, out.stderr[-1500:])
        assert lines[0] == f"promptcache stats: {flag} {path}: {lines[0].split(': ', 2)[2]}" and why in lines[0], \
            lines[0]
